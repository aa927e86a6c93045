"""dflash.torch.chunked_reduce on the chunked-reduction cases it shares with
the C++ ChunkedReduction (chunking/testdata/chunked_reduce_cases.json,
written by tools/chunked_reduce_cases.py; //chunking:
chunked_reduce_cases_test runs the same file): chunk widths,
checkpointing, terms and input gradients against the file's float64
reference, or the error message."""

import json
import unittest
from unittest import mock

import torch
import torch.utils.checkpoint

from dflash.torch import chunked_reduce

CASES = "chunking/testdata/chunked_reduce_cases.json"


def case_function(name, dim, widths):
    """The cases' chunk functions (tools/chunked_reduce_cases.py), on the
    first two present slices; every call's width along `dim` of the first
    present slice goes to `widths`."""

    def function(*slices):
        present = [s for s in slices if s is not None]
        widths.append(present[0].shape[dim])
        a, b = present[:2]
        if name == "weighted_sums":
            return ((a * b).sum().reshape(1), (a * a * b).sum().reshape(1))
        return (a @ b, torch.stack([(b * b).sum(), b.sum()]))

    return function


class ChunkedReduceCasesTest(unittest.TestCase):

    def run_case(self, case):
        inputs = []
        for spec in case["inputs"]:
            if spec is None:
                inputs.append(None)
                continue
            t = torch.tensor(spec["data"], dtype=torch.float64).reshape(
                spec["shape"])
            inputs.append(t.requires_grad_(spec["requires_grad"]))
        widths = []
        function = case_function(case["function"], case["dim"], widths)
        real_checkpoint = torch.utils.checkpoint.checkpoint
        with mock.patch.object(torch.utils.checkpoint, "checkpoint",
                               wraps=real_checkpoint) as checkpoint, \
                torch.set_grad_enabled(case["grad_enabled"]):
            if "error" in case:
                with self.assertRaises(ValueError) as raised:
                    chunked_reduce(function, *inputs,
                                   chunk_size=case["chunk_size"],
                                   dim=case["dim"],
                                   checkpoint=case["checkpoint"])
                self.assertEqual(str(raised.exception), case["error"])
                self.assertEqual(widths, [])
                return
            terms = chunked_reduce(function, *inputs,
                                   chunk_size=case["chunk_size"],
                                   dim=case["dim"],
                                   checkpoint=case["checkpoint"])
        expected = case["expected"]
        self.assertEqual(widths, expected["widths"])
        self.assertEqual(checkpoint.called, expected["checkpointed"])
        self.assertEqual(len(terms), len(expected["terms"]))
        for term, want in zip(terms, expected["terms"]):
            torch.testing.assert_close(
                term.detach(), torch.tensor(want, dtype=torch.float64),
                rtol=1e-12, atol=1e-12)
        if case["grad_terms"] is None:
            return
        forward_calls = len(widths)
        total = sum((term * torch.tensor(g, dtype=torch.float64)).sum()
                    for term, g in zip(terms, case["grad_terms"]))
        total.backward()
        # A checkpointed chunk runs again in backward, each exactly once.
        self.assertEqual(len(widths) - forward_calls,
                         forward_calls if expected["checkpointed"] else 0)
        for i, (t, want) in enumerate(zip(inputs, expected["grads"])):
            if want is None:
                self.assertTrue(t is None or t.grad is None, f"input {i}")
                continue
            torch.testing.assert_close(
                t.grad.reshape(-1), torch.tensor(want, dtype=torch.float64),
                rtol=1e-12, atol=1e-12, msg=lambda m: f"grads[{i}]: {m}")

    def test_every_case_as_the_reference(self):
        with open(CASES) as f:
            cases = json.load(f)["cases"]
        self.assertGreaterEqual(len(cases), 10)
        for case in cases:
            with self.subTest(case["name"]):
                self.run_case(case)


if __name__ == "__main__":
    unittest.main(verbosity=2)
