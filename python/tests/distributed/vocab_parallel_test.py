"""The vocab-parallel head (dflash_objective(..., vocab_group=)) on two and
three gloo ranks against one process holding the whole weight
(vocab_cases.py): every loss family it runs (dflash CE, label smoothing
and z-loss, the D-PACE variants, LK, TV, DSpark with its teacher and
confidence, D-PARD, distillation; Domino with and without its label shift,
its correction's weight sharded as lm_head's), float64 (1e-12) and float32
(1e-6), the
head's execution modes, top-k values and their gradient, a trainable
weight and bias, a logit correction, the teacher diagnostics, ties across
shard boundaries, every target in one shard and an all-masked chunk; a
vocabulary the world size does not divide (37 over 2 and 3 ranks). Every
rank's terms, row outputs and gradients are the same bits as rank 0's.
"""

import os
import sys
import unittest

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ranks  # noqa: E402
import vocab_cases  # noqa: E402
from vocab_cases import case  # noqa: E402

TWO = [case(family, family, top_k=3) for family in vocab_cases.FAMILIES]
TWO += [
    case("trainable_bias_top_k", top_k=5, trainable=True, bias=True),
    case("float32", dtype=torch.float32, top_k=4, trainable=True, bias=True),
    case("float32_dspark", "dspark", dtype=torch.float32, top_k=2),
    case("correction", top_k=4, correction=3, trainable=True),
    case("teacher_diagnostics", teacher_diagnostics=True, top_k=2),
    case("ties", V=36, top_k=6, ties=True),
    case("targets_in_one_shard", targets="last_shard", top_k=3),
    case("masked_chunk", masked_chunk=True, top_k=3,
         overrides={"chunk_blocks": 3}),
    case("forward_only_rows", return_rows=True, top_k=0),
] + [
    case("mode_" + mode, top_k=3, trainable=True,
         overrides={"mode": mode, "chunk_blocks": 2})
    for mode in ("materialize", "save", "checkpoint", "selective", "fused")
] + [
    case(family, family, correction=2)
    for family in vocab_cases.SPLIT_FAMILIES
] + [
    case("domino_trainable_bias", "domino", correction=3, trainable=True,
         bias=True),
    case("domino_float32", "domino", dtype=torch.float32, correction=2,
         trainable=True),
    case("domino_ties", "domino_shift", V=36, correction=2, ties=True),
    case("domino_targets_in_one_shard", "domino", correction=2,
         targets="last_shard"),
    case("domino_masked_chunk", "domino", correction=2, masked_chunk=True,
         overrides={"chunk_blocks": 3}),
] + [
    case("domino_mode_" + mode, "domino", correction=2, trainable=True,
         overrides={"mode": mode, "chunk_blocks": 2})
    for mode in ("materialize", "save", "checkpoint", "selective", "fused")
]

THREE = [
    case("dflash", top_k=5, trainable=True, bias=True),
    case("dspark", "dspark", top_k=3),
    case("jsd", "jsd", top_k=3),
    case("dpace", "dpace", top_k=2),
    case("ties", V=37, top_k=6, ties=True),
    case("float32", dtype=torch.float32, top_k=4, trainable=True),
    case("masked_chunk", masked_chunk=True, overrides={"chunk_blocks": 3}),
    case("domino", "domino", correction=2, trainable=True),
    case("domino_shift_ties", "domino_shift", V=37, correction=2, ties=True),
    case("domino_float32", "domino_shift", dtype=torch.float32,
         correction=2),
]


class TwoRanksTest(vocab_cases.VocabTestCase):
    @classmethod
    def setUpClass(cls):
        cls.results = ranks.run_ranks(vocab_cases.run_cases, 2, TWO,
                                      timeout=300)

    def test_each_case_equals_one_process(self):
        for index, c in enumerate(TWO):
            self.check_case(c, [r[index] for r in self.results])


class ThreeRanksTest(vocab_cases.VocabTestCase):
    @classmethod
    def setUpClass(cls):
        cls.results = ranks.run_ranks(vocab_cases.run_cases, 3, THREE,
                                      timeout=300)

    def test_each_case_equals_one_process(self):
        for index, c in enumerate(THREE):
            self.check_case(c, [r[index] for r in self.results])


if __name__ == "__main__":
    unittest.main(verbosity=2)
