"""separate_numerators and dflash.specforge's DSpark and Domino chunk
functions wait on the device once a step: not in forward, once in backward.

The tensors a run makes stand for device tensors (DeviceTensor, a
torch.Tensor subclass that records each read of its values to the host,
and each move to another device), and every torch.tensor or
torch.as_tensor call given a device is recorded as a blocking copy from
the host. separate_numerators is checked with a stand-in head (three
numerators, two as tensors, one as the float a head's report gives):
forward reads nothing and copies nothing, backward reads once (the
incoming gradients, stacked) whether it rescales or reruns. The
numerators are exactly torch.tensor(float(N_i), dtype) (the rounding of a
host round trip) for float64, float32, float16 and bfloat16 outputs, and
the gradients are those of the stand-in's float64 formulas. SpecForge's
chunk functions (where specforge imports) read the head's CE numerator
never, and copy only the per-position lists DSpark's diagnostics give.
"""

import dataclasses
import math
import os
import sys
import unittest
from typing import Any, List
from unittest import mock

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import specforge_test as st  # noqa: E402
from dflash.torch import separate_numerators  # noqa: E402

_READS = frozenset(("cpu", "tolist", "item", "numpy", "__array__",
                    "__float__", "__int__", "__bool__", "__index__",
                    "__repr__", "__format__"))
_MOVES = frozenset(("to", "copy_", "cuda"))
_reads: List[str] = []
_copies: List[str] = []


def _names_device(args: Any, kwargs: Any) -> bool:
    return "device" in kwargs or any(
        isinstance(a, (str, torch.device, torch.Tensor)) for a in args[1:])


class DeviceTensor(torch.Tensor):
    """Stands for a tensor on the device: reading its values to the host or
    moving it is recorded in _reads; its views and the results of other
    ops stay DeviceTensors."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in _READS or (name in _MOVES
                              and _names_device(args, kwargs)):
            _reads.append(name)
        return super().__torch_function__(func, types, args, kwargs)


def on_device(t: torch.Tensor) -> torch.Tensor:
    return t.as_subclass(DeviceTensor)


_REAL = {name: getattr(torch, name) for name in ("tensor", "as_tensor")}


def _recording(name: str) -> Any:
    def made(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("device") is not None:
            _copies.append(name)
        return _REAL[name](*args, **kwargs)
    return made


def backward(outputs: Any, grads: List[torch.Tensor]) -> None:
    """torch.autograd.backward from plain views of `outputs`: given
    DeviceTensor outputs, torch 2's would run the whole backward with
    DeviceTensor's __torch_function__ off (reading nothing)."""
    torch.autograd.backward([t.as_subclass(torch.Tensor) for t in outputs],
                            grads)


class Recorded:
    """Records reads (DeviceTensor) and copies from the host."""

    def __enter__(self) -> "Recorded":
        del _reads[:], _copies[:]
        self.patches = [mock.patch.object(torch, n, _recording(n))
                        for n in _REAL]
        for p in self.patches:
            p.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        for p in self.patches:
            p.stop()
        self.reads, self.copies = list(_reads), list(_copies)


def formulas(x: torch.Tensor, y: torch.Tensor) -> List[torch.Tensor]:
    """The stand-in head's three numerators, float64."""
    return [(x * x * y).sum(), torch.sin(x).sum() + y.sum(),
            (torch.exp(-x) * y).sum()]


def stand_in(coefficients, inputs):
    """A NumeratorRun: loss_num = sum_i c_i N_i; N_0 and N_1 as device
    tensors, N_2 as a float (as the head's report gives DSpark's L1: read
    to the host by the head, not here)."""
    x, y = inputs
    values = formulas(x, y)
    loss_num = sum(c * v for c, v in zip(coefficients, values))
    host = values[2].detach().as_subclass(torch.Tensor)
    return loss_num, [values[0].detach(), values[1].detach(),
                      float(host)], None


def leaves():
    g = torch.Generator().manual_seed(3)
    return [torch.randn(5, generator=g, dtype=torch.float64),
            torch.rand(5, generator=g, dtype=torch.float64) + 0.5]


COEFFICIENTS = [0.3, 1.7, 0.25]
DTYPES = [torch.float64, torch.float32, torch.bfloat16]


class SeparateNumeratorsReadsTest(unittest.TestCase):

    def run_case(self, weights: List[float], calls: int,
                 effective: List[float]) -> None:
        """Backward with incoming gradients `weights` (each rounded to its
        numerator's dtype): `calls` runs, the gradient of sum_i
        effective[i] N_i."""
        base = leaves()
        inputs = [on_device(t.clone()).requires_grad_() for t in base]
        runs = []

        def run(coefficients, given):
            runs.append(list(coefficients))
            return stand_in(coefficients, given)

        with Recorded() as forward:
            numerators, _ = separate_numerators(run, COEFFICIENTS, inputs,
                                                DTYPES)
        self.assertEqual((forward.reads, forward.copies), ([], []))
        want = formulas(*base)
        for got, value, dtype in zip(numerators, want, DTYPES):
            self.assertEqual(got.dtype, dtype)
            self.assertTrue(torch.equal(
                got.detach().as_subclass(torch.Tensor),
                torch.tensor(float(value), dtype=dtype)), (got, value))
        grads = [on_device(torch.tensor(w, dtype=d))
                 for w, d in zip(weights, DTYPES)]
        with Recorded() as seen_backward:
            backward(numerators, grads)
        self.assertEqual((seen_backward.reads, seen_backward.copies),
                         (["tolist"], []))
        self.assertEqual(len(runs), calls)
        ref = [t.clone().requires_grad_() for t in base]
        expected = torch.autograd.grad(
            sum(w * v for w, v in zip(effective, formulas(*ref))), ref)
        for got, exp in zip(inputs, expected):
            torch.testing.assert_close(got.grad.as_subclass(torch.Tensor),
                                       exp, rtol=1e-13, atol=1e-13)

    def test_proportional_weights_rescale(self):
        # g = 2 c within each dtype's rounding (bfloat16 rounds 3.4): one
        # run, the head's gradient scaled by g_0 / c_0 = 2.
        twice = [2 * c for c in COEFFICIENTS]
        self.run_case(twice, 1, twice)

    def test_other_weights_rerun(self):
        # Both signs: two more runs, the weights as given (each exact in
        # its dtype).
        self.run_case([1.0, -0.5, 0.0], 3, [1.0, -0.5, 0.0])

    def test_rescaled_gradient_is_the_host_quotient(self):
        # The scale s = g_0 / c_0 (float64, on the host, as before) goes to
        # the head's loss_num in its dtype: the gradient is exactly the
        # head's for torch.tensor(s, dtype).
        base = leaves()
        inputs = [t.clone().requires_grad_() for t in base]
        numerators, _ = separate_numerators(stand_in, COEFFICIENTS, inputs,
                                            DTYPES)
        g0 = 0.7 / 3
        weights = [g0 / COEFFICIENTS[0] * c for c in COEFFICIENTS]
        torch.autograd.backward(numerators, [
            torch.tensor(w, dtype=d) for w, d in zip(weights, DTYPES)])
        ref = [t.clone().requires_grad_() for t in base]
        loss_num = stand_in(COEFFICIENTS, ref)[0]
        expected = torch.autograd.grad(
            loss_num, ref, torch.tensor(g0 / COEFFICIENTS[0],
                                        dtype=loss_num.dtype))
        for got, exp in zip(inputs, expected):
            self.assertTrue(torch.equal(got.grad, exp))

    def test_without_gradients_nothing_is_read(self):
        inputs = [on_device(t) for t in leaves()]
        with Recorded() as seen:
            numerators, _ = separate_numerators(stand_in, COEFFICIENTS,
                                                inputs, DTYPES)
        self.assertEqual((seen.reads, seen.copies), ([], []))
        self.assertFalse(any(t.requires_grad for t in numerators))

    def test_rounding_is_the_host_round_trips(self):
        # Tensors of float64 and float32 and floats, to every floating
        # dtype: exactly torch.tensor(float(v), dtype), at magnitudes that
        # round in each (and overflow float16).
        g = torch.Generator().manual_seed(8)
        scales = torch.tensor([10.0 ** e for e in range(-9, 9, 2)],
                              dtype=torch.float64)
        values = (torch.randn(len(scales), 6, generator=g,
                              dtype=torch.float64)
                  * scales[:, None]).reshape(-1).tolist()
        values += [0.0, -0.0, 1.0 + 2.0 ** -40, 65520.0, 2.0 ** -140]
        sources = [lambda v: torch.tensor(v, dtype=torch.float64),
                   lambda v: torch.tensor(v, dtype=torch.float32),
                   lambda v: v]
        targets = [torch.float64, torch.float32, torch.float16,
                   torch.bfloat16]
        x = torch.zeros((), dtype=torch.float64)
        for source in sources:
            given = [source(v) for v in values]
            for dtype in targets:
                with torch.no_grad():
                    got, _ = separate_numerators(
                        lambda c, inputs: (inputs[0], given, None),
                        [1.0] + [0.0] * (len(given) - 1), [x],
                        [dtype] * len(given))
                for value, out in zip(given, got):
                    want = torch.tensor(float(value), dtype=dtype)
                    self.assertTrue(
                        torch.equal(out, want)
                        and math.copysign(1, out) == math.copysign(1, want),
                        (value, dtype, out, want))

    def test_bad_numerator(self):
        x = torch.zeros(3, dtype=torch.float64, requires_grad=True)
        with self.assertRaisesRegex(ValueError, r"run's numerators\[1\]: "
                                    r"must be a float or a one-element "
                                    r"tensor, got shape \[2\]"):
            separate_numerators(
                lambda c, inputs: (inputs[0].sum(),
                                   [1.0, torch.zeros(2)], None),
                [0.5, 0.5], [x], [torch.float64] * 2)


def device_ce(original: Any, calls: List[int]) -> Any:
    """The head as dflash.specforge calls it, its CE numerator a
    DeviceTensor; each call appended to `calls`."""
    def head(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        terms = original(*args, **kwargs)
        diagnostics = dataclasses.replace(
            terms.diagnostics,
            ce_loss_num=on_device(terms.diagnostics.ce_loss_num))
        return terms._replace(diagnostics=diagnostics)
    return head


@unittest.skipIf(st.NO_SPECFORGE, st.NO_SPECFORGE)
class ChunkFunctionsReadsTest(st.FamilyCase):
    """SpecForge's DSpark and Domino chunk functions through the patch: no
    read of the head's CE numerator, no copy but the per-position lists
    (DSpark's ce_position_num and teacher_agreement_per_position); the
    numerators SpecForge's own."""

    def check(self, model, name, args, weights, copies, tolerance):
        count = len(weights)
        want = getattr(model, name)(*args)[:count]
        dsf = st.dsf
        calls: List[int] = []
        dsf.apply()
        try:
            with mock.patch.object(dsf, "dflash_objective",
                                   device_ce(dsf.dflash_objective, calls)), \
                    Recorded() as forward:
                terms = getattr(model, name)(*args)
            grads = [on_device(torch.full_like(t, w))
                     for t, w in zip(terms, weights)]
            with Recorded() as seen_backward:
                backward(terms[:count], grads)
        finally:
            dsf.revert()
        self.assertEqual(len(calls), 1)  # Through the head, once.
        self.assertEqual((forward.reads, forward.copies), ([], copies))
        self.assertEqual((seen_backward.reads, seen_backward.copies),
                         (["tolist"], []))
        self.assertSame(
            {i: t.detach().as_subclass(torch.Tensor)
             for i, t in enumerate(terms[:count])},
            {i: t.detach() for i, t in enumerate(want)}, tolerance)

    def test_dspark(self):
        hidden, prev_ids, target_ids, teacher, eval_mask = st.chunk_batch(
            torch.float32)
        model = st.make_dspark(lambda: st.dspark_draft("gated"))()
        hidden.requires_grad_()
        args = (hidden, prev_ids, target_ids, eval_mask.float(), eval_mask,
                teacher)
        # CE, L1 and confidence weighed by the alphas (no second call).
        self.check(model, "_dspark_objective_chunk_terms", args,
                   [0.1, 0.9, 1.0], ["as_tensor", "as_tensor"],
                   st.TOLERANCE[torch.float32])

    def test_domino(self):
        hidden, prev_ids, target_ids, _, eval_mask = st.chunk_batch(
            torch.float64)
        model = st.make_domino(lambda: st.domino_draft(False))().double()
        hidden.requires_grad_()
        mask = eval_mask.double()
        mask[..., 0] = 0
        self.check(model, "_domino_objective_chunk_terms",
                   (hidden, prev_ids, target_ids, mask, mask.clone()),
                   [1.0, 0.0], [], 1e-9)


if __name__ == "__main__":
    unittest.main(verbosity=2)
