"""GlobalNormalizer's bad arguments are clear Python exceptions, never a
hang: an unknown mode or grad_sync, torch.distributed not initialised (or
destroyed since), a group of the wrong type or that this rank is not in,
bad terms and parameters; ranks whose packed pairs differ (other names,
other shapes; at the first step or after an agreed one) raise a ValueError
on every rank, and pairs changed alike on every rank are agreed again. The
test harness itself turns a hang into a failure.
"""

import os
import sys
import tempfile
import time
import unittest

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ranks  # noqa: E402
from dflash.torch.distributed import GlobalNormalizer  # noqa: E402


class NotInitialisedTest(unittest.TestCase):
    def test_unknown_mode(self):
        # Checked first: no process group is needed to see it.
        for mode in ("dflahs", "DFlash", "", None, 3):
            with self.subTest(mode=mode):
                with self.assertRaisesRegex(
                        ValueError, r"mode: must be one of dflash, dspark, "
                        r"domino .*got " + repr(mode).replace("'", ".")):
                    GlobalNormalizer(mode=mode)

    def test_default_group_not_initialised(self):
        self.assertFalse(dist.is_initialized())
        for mode in ("dflash", "dspark", "domino"):
            with self.subTest(mode=mode):
                with self.assertRaisesRegex(
                        ValueError, r"group: torch.distributed is not "
                        r"initialised: call torch.distributed."
                        r"init_process_group"):
                    GlobalNormalizer(mode=mode)

    def test_group_of_the_wrong_type(self):
        for group in ("world", 0, object()):
            with self.subTest(group=type(group).__name__):
                with self.assertRaisesRegex(
                        TypeError, r"group: must be a torch.distributed."
                        r"ProcessGroup or None"):
                    GlobalNormalizer(group)


class OneRankTest(unittest.TestCase):
    """Argument checks on a process group of one rank, in this process."""

    def setUp(self):
        directory = tempfile.mkdtemp(dir=os.environ.get("TEST_TMPDIR"))
        dist.init_process_group(
            "gloo", init_method="file://" + os.path.join(directory, "r"),
            rank=0, world_size=1)

    def tearDown(self):
        if dist.is_initialized():
            dist.destroy_process_group()

    def test_unknown_grad_sync(self):
        with self.assertRaisesRegex(
                ValueError, r"grad_sync: must be 'mean' or 'sum', got 'avg'"):
            GlobalNormalizer(grad_sync="avg")

    def test_bad_terms(self):
        norm = GlobalNormalizer()
        with self.assertRaisesRegex(TypeError, r"terms: must be dflash_"
                                    r"objective's ObjectiveTerms or a "
                                    r"\(numerator, denominator\) pair"):
            norm.loss(torch.tensor(1.0))
        with self.assertRaisesRegex(TypeError, r"terms\[1\] \(the "
                                    r"denominator\): must be a torch.Tensor"):
            norm.loss((torch.tensor(1.0), 2.0))
        with self.assertRaisesRegex(ValueError, r"terms\[0\] \(the "
                                    r"numerator\): must hold one value, got "
                                    r"shape \(2,\)"):
            norm.loss((torch.ones(2), torch.tensor(2.0)))
        with self.assertRaisesRegex(ValueError, r"add_metric\('x'\): the "
                                    r"numerator's shape \(2,\) differs"):
            norm.add_metric("x", torch.ones(2), torch.ones(3))
        with self.assertRaisesRegex(TypeError, r"parameters\[0\]: must be a "
                                    r"torch.Tensor, got int"):
            norm.step([1])

    def test_one_rank_is_the_plain_ratio(self):
        norm = GlobalNormalizer()
        x = torch.tensor(3.0, dtype=torch.float64, requires_grad=True)
        for num, den in ((2.0, 4.0), (5.0, 6.0)):
            norm.loss((x * num, torch.tensor(den))).backward()
        result = norm.step([x])
        self.assertAlmostEqual(result.loss, 21.0 / 10.0, places=14)
        self.assertAlmostEqual(float(x.grad), 7.0 / 10.0, places=14)
        self.assertEqual(result.micro_batches, 2)

    def test_destroyed_group(self):
        norm = GlobalNormalizer()
        dist.destroy_process_group()
        pair = (torch.tensor(1.0), torch.tensor(1.0))
        with self.assertRaisesRegex(ValueError, r"GlobalNormalizer.loss: "
                                    r"torch.distributed is no longer "
                                    r"initialised"):
            norm.loss(pair)
        with self.assertRaisesRegex(ValueError, r"GlobalNormalizer.step: "
                                    r"torch.distributed is no longer "
                                    r"initialised"):
            norm.step()


def _raised(call):
    """The call's exception as (type name, message), or None."""
    try:
        call()
    except Exception as error:  # noqa: BLE001 - recorded for the parent.
        return type(error).__name__, str(error)
    return None


def _pair():
    return (torch.tensor(1.0, dtype=torch.float64),
            torch.tensor(2.0, dtype=torch.float64))


def mismatch_rank(rank, world):
    """The scenarios of MismatchTest on one rank: what each raised."""
    out = {}
    # A group this rank is not in.
    group = dist.new_group([0, 1])
    out["non_member"] = _raised(lambda: GlobalNormalizer(group))

    # Other pairs at the first step: an extra metric on rank 0.
    norm = GlobalNormalizer(mode="dspark")
    norm.loss(_pair())
    if rank == 0:
        norm.add_metric("extra", 1.0, 1.0)
    out["extra_metric"] = _raised(norm.step)

    # Same names, other shapes.
    norm = GlobalNormalizer()
    norm.loss(_pair())
    norm.add_metric("x", torch.zeros(4 + (rank == 1)), torch.ones(4 + (
        rank == 1)))
    out["other_shape"] = _raised(norm.step)

    # Same size, other names.
    norm = GlobalNormalizer(mode="domino")
    norm.loss(_pair())
    norm.add_metric("a" if rank == 2 else "b", 1.0, 1.0)
    out["other_name"] = _raised(norm.step)

    # An agreed step, then pairs that change on rank 1 only: every rank
    # raises (the buffer's flag), none hangs.
    norm = GlobalNormalizer()
    norm.loss(_pair())
    out["agreed"] = _raised(norm.step)
    norm.loss(_pair())
    if rank == 1:
        norm.add_metric("late", torch.ones(3), torch.ones(3))
    out["changed_on_one_rank"] = _raised(norm.step)

    # An agreed step, then pairs that change alike on every rank: agreed
    # again, and summed.
    norm = GlobalNormalizer()
    norm.loss(_pair())
    norm.step()
    norm.loss(_pair())
    norm.add_metric("late", torch.full((3,), float(rank)), torch.ones(3))
    result = norm.step()
    out["changed_alike"] = result.metrics["late"].tolist()
    return out


def hang_rank(rank, world):
    if rank == 0:
        dist.all_reduce(torch.zeros(1))  # Rank 1 never joins.
    else:
        time.sleep(600)


class MismatchTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.results = ranks.run_ranks(mismatch_rank, 3)

    def assertEveryRankRaises(self, scenario, pattern):
        for rank, result in enumerate(self.results):
            with self.subTest(rank=rank):
                self.assertIsNotNone(result[scenario], scenario)
                kind, message = result[scenario]
                self.assertEqual(kind, "ValueError", message)
                self.assertRegex(message, pattern)

    def test_group_without_this_rank(self):
        self.assertIsNone(self.results[0]["non_member"])
        self.assertIsNone(self.results[1]["non_member"])
        kind, message = self.results[2]["non_member"]
        self.assertEqual(kind, "ValueError")
        self.assertRegex(message, r"group: this rank is not a member")

    def test_an_extra_metric_on_one_rank(self):
        self.assertEveryRankRaises(
            "extra_metric", r"GlobalNormalizer.step: the ranks packed "
            r"different pairs \(rank 0: \d+ values .*rank 1: .*rank 2: .*\); "
            r"this rank packed .*Every rank must use the same mode")

    def test_other_shapes(self):
        self.assertEveryRankRaises("other_shape",
                                   r"the ranks packed different pairs")
        self.assertRegex(self.results[1]["other_shape"][1], r"x\[5\]")

    def test_other_names(self):
        self.assertEveryRankRaises("other_name",
                                   r"the ranks packed different pairs")

    def test_pairs_changed_on_one_rank_after_an_agreed_step(self):
        for result in self.results:
            self.assertIsNone(result["agreed"])
        self.assertEveryRankRaises("changed_on_one_rank",
                                   r"the ranks packed different pairs")

    def test_pairs_changed_alike_are_agreed_again(self):
        for result in self.results:
            self.assertEqual(result["changed_alike"], [1.0, 1.0, 1.0])


class HarnessTest(unittest.TestCase):
    def test_a_hang_fails_instead_of_blocking(self):
        start = time.monotonic()
        with self.assertRaisesRegex(AssertionError, r"a hang"):
            ranks.run_ranks(hang_rank, 2, timeout=5)
        self.assertLess(time.monotonic() - start, 60)


if __name__ == "__main__":
    unittest.main(verbosity=2)
