"""The vocab-parallel head's refusals: each is a clear exception on every
rank of the group, never a hang (the harness's join times out otherwise).
Non-CPU tensors, shards that are not the balanced split of the
vocabulary, ranks whose shapes, dtypes, targets, configs or inputs
requiring a gradient differ, a vocabulary smaller than the group, a rank
whose own arguments are refused (the others raise too), top_k beyond the
whole vocabulary, the options the vocab-parallel head refuses (a
checkpoint memory budget that would not keep every chunk), a
vocab_group that is no process group, and a Python exception inside the
exchange. And a rank failing alone after the agreement (a check of the
binding's, an exception or KeyboardInterrupt in its exchange at each kind
of gather): every rank raises, the others naming it.
"""

import os
import sys
import tempfile
import unittest

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ranks  # noqa: E402
from dflash import _core  # noqa: E402
from dflash.torch import FusedHead, dflash_objective  # noqa: E402
from dflash.torch import _vocab_parallel  # noqa: E402
from dflash.torch.distributed import (shard_linear, shard_rows,  # noqa: E402
                                      vocab_shard_range)

V, H = 11, 4


def _raised(call):
    try:
        call()
    except Exception as error:  # noqa: BLE001 - recorded for the parent
        return type(error).__name__, str(error)
    return None


def _batch(b=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, 2, 3, H, dtype=torch.float64, generator=g),
            torch.randint(0, V, (b, 2, 3), generator=g),
            torch.ones(b, 2, 3, dtype=torch.float64))


def _weight():
    g = torch.Generator().manual_seed(5)
    return torch.randn(V, H, dtype=torch.float64, generator=g)


def refusals_rank(rank, world):
    group = dist.group.WORLD
    weight = shard_rows(_weight(), group)
    hidden, targets, mask = _batch()
    out = {}

    def call(h=hidden, w=weight, t=targets, m=mask, **kw):
        return lambda: dflash_objective(h, w, t, m, vocab_group=group,
                                        threads=1, **kw)

    # Rows that are not the balanced split (rank 0 one row short, the last
    # rank one row more): every rank raises.
    cuts = (0, 3, 7, 11)  # 3, 4, 4 rows: not 4, 4, 3.
    shifted = _weight()[cuts[rank]:cuts[rank + 1]]
    out["not_balanced"] = _raised(call(w=shifted.contiguous()))
    # Other shapes on one rank.
    other = _batch(b=2 if rank == 1 else 1)
    out["other_shapes"] = _raised(call(h=other[0], t=other[1], m=other[2]))
    # Other targets on one rank.
    out["other_targets"] = _raised(
        call(t=(targets + (rank == 1)) % V))
    # Other configs.
    out["other_config"] = _raised(call(gamma=7.0 + rank))
    # A rank whose own arguments are refused (a meta tensor: not on the
    # CPU; a CUDA tensor is refused alike): it names them, the others say
    # which rank refused.
    out["non_cpu"] = _raised(call(
        h=torch.empty(1, 2, 3, H, dtype=torch.float64, device="meta")
        if rank == 1 else hidden))
    out["bad_type"] = _raised(call(h="hidden" if rank == 0 else hidden))
    # What only the C++ head would see on one rank: its shard in another
    # dtype, or hidden requiring a gradient there alone.
    out["weight_dtype"] = _raised(call(
        w=weight.float() if rank == 1 else weight))
    out["requires_grad"] = _raised(call(
        h=hidden.clone().requires_grad_(rank == 2),
        w=weight.clone().requires_grad_()))  # A gradient on every rank.
    # A vocabulary smaller than the group: the last rank holds no class.
    tiny = _weight()[:2]
    start, stop = min(rank, 2), min(rank + 1, 2)
    out["vocab_below_world"] = _raised(call(
        w=tiny[start:stop].contiguous(), t=targets % 2))
    # top_k beyond the whole vocabulary (11 < 12 <= 64).
    out["top_k"] = _raised(call(top_k=V + 1))
    # What the vocab-parallel head refuses.
    out["memory_budget"] = _raised(call(
        h=hidden.clone().requires_grad_(),  # A training call keeps chunks.
        config=("loss { dflash { gamma: 7 } } "
                "checkpoint { memory_budget_bytes: 8 }"),
        mode="checkpoint"))
    # A Python exception inside the exchange: an exception on every rank.
    original = _vocab_parallel._all_gather_into

    def failing(group, world):
        def all_gather(local, out):
            raise KeyError("the transport failed")
        return all_gather

    _vocab_parallel._all_gather_into = failing
    try:
        out["exchange_raises"] = _raised(call())
    finally:
        _vocab_parallel._all_gather_into = original
    # And the call after it works.
    out["after"] = _raised(call())
    return out


def _raised_any(call):
    """_raised, KeyboardInterrupt included."""
    try:
        call()
    except BaseException as error:  # noqa: BLE001 - recorded for the parent
        return type(error).__name__, str(error)
    return None


# The all-gathers a dflash call makes on a rank: the agreement (1), the
# run's handshake (2), the first chunk's handshake (3) and stats (4), its
# rounds, and the run's closing gather (last).
_GATHERS = {"run handshake": 2, "chunk handshake": 3, "stats": 4}


def stops_rank(rank, world):
    """One rank failing after the agreement, each way: every rank raises
    (the harness's join catches a hang), and the next call works."""
    group = dist.group.WORLD
    hidden, targets, mask = _batch()
    weight = shard_rows(_weight(), group)
    out = {}

    def call(h=hidden, w=weight, **kw):
        return lambda: dflash_objective(h, w, targets, mask,
                                        vocab_group=group, threads=1, **kw)

    # Checks of the binding's that the agreement does not cover.
    frozen = weight.float()
    other = frozen + 1 if rank == 1 else frozen
    out["prepared"] = _raised_any(call(
        h=hidden.float(), w=frozen,
        prepared_projection=_core.PreparedProjection(other, None)))
    bias = torch.zeros(weight.shape[0] + (rank == 1), dtype=torch.float64)
    out["bias"] = _raised_any(call(lm_head_bias=bias))
    # An exception in the exchange callback of rank 1 alone, at each kind of
    # gather: before its record went (a failed call) and after it (as a
    # Ctrl-C seen when the transport returns is).
    real = dist.all_gather
    for name, at in list(_GATHERS.items()) + [("last", -1)]:
        for kind in ("RuntimeError", "KeyboardInterrupt",
                     "KeyboardInterrupt after"):
            if name == "last" and kind == "KeyboardInterrupt after":
                # Every rank has finished the run: the others would wait
                # in the call's gradient sum (docs/scaling.md).
                continue
            calls = []

            def all_gather(*args, **kwargs):
                calls.append(1)
                if rank == 1 and len(calls) == at:
                    if kind == "RuntimeError":
                        raise RuntimeError("injected")
                    if kind == "KeyboardInterrupt":
                        raise KeyboardInterrupt("injected")
                    real(*args, **kwargs)
                    raise KeyboardInterrupt("injected after")
                return real(*args, **kwargs)

            if at == -1:
                # The closing gather: counted on a call that fails nowhere.
                dist.all_gather = all_gather
                try:
                    call(h=hidden.clone().requires_grad_())()
                finally:
                    dist.all_gather = real
                at = len(calls)
                calls.clear()
                out["gathers"] = at
            dist.all_gather = all_gather
            try:
                out[(name, kind)] = _raised_any(
                    call(h=hidden.clone().requires_grad_()))
            finally:
                dist.all_gather = real
    out["after"] = _raised_any(call())
    return out


class RefusalsTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.results = ranks.run_ranks(refusals_rank, 3, timeout=240)

    def assertEveryRank(self, scenario, pattern, kind="ValueError"):
        for rank, result in enumerate(self.results):
            with self.subTest(scenario=scenario, rank=rank):
                self.assertIsNotNone(result[scenario], scenario)
                got_kind, message = result[scenario]
                self.assertEqual(got_kind, kind, message)
                self.assertRegex(message, pattern)

    def test_shards_that_are_not_the_balanced_split(self):
        self.assertEveryRank(
            "not_balanced", r"vocab_group: the ranks' lm_head_weight rows "
            r"\(rank 0: 3, rank 1: 4, rank 2: 4\) are not the balanced "
            r"split of their sum V = 11 \(4, 4, 3")

    def test_other_shapes_on_one_rank(self):
        self.assertEveryRank("other_shapes", r"vocab_group: the ranks' B "
                             r"differs \(rank 0: 1; rank 1: 2; rank 2: 1\)")

    def test_other_targets_on_one_rank(self):
        self.assertEveryRank("other_targets",
                             r"vocab_group: the ranks' target_ids differ")

    def test_other_configs(self):
        self.assertEveryRank("other_config",
                             r"vocab_group: the ranks' config differ")

    def test_a_rank_refusing_its_arguments(self):
        for scenario, bad, pattern, kind in (
                ("non_cpu", 1, r"hidden: vocab_group runs on CPU tensors, "
                 r"and on CUDA tensors with rows='shared' \(rows='local' "
                 r"gathers its rows on the host\), got a tensor on meta",
                 "ValueError"),
                ("bad_type", 0, r"hidden: must be a torch.Tensor, got str",
                 "TypeError")):
            for rank, result in enumerate(self.results):
                with self.subTest(scenario=scenario, rank=rank):
                    got_kind, message = result[scenario]
                    if rank == bad:
                        self.assertEqual(got_kind, kind)
                        self.assertRegex(message, pattern)
                    else:
                        self.assertEqual(got_kind, "ValueError")
                        self.assertRegex(
                            message, rf"vocab_group: rank\(s\) {bad} of the "
                            r"group refused their arguments")

    def test_inputs_that_differ_only_inside_the_head(self):
        self.assertEveryRank("weight_dtype", r"vocab_group: the ranks' "
                             r"inputs' devices, dtypes, shapes and "
                             r"requires_grad "
                             r"differ")
        self.assertEveryRank("requires_grad", r"vocab_group: the ranks' "
                             r"inputs' devices, dtypes, shapes and "
                             r"requires_grad "
                             r"differ")

    def test_a_vocabulary_smaller_than_the_group(self):
        self.assertEveryRank(
            "vocab_below_world", r"vocab_group: the whole vocabulary "
            r"\(V = 2, the sum of the ranks' lm_head_weight rows\) is "
            r"smaller than the group \(3 ranks\)")

    def test_top_k_beyond_the_whole_vocabulary(self):
        self.assertEveryRank("top_k", r"top_k: must be an int in \[0, "
                             r"min\(64, V = 11\)\], got 12")

    def test_options_the_vocab_parallel_head_refuses(self):
        self.assertEveryRank("memory_budget", r"memory_budget_bytes")

    def test_an_exception_inside_the_exchange(self):
        self.assertEveryRank(
            "exchange_raises", r"vocab_group: the all-gather of the "
            r"vocab-parallel head raised KeyError: 'the transport failed'",
            kind="RuntimeError")
        for result in self.results:
            self.assertIsNone(result["after"])


class StopsTogetherTest(unittest.TestCase):
    """Every rank raises where one rank fails after the agreement."""

    @classmethod
    def setUpClass(cls):
        cls.results = ranks.run_ranks(stops_rank, 3, timeout=240)

    def assertStopped(self, scenario, kind, pattern, code):
        for rank, result in enumerate(self.results):
            with self.subTest(scenario=scenario, rank=rank):
                self.assertIsNotNone(result[scenario], scenario)
                got_kind, message = result[scenario]
                if rank == 1:
                    self.assertEqual(got_kind, kind, message)
                    self.assertRegex(message, pattern)
                else:
                    self.assertRegex(
                        message, rf"vocab_shard: process 1 of 3 failed: "
                        rf"{code} \(its own error says why\)")

    def test_binding_checks_on_one_rank(self):
        self.assertStopped("prepared", "ValueError",
                           r"prepared_projection: was made from other "
                           r"tensors", "INVALID_ARGUMENT")
        self.assertStopped("bias", "ValueError", r"lm_head_bias",
                           "INVALID_ARGUMENT")

    def test_an_exception_in_one_ranks_exchange(self):
        self.assertGreater(self.results[0]["gathers"], 5)
        for name in list(_GATHERS) + ["last"]:
            self.assertStopped(
                (name, "RuntimeError"), "RuntimeError",
                r"vocab_group: the all-gather of the vocab-parallel head "
                r"raised RuntimeError: injected", "ABORTED")
            self.assertStopped((name, "KeyboardInterrupt"),
                               "KeyboardInterrupt", r"^$", "CANCELLED")
            if name != "last":
                self.assertStopped((name, "KeyboardInterrupt after"),
                                   "KeyboardInterrupt", r"^$", "CANCELLED")
        for result in self.results:
            self.assertIsNone(result["after"])


class OneRankTest(unittest.TestCase):
    """Local checks, on a process group of one rank in this process."""

    def setUp(self):
        directory = tempfile.mkdtemp(dir=os.environ.get("TEST_TMPDIR"))
        dist.init_process_group(
            "gloo", init_method="file://" + os.path.join(directory, "r"),
            rank=0, world_size=1)

    def tearDown(self):
        if dist.is_initialized():
            dist.destroy_process_group()

    def test_vocab_group_of_the_wrong_type(self):
        hidden, targets, mask = _batch()
        for group in ("world", 0):
            with self.subTest(group=group):
                with self.assertRaisesRegex(
                        TypeError, r"vocab_group: must be a torch."
                        r"distributed.ProcessGroup"):
                    dflash_objective(hidden, _weight(), targets, mask,
                                     vocab_group=group)
        with self.assertRaisesRegex(TypeError, r"vocab_group: must be"):
            FusedHead(torch.nn.Linear(H, V), vocab_group="world")

    def test_one_rank_is_the_whole_vocabulary(self):
        hidden, targets, mask = _batch()
        got = dflash_objective(hidden, _weight(), targets, mask,
                               vocab_group=dist.group.WORLD, top_k=3)
        want = dflash_objective(hidden, _weight(), targets, mask, top_k=3)
        self.assertEqual(float(got.loss_num), float(want.loss_num))
        self.assertTrue(torch.equal(got.diagnostics.top_k,
                                    want.diagnostics.top_k))

    def test_shard_helpers(self):
        self.assertEqual(vocab_shard_range(11), (0, 11))
        linear = torch.nn.Linear(H, V)
        shard = shard_linear(linear)
        self.assertTrue(torch.equal(shard.weight, linear.weight))
        with self.assertRaisesRegex(TypeError, r"vocab: must be an int"):
            vocab_shard_range(11.0)
        with self.assertRaisesRegex(TypeError, r"linear: must be a torch"):
            shard_linear(torch.zeros(3))

    def test_balanced_split(self):
        for vocab, world in ((37, 2), (37, 3), (7, 4), (16, 4), (5, 5)):
            sizes = [b - a for a, b in (
                _vocab_parallel.shard_range(vocab, world, r)
                for r in range(world))]
            self.assertEqual(sum(sizes), vocab)
            self.assertLessEqual(max(sizes) - min(sizes), 1)
            self.assertEqual(sizes, sorted(sizes, reverse=True))

    def test_vocab_shard_arguments(self):
        with self.assertRaisesRegex(ValueError, r"rank, size: must satisfy "
                                    r"0 <= rank < size, got rank 2 of size "
                                    r"2"):
            _core.VocabShard(0, 10, 2, 2, lambda a, b: None)
        with self.assertRaisesRegex(ValueError, r"offset: must lie in "
                                    r"\[0, vocab = 10\), got 10"):
            _core.VocabShard(10, 10, 0, 2, lambda a, b: None)
        with self.assertRaisesRegex(TypeError, r"all_gather: must be "
                                    r"callable"):
            _core.VocabShard(0, 10, 0, 2, 3)


if __name__ == "__main__":
    unittest.main(verbosity=2)
