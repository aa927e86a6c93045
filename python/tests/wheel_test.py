"""The wheel installs with pip into a virtualenv of the Python it was built
for (seeing the system's torch), and dflash.torch runs from there, away
from the source tree: wheel_test.py WHEEL."""

import os
import subprocess
import sys
import tempfile
import unittest
import venv

WHEEL = os.path.abspath(sys.argv.pop(1))

SMOKE = """
import importlib.metadata
import sys

import torch

import dflash
from dflash.torch import dflash_objective

assert dflash.__file__.startswith(sys.prefix), dflash.__file__
assert importlib.metadata.version("dflash") == dflash.__version__
hidden = torch.randn(1, 2, 4, 8, requires_grad=True)
terms = dflash_objective(hidden, torch.randn(13, 8),
                         torch.randint(0, 13, (1, 2, 4)), torch.ones(1, 2, 4))
(terms.loss_num / terms.loss_den).backward()
assert torch.isfinite(hidden.grad).all()
print("installed dflash", dflash.__version__, "with torch", torch.__version__)
"""


class WheelTest(unittest.TestCase):
    def test_installs_and_runs(self):
        with tempfile.TemporaryDirectory(dir=os.environ.get("TEST_TMPDIR")) as root:
            env_dir = os.path.join(root, "venv")
            venv.create(env_dir, system_site_packages=True, with_pip=True)
            python = os.path.join(env_dir, "bin", "python")
            environment = dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1")
            environment.pop("PYTHONPATH", None)  # Not the source tree's dflash.
            subprocess.run([python, "-m", "pip", "install", "--quiet",
                            "--no-index", "--no-deps", WHEEL],
                           check=True, env=environment)
            result = subprocess.run([python, "-c", SMOKE], cwd=root, check=True,
                                    env=environment, capture_output=True,
                                    text=True)
            print(result.stdout, end="")
            self.assertIn("installed dflash", result.stdout)


if __name__ == "__main__":
    unittest.main(verbosity=2)
