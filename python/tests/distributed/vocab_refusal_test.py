"""A rank failing in Python after the vocab-parallel agreement and before
its run (a check the agreement does not cover, a MemoryError allocating
the head's buffers): it sends its refusal where the others wait, so every
rank raises (the others naming it and its error's kind) instead of the
others waiting for the group's timeout; the next call runs on every rank.
"""

import os
import sys
import unittest

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ranks  # noqa: E402
from dflash.torch import dflash_objective  # noqa: E402
from dflash.torch import objective as objective_module  # noqa: E402
from dflash.torch.distributed import shard_rows  # noqa: E402

V, H = 11, 4
FAILING = 1


def _raised(call):
    try:
        call()
    except Exception as error:  # noqa: BLE001 - recorded for the parent
        return type(error).__name__, str(error)
    return None


def refusal_rank(rank, world):
    g = torch.Generator().manual_seed(3)
    whole = torch.randn(V, H, dtype=torch.float64, generator=g)
    hidden = torch.randn(1, 2, 3, H, dtype=torch.float64, generator=g,
                         requires_grad=True)
    targets = torch.randint(0, V, (1, 2, 3), generator=g)
    mask = torch.ones(1, 2, 3, dtype=torch.float64)
    group = dist.group.WORLD
    weight = shard_rows(whole, group)

    def call(**kw):
        return lambda: dflash_objective(hidden, weight, targets, mask,
                                        vocab_group=group, threads=1, **kw)

    out = {}
    # A prepared projection of the wrong type on one rank: the agreement
    # does not see it.
    out["prepared_type"] = _raised(call(
        prepared_projection="laid out" if rank == FAILING else None))
    # A MemoryError allocating the head's buffers on one rank.
    real_empty = objective_module._empty
    if rank == FAILING:
        def no_memory(name, *args, **kwargs):
            raise MemoryError(f"{name}: injected")
        objective_module._empty = no_memory
    try:
        out["no_memory"] = _raised(call())
    finally:
        objective_module._empty = real_empty
    # The group goes on: a call after both runs on every rank and gives
    # the single process's loss (the whole weight here).
    terms = dflash_objective(hidden, weight, targets, mask,
                             vocab_group=group, threads=1)
    whole_terms = dflash_objective(hidden, whole, targets, mask, threads=1)
    out["after"] = (float(terms.loss_num), float(whole_terms.loss_num))
    return out


class RefusalAfterTheAgreementTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.results = ranks.run_ranks(refusal_rank, 3, timeout=240)

    def assertStopped(self, scenario, kind, pattern, code, others_kind):
        for rank, result in enumerate(self.results):
            with self.subTest(scenario=scenario, rank=rank):
                self.assertIsNotNone(result[scenario], scenario)
                got_kind, message = result[scenario]
                if rank == FAILING:
                    self.assertEqual(got_kind, kind, message)
                    self.assertRegex(message, pattern)
                else:
                    # The binding's exception for the failing rank's code.
                    self.assertEqual(got_kind, others_kind, message)
                    self.assertRegex(
                        message, rf"vocab_shard: process {FAILING} of 3 "
                        rf"failed: {code} \(its own error says why\)")

    def test_a_check_the_agreement_does_not_cover(self):
        self.assertStopped("prepared_type", "TypeError",
                           r"prepared_projection: must be a "
                           r"dflash.PreparedProjection or None, got str",
                           "INVALID_ARGUMENT", "ValueError")

    def test_a_memory_error_before_the_run(self):
        self.assertStopped("no_memory", "MemoryError", r"injected",
                           "RESOURCE_EXHAUSTED", "MemoryError")

    def test_the_next_call_runs(self):
        for rank, result in enumerate(self.results):
            with self.subTest(rank=rank):
                got, expected = result["after"]
                self.assertAlmostEqual(got, expected, delta=1e-12 * abs(
                    expected))


if __name__ == "__main__":
    unittest.main()
