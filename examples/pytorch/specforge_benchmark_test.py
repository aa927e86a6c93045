"""The SpecForge benchmark runs end to end on a tiny model, and the patched
step agrees with SpecForge's own (no timings are checked). Skips, saying
why, where SpecForge does not import (Debian's torch 1.13)."""

import importlib
import re
import unittest
import warnings

import specforge_benchmark

try:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        importlib.import_module(specforge_benchmark.MODULE)
    NO_SPECFORGE = None
except Exception as error:  # noqa: BLE001 - any import failure skips.
    NO_SPECFORGE = (f"SpecForge does not import here ({type(error).__name__}:"
                    f" {error}); CI's torch 2.15 venv has specforge 0.2.0")


@unittest.skipIf(NO_SPECFORGE, NO_SPECFORGE or "")
class SpecForgeBenchmarkTest(unittest.TestCase):
    def test_tiny_models(self):
        for model in ("dflash", "dspark", "domino"):
            with self.subTest(model=model):
                table = specforge_benchmark.main([
                    "--model", model, "--seq", "40", "--anchors", "4",
                    "--block", "4", "--hidden", "16", "--vocab", "64",
                    "--chunk_blocks", "2", "--repeats", "1"])
                rows = {line.split("|")[1].strip(): line for line in
                        table.splitlines() if line.startswith("| ")
                        and "variant" not in line}
                self.assertEqual(sorted(rows), ["applied", "shipped"])
                loss = float(re.search(r"Loss relative difference (\S+);",
                                       table).group(1))
                grad = float(re.search(r"/ \|g_shipped\| (\S+)\.$", table,
                                       re.M).group(1))
                # float32 both; DSpark's L1 and confidence parts are
                # float32 sums over the vocabulary in SpecForge.
                self.assertNotIn("fell back", table)
                self.assertLess(loss, 2e-5, table)
                self.assertLess(grad, 2e-5, table)
                self.assertRegex(table, r"applied / shipped: time \d+\.\d\d, "
                                        r"peak memory -?\d+\.\d\d")

if __name__ == "__main__":
    unittest.main(verbosity=2)
