"""The benchmark runs end to end on a tiny batch and every variant agrees
with the float64 reference (no timings are checked)."""

import unittest

import torch.nn.functional as F

import benchmark


class BenchmarkTest(unittest.TestCase):
    def test_tiny_batch(self):
        table = benchmark.main(["--anchors", "4", "--block", "4", "--hidden",
                                "16", "--vocab", "64", "--chunk_blocks", "2",
                                "--repeats", "1", "--dtype", "float64"])
        rows = [line for line in table.splitlines()
                if line.startswith("| ") and "variant" not in line]
        self.assertEqual(len(rows), 4)
        measured = rows if hasattr(F, "linear_cross_entropy") else rows[:3]
        for row in measured:
            cells = [c.strip() for c in row.strip("|").split("|")]
            self.assertLess(abs(float(cells[3])), 1e-10, row)
            self.assertLess(float(cells[4]), 1e-10, row)
        if not hasattr(F, "linear_cross_entropy"):
            self.assertRegex(rows[3], r"has no F\.linear_cross_entropy")

    def test_evaluation_row(self):
        # --eval: the forward-only call's row, its loss the training call's,
        # and the ratio line.
        table = benchmark.main(["--anchors", "4", "--block", "4", "--hidden",
                                "16", "--vocab", "64", "--chunk_blocks", "2",
                                "--repeats", "1", "--dtype", "float64",
                                "--eval"])
        rows = [line for line in table.splitlines()
                if line.startswith("| dflash fused, evaluation")]
        self.assertEqual(len(rows), 1)
        cells = [c.strip() for c in rows[0].strip("|").split("|")]
        self.assertLess(abs(float(cells[3])), 1e-10, rows[0])
        self.assertRegex(table, r"dflash evaluation / training step: "
                                r"\d+\.\d\d")


if __name__ == "__main__":
    unittest.main(verbosity=2)
