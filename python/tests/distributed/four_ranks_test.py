"""dflash.torch.distributed.GlobalNormalizer on four gloo ranks (on two
cores) against one process holding all the data (checks.py), float64,
1e-12 relative, in every mode: DDP's averaging of the gradients, and
micro-batches without weight on two of the ranks.
"""

import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import checks  # noqa: E402
import ranks  # noqa: E402

# Rank 2's first and rank 3's second micro-batch have no weight.
PLANS = [[
    [(3, False), (1, False)],
    [(1, False), (2, False)],
    [(2, True), (1, False)],
    [(1, False), (1, True)],
]]


class FourRanksTest(checks.NormalizerTestCase):
    def test_each_mode_equals_one_process_with_empty_micro_batches(self):
        results = ranks.run_ranks(checks.train_rank, 4, PLANS, "mean")
        self.check(results, PLANS)


if __name__ == "__main__":
    unittest.main(verbosity=2)
