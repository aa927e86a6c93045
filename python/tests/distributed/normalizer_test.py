"""dflash.torch.distributed.GlobalNormalizer on two gloo ranks against one
process holding all the data (checks.py), float64, 1e-12 relative: in
every mode, micro-batches of unequal sizes across the ranks over two
windows one after another; and a window whose micro-batches have no
weight on any rank.
"""

import os
import sys
import unittest

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import checks  # noqa: E402
import ranks  # noqa: E402
from dflash.torch.distributed import MODES  # noqa: E402

# 2 ranks x 2 micro-batches of 3 + 1 and 1 + 2 sequences, then a second
# window with other sizes (the agreed layout reused), the gradients summed
# by an all_reduce.
UNEQUAL = [
    [[(3, False), (1, False)], [(1, False), (2, False)]],
    [[(1, False), (1, False)], [(2, False), (3, False)]],
]
WITHOUT_WEIGHT = [[[(1, True), (1, True)], [(2, True), (1, True)]]]


class TwoRanksTest(checks.NormalizerTestCase):
    # One spawn of two ranks for both scenarios (starting ranks dominates
    # the time).
    @classmethod
    def setUpClass(cls):
        cls.results = ranks.run_ranks(
            checks.train_scenarios, 2,
            [(UNEQUAL, "sum"), (WITHOUT_WEIGHT, "mean")])

    def test_unequal_micro_batches_give_the_single_process_gradient(self):
        self.check([r[0] for r in self.results], UNEQUAL)

    def test_a_window_without_weight_gives_zero_and_does_not_hang(self):
        # Every micro-batch of every rank masked: loss 0, gradients 0, no
        # NaN (SpecForge raises here; dflash's rule is a loss of 0).
        for result in self.results:
            for mode in MODES:
                step = result[1][mode][0]["step"]
                with self.subTest(mode):
                    self.assertEqual(step["loss"], 0.0)
                    self.assertEqual(step["loss_den"], 0.0)
                    self.assertEqual(step["micro_batches"], 4)
                    for p in result[1][mode][0]["grads"].values():
                        self.assertTrue(torch.isfinite(p).all())
                        self.assertEqual(float(p.abs().max()), 0.0)


if __name__ == "__main__":
    unittest.main(verbosity=2)
