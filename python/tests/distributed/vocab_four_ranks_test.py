"""The vocab-parallel head on four gloo ranks (two cores):

- four vocab shards of V = 7 (2, 2, 2, 1 rows: smaller than top_k = 5 and
  than the metric's top-16, capped at 7; Domino's correction sharded
  alike) and of V = 37, against one process (vocab_cases.py);
- 2 x 2 data x vocab: two vocab groups of two ranks ({0, 1}, {2, 3}), each
  a data-parallel replica with micro-batches of its own (2 unequal
  micro-batches per window, one of them without weight), the draft's
  gradients summed over the data groups ({0, 2}, {1, 3}) and normalised by
  GlobalNormalizer (dflash, dspark and domino conventions; Domino's
  correction weight sharded as lm_head, each rank training its rows): the loss, metrics and gradients equal one process
  holding all the data and the whole weight (checks.reference, float64
  1e-12), on every rank the same bits.
"""

import os
import sys
import unittest

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import checks  # noqa: E402
import ranks  # noqa: E402
import vocab_cases  # noqa: E402
from dflash.torch import dflash_objective  # noqa: E402
from dflash.torch._vocab_parallel import shard_range  # noqa: E402
from dflash.torch.distributed import GlobalNormalizer, shard_rows  # noqa: E402
from vocab_cases import case  # noqa: E402

FOUR = [
    case("shards_smaller_than_k", V=7, top_k=5, trainable=True, bias=True),
    case("shards_smaller_than_k_ties", V=7, top_k=5, ties=True),
    case("dflash", top_k=4, trainable=True),
    case("dspark", "dspark", top_k=3, V=9),
    case("reverse_kl", "reverse_kl", V=13),
    case("masked_chunk", masked_chunk=True, top_k=2,
         overrides={"chunk_blocks": 3}),
    case("domino_shards_of_one_row", "domino", V=7, correction=2,
         trainable=True, ties=True),
]

# [replica][micro-batch] = (sequences, without weight); a second window
# with other sizes.
PLANS = [
    [[(3, False), (1, False)], [(1, False), (2, True)]],
    [[(1, False), (2, False)], [(2, False), (1, False)]],
]
MODES = ("dflash", "dspark", "domino")


def data_by_vocab_rank(rank, world):
    """Rank r: vocab shard r % 2 of data replica r // 2."""
    vocab_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    data_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    replica, shard = divmod(rank, 2)
    vocab_group, data_group = vocab_groups[replica], data_groups[shard]
    weight = shard_rows(ranks.lm_head(), vocab_group)
    out = {}
    for mode in MODES:
        params = ranks.parameters(mode)
        if mode == "domino":
            # The correction's weight rows sharded as lm_head's: this
            # rank's rows are the parameter it trains.
            params["corr_m"] = shard_rows(
                params["corr_m"], vocab_group).requires_grad_()
        norm = GlobalNormalizer(data_group, mode=mode, grad_sync="sum")
        windows = []
        for window, plan in enumerate(PLANS):
            for p in params.values():
                p.grad = None
            for micro, (blocks, masked) in enumerate(plan[replica]):
                batch = ranks.micro_batch(replica, 10 * window + micro,
                                          blocks, masked)
                hidden = (batch["x"] @ params["proj_w"].t()
                          + params["proj_b"])
                extra = {}
                if mode == "dspark":
                    extra["teacher_hidden"] = batch["teacher"]
                if mode == "domino":
                    extra["correction_inputs"] = torch.tanh(
                        batch["x"] @ params["corr_w"].t())
                    extra["correction_weight"] = params["corr_m"]
                terms = dflash_objective(
                    hidden, weight, batch["target_ids"],
                    batch["weight_mask"], config=ranks.CONFIGS[mode],
                    threads=1, vocab_group=vocab_group, **extra)
                norm.loss(terms).backward()
            for p in params.values():
                dist.all_reduce(p.grad, group=data_group)
            result = norm.step(params.values())
            windows.append({
                "grads": {n: p.grad.clone() for n, p in params.items()},
                "step": result._asdict()})
        out[mode] = windows
    return out


class FourRanksTest(vocab_cases.VocabTestCase):
    @classmethod
    def setUpClass(cls):
        cls.cases = ranks.run_ranks(vocab_cases.run_cases, 4, FOUR,
                                    timeout=300)
        cls.data = ranks.run_ranks(data_by_vocab_rank, 4, timeout=300)

    def test_four_shards_equal_one_process(self):
        for index, c in enumerate(FOUR):
            self.check_case(c, [r[index] for r in self.cases])

    def test_data_by_vocab_equals_one_process(self):
        for mode in MODES:
            for window, plan in enumerate(PLANS):
                want = checks.reference(mode, plan, window)
                first = self.data[0][mode][window]
                for rank, result in enumerate(self.data):
                    got = result[mode][window]
                    with self.subTest(mode=mode, window=window, rank=rank):
                        step = got["step"]
                        self.assertEqual(step["loss"], first["step"]["loss"])
                        self.assertLess(ranks.relative_error(
                            step["loss"], want["loss"]), checks.TOLERANCE)
                        self.assertLess(ranks.relative_error(
                            step["loss_den"], want["loss_den"]),
                            checks.TOLERANCE)
                        self.assertEqual(step["micro_batches"],
                                         want["micro_batches"])
                        for name, p in got["grads"].items():
                            whole = want["grads"][name]
                            if name == "corr_m":
                                # Domino's sharded correction weight: this
                                # rank's rows, the same bits as the other
                                # replica's.
                                start, stop = shard_range(
                                    whole.shape[0], 2, rank % 2)
                                whole = whole[start:stop]
                                self.assertTrue(torch.equal(
                                    p, self.data[rank ^ 2][mode][window]
                                    ["grads"][name]), name)
                            else:
                                # The same bits on every rank.
                                self.assertTrue(torch.equal(
                                    p, first["grads"][name]), name)
                            self.assertLess(ranks.relative_error(
                                p, whole), checks.TOLERANCE, name)
                        for name, (num, den) in want["pairs"].items():
                            self.assertLess(ranks.relative_error(
                                step["metrics"][name],
                                checks.metric_ratio(num, den)),
                                checks.TOLERANCE, name)


if __name__ == "__main__":
    unittest.main(verbosity=2)
