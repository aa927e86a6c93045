"""vocab_parallel_benchmark.py runs on two gloo ranks at a small size and
prints its table: a row per family and top_k, the all-gathers per chunk
the loss makes (3 for dflash, 4 for dspark, plus the run's handshake and
closing gather) and
the all-reduce's 4H bytes a row."""

import os
import re
import subprocess
import sys
import unittest

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                      "vocab_parallel_benchmark.py")


class VocabParallelBenchmarkTest(unittest.TestCase):
    def test_prints_the_table(self):
        result = subprocess.run(
            [sys.executable, SCRIPT, "--world", "2", "--vocab", "257",
             "--hidden", "16", "--rows", "64", "--chunk_blocks", "2",
             "--repeat", "1", "--families", "dflash,dspark",
             "--top_k", "0,4"],
            capture_output=True, text=True, timeout=300)
        self.assertEqual(result.returncode, 0,
                         result.stdout + result.stderr)
        rows = re.findall(r"^\| (dflash|dspark) \| (\d+) \| ([\d.]+) \| "
                          r"(\d+) \| (\d+) \|", result.stdout, re.M)
        self.assertEqual([(f, k) for f, k, *_ in rows],
                         [("dflash", "0"), ("dflash", "4"), ("dspark", "0"),
                          ("dspark", "4")], result.stdout)
        # 64 rows in chunks of 32: two chunks, the run's handshake and its
        # closing gather spread over them.
        for family, _, gathers, sent, reduced in rows:
            self.assertEqual(float(gathers),
                             {"dflash": 4.0, "dspark": 5.0}[family])
            self.assertGreater(int(sent), 0)
            self.assertEqual(int(reduced), 4 * 16)

    def test_local_rows(self):
        # rows="local": each rank 32 of the 64 rows, one chunk a run, a run
        # (handshake, closing gather) per rank's rows, and the call's status
        # gathers before its row gathers and before its reduce-scatter:
        # (2 x 5 + 2) / 2 chunks.
        result = subprocess.run(
            [sys.executable, SCRIPT, "--world", "2", "--vocab", "257",
             "--hidden", "16", "--rows", "64", "--chunk_blocks", "2",
             "--repeat", "1", "--families", "dflash,domino", "--top_k", "0",
             "--correction_rank", "4", "--local_rows"],
            capture_output=True, text=True, timeout=300)
        self.assertEqual(result.returncode, 0,
                         result.stdout + result.stderr)
        # torch 1.13's gloo has no reduce_scatter: the label says what ran.
        self.assertRegex(result.stdout,
                         r"\| (reduce-scatter|all-reduce \(this gloo has no "
                         r"reduce_scatter\)) B / row")
        rows = re.findall(r"^\| (dflash|domino) \| 0 \| ([\d.]+) \| "
                          r"(\d+) \| (\d+) \|.* (\d+) \|$", result.stdout,
                          re.M)
        self.assertEqual([r[0] for r in rows], ["dflash", "domino"],
                         result.stdout)
        for family, gathers, _, reduced, gathered in rows:
            self.assertEqual(float(gathers), 6.0)
            r = 4 if family == "domino" else 0
            self.assertEqual(int(reduced), 4 * (16 + r))
            # hidden (16 float32), the target id (int64), the mask
            # (float64 on the wire), Domino's z (4 float32).
            self.assertEqual(int(gathered), 4 * 16 + 8 + 8 + 4 * r)


if __name__ == "__main__":
    unittest.main(verbosity=2)
