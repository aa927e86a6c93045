"""A rank failing in Python after the vocab-parallel agreement and before
its run (a check the agreement does not cover, a MemoryError allocating
the head's buffers): it sends its refusal where the others wait, so every
rank raises (the others naming it and its error's kind) instead of the
others waiting for the group's timeout. And a real SIGINT on one rank
during its run: it raises in that rank's exchange, and every rank stops
there; an exception whose message cannot be read, raised in one rank's
exchange. And the agreement covering the correction weight's
requires_grad. The next call runs on every rank.
"""

import os
import signal
import sys
import threading
import unittest

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ranks  # noqa: E402
from dflash.torch import dflash_objective  # noqa: E402
from dflash.torch import _vocab_parallel as parallel_module  # noqa: E402
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


def _raised_any(call):
    try:
        call()
    except BaseException as error:  # noqa: BLE001 - KeyboardInterrupt too
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
    # A real Ctrl-C (SIGINT to this process, from another thread as a
    # terminal's comes) on one rank as its head's exchange starts a chunk's
    # gather, with head.threads 2: that rank raises KeyboardInterrupt there
    # and the others an error naming it, not after the call returns (where
    # the others would wait in the gradient sum).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    real_all_gather = dist.all_gather
    calls = []

    def interrupted(*args, **kwargs):
        calls.append(1)
        if rank == FAILING and len(calls) == 3:
            # From another thread, as a terminal's Ctrl-C comes: Python
            # runs the handler on its main thread.
            sender = threading.Thread(
                target=os.kill, args=(os.getpid(), signal.SIGINT))
            sender.start()
            sender.join()
        return real_all_gather(*args, **kwargs)

    dist.all_gather = interrupted
    try:
        out["sigint"] = _raised_any(lambda: dflash_objective(
            hidden, weight, targets, mask, vocab_group=group, threads=2))
    finally:
        dist.all_gather = real_all_gather
    # An exception whose message cannot be read, raised in one rank's
    # exchange: an error naming that, never an exception through the
    # head's C++ frames.
    class Unprintable(Exception):
        def __str__(self):
            raise RuntimeError("no message")

    seen = []

    def unprintable(*args, **kwargs):
        seen.append(1)
        if rank == FAILING and len(seen) == 2:  # The run's handshake.
            raise Unprintable()
        return real_all_gather(*args, **kwargs)

    dist.all_gather = unprintable
    try:
        out["unprintable"] = _raised_any(call())
    finally:
        dist.all_gather = real_all_gather
    # Domino's correction weight requiring a gradient on one rank alone
    # (it decides whether a collective runs in backward): refused by the
    # agreement on every rank.
    z = torch.randn(1, 2, 3, 2, dtype=torch.float64, generator=g)
    correction = shard_rows(
        torch.randn(V, 2, dtype=torch.float64, generator=g), group)
    out["correction_grad"] = _raised(lambda: dflash_objective(
        hidden, weight, targets, mask, vocab_group=group, threads=1,
        config="loss { domino { lambda_base: 0.3 } }",
        correction_inputs=z,
        correction_weight=correction.clone().requires_grad_(rank == FAILING)))
    # A refusal whose exception's message cannot be read, before the run
    # (an allocation of the head's buffers): it still goes.
    real_empty = objective_module._empty
    if rank == FAILING:
        def unreadable(name, *args, **kwargs):
            raise Unprintable()
        objective_module._empty = unreadable
    try:
        dflash_objective(hidden, weight, targets, mask, vocab_group=group,
                         threads=1)
        out["unreadable_refusal"] = None
    except BaseException as error:  # noqa: BLE001 - recorded for the parent
        out["unreadable_refusal"] = (
            type(error).__name__,
            "" if isinstance(error, Unprintable) else str(error))
    finally:
        objective_module._empty = real_empty
    # rows="local" (each rank its own rows): a refusal after the agreement
    # meets the others in the status gather before the row gathers, not
    # inside a row gather of another size.
    own = torch.randn(1 + rank, 2, 3, H, dtype=torch.float64, generator=g)
    own_targets = torch.randint(0, V, (1 + rank, 2, 3), generator=g)
    own_mask = torch.ones(1 + rank, 2, 3, dtype=torch.float64)

    def local(**kw):
        return lambda: dflash_objective(own, weight, own_targets, own_mask,
                                        vocab_group=group, rows="local",
                                        threads=1, **kw)

    out["local_prepared"] = _raised(local(
        prepared_projection="laid out" if rank == FAILING else None))
    real_rows = parallel_module.rows_to_send
    if rank == FAILING:
        def no_row_memory(*args, **kwargs):
            raise MemoryError("rows: injected")
        parallel_module.rows_to_send = no_row_memory
    try:
        out["local_no_memory"] = _raised(local())
    finally:
        parallel_module.rows_to_send = real_rows
    local_terms = dflash_objective(own, weight, own_targets, own_mask,
                                   vocab_group=group, rows="local",
                                   threads=1)
    whole_local = dflash_objective(own, whole, own_targets, own_mask,
                                   threads=1)
    out["local_after"] = (float(local_terms.loss_num),
                          float(whole_local.loss_num))
    # The group goes on: a call after these runs on every rank and gives
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

    def test_a_real_ctrl_c_in_one_ranks_exchange(self):
        self.assertStopped("sigint", "KeyboardInterrupt", r"^$", "CANCELLED",
                           "RuntimeError")

    def test_an_exception_without_a_readable_message(self):
        self.assertStopped("unprintable", "RuntimeError",
                           r"vocab_group: the all-gather of the "
                           r"vocab-parallel head raised an exception whose "
                           r"message cannot be read", "ABORTED",
                           "RuntimeError")

    def test_a_correction_weight_requiring_grad_on_one_rank(self):
        for rank, result in enumerate(self.results):
            with self.subTest(rank=rank):
                kind, message = result["correction_grad"]
                self.assertEqual(kind, "ValueError", message)
                self.assertRegex(message, r"vocab_group: the ranks' inputs' "
                                 r"devices, dtypes, shapes and requires_grad "
                                 r"differ")

    def test_a_refusal_whose_message_cannot_be_read(self):
        self.assertStopped("unreadable_refusal", "Unprintable", r"^$",
                           "INVALID_ARGUMENT", "ValueError")

    def test_local_rows_refusals_after_the_agreement(self):
        self.assertStopped("local_prepared", "TypeError",
                           r"prepared_projection: must be a "
                           r"dflash.PreparedProjection or None, got str",
                           "INVALID_ARGUMENT", "ValueError")
        self.assertStopped("local_no_memory", "MemoryError",
                           r"rows: injected", "RESOURCE_EXHAUSTED",
                           "MemoryError")
        for rank, result in enumerate(self.results):
            with self.subTest(rank=rank):
                got, expected = result["local_after"]
                self.assertAlmostEqual(got, expected, delta=1e-12 * abs(
                    expected))

    def test_the_next_call_runs(self):
        for rank, result in enumerate(self.results):
            with self.subTest(rank=rank):
                got, expected = result["after"]
                self.assertAlmostEqual(got, expected, delta=1e-12 * abs(
                    expected))


if __name__ == "__main__":
    unittest.main()
