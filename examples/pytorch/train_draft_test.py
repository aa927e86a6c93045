"""A few steps of the example training loop: it runs, reports every step it
is asked to, and its loss falls."""

import re
import unittest

import train_draft


class TrainDraftTest(unittest.TestCase):
    def test_a_few_steps_train(self):
        lines = []
        losses = train_draft.train(
            train_draft.parse_args(["--steps", "40", "--log_every", "10"]),
            report=lines.append)
        self.assertEqual(len(losses), 40)
        self.assertEqual(len(lines), 5)  # Steps 1, 10, 20, 30, 40.
        pattern = (r"step +\d+  loss \d+\.\d{4}  accuracy \d\.\d{3}  +"
                   r"\d+\.\d ms/step  peak \d+ MiB")
        for line in lines:
            self.assertRegex(line, pattern)
        self.assertLess(sum(losses[-5:]) / 5, sum(losses[:5]) / 5 - 0.3)

    def test_other_families_and_modes_run(self):
        for loss, mode in (("dpace", "checkpoint"), ("tv", "materialize"),
                           ("lk-lambda", "selective")):
            with self.subTest(loss=loss, mode=mode):
                args = ["--steps", "3", "--loss", loss, "--mode", mode]
                losses = train_draft.train(train_draft.parse_args(args),
                                           report=lambda line: None)
                self.assertEqual(len(losses), 3)


if __name__ == "__main__":
    unittest.main(verbosity=2)
