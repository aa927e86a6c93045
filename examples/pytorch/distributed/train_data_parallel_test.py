"""The data-parallel example on two gloo ranks, as a command: it trains
(its loss falls), DDP keeps the ranks' parameters equal, and in dflash
mode two ranks take the same steps as one process holding both ranks' data
(--world 1 --shards 2), up to float32 rounding."""

import json
import os
import subprocess
import sys
import tempfile
import unittest

EXAMPLE = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                       "train_data_parallel.py")


def train(out, *args):
    """The example's report per rank (its --out files)."""
    result = subprocess.run(
        [sys.executable, EXAMPLE, "--steps", "20", "--out", out, *args],
        capture_output=True, text=True, timeout=180)
    if result.returncode != 0:
        raise AssertionError(result.stdout + result.stderr)
    reports = []
    rank = 0
    while os.path.exists(f"{out}.rank{rank}"):
        with open(f"{out}.rank{rank}") as f:
            reports.append(json.load(f))
        rank += 1
    return reports, result.stdout


def flat(report):
    return [value for p in report["parameters"] for value in p]


class TrainDataParallelTest(unittest.TestCase):
    def test_two_ranks_train_as_one_process_on_both_shards(self):
        directory = tempfile.mkdtemp(dir=os.environ.get("TEST_TMPDIR"))
        ranks, stdout = train(os.path.join(directory, "two"), "--world", "2")
        (one,), _ = train(os.path.join(directory, "one"), "--world", "1",
                          "--shards", "2")
        self.assertEqual(len(ranks), 2)
        self.assertRegex(stdout, r"step  20  loss \d+\.\d{4}  accuracy "
                         r"\d\.\d{3}  rows 168 over 2 ranks")
        losses = ranks[0]["loss"]
        self.assertEqual(len(losses), 20)
        self.assertLess(sum(losses[-3:]) / 3, losses[0] - 0.3)
        # DDP's averaged gradients, scaled alike on both ranks.
        self.assertEqual(flat(ranks[0]), flat(ranks[1]))
        self.assertEqual(ranks[0]["loss"], ranks[1]["loss"])
        # One process on both shards: the same steps.
        two, single = flat(ranks[0]), flat(one)
        scale = max(abs(v) for v in single)
        error = max(abs(a - b) for a, b in zip(two, single))
        self.assertLess(error, 1e-5 * scale)
        for a, b in zip(losses, one["loss"]):
            self.assertAlmostEqual(a, b, delta=1e-5 * abs(b))


class VocabParallelTest(unittest.TestCase):
    def test_two_vocab_shards_train_as_one_process(self):
        # One data replica of both shards' data, its lm_head split over two
        # ranks (FusedHead(..., vocab_group=)): the same steps as one
        # process holding the whole head.
        directory = tempfile.mkdtemp(dir=os.environ.get("TEST_TMPDIR"))
        ranks, stdout = train(os.path.join(directory, "vocab"), "--world",
                              "2", "--vocab_ranks", "2", "--shards", "2")
        (one,), _ = train(os.path.join(directory, "one"), "--world", "1",
                          "--shards", "2")
        self.assertRegex(stdout, r"step  20  loss \d+\.\d{4}  accuracy "
                         r"\d\.\d{3}  rows 168 over 2 ranks \(2 vocab "
                         r"shards\)")
        self.assertEqual(flat(ranks[0]), flat(ranks[1]))
        self.assertEqual(ranks[0]["loss"], ranks[1]["loss"])
        two, single = flat(ranks[0]), flat(one)
        scale = max(abs(v) for v in single)
        error = max(abs(a - b) for a, b in zip(two, single))
        self.assertLess(error, 1e-5 * scale)
        for a, b in zip(ranks[0]["loss"], one["loss"]):
            self.assertAlmostEqual(a, b, delta=1e-5 * abs(b))


if __name__ == "__main__":
    unittest.main(verbosity=2)
