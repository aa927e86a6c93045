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


# Runs the rest of the command line with every folder named here hidden
# behind an empty tmpfs, in a mount namespace of its own.
HIDE = """
set -e
for dir in "$@"; do
  [ "$dir" = -- ] && break
  [ -d "$dir" ] && mount -t tmpfs none "$dir"
done
while [ "$1" != -- ]; do shift; done
shift
exec "$@"
"""


def can_hide_folders():
    # Root, and a mount namespace in which a mount is allowed.
    return (os.geteuid() == 0 and subprocess.run(
        ["unshare", "-m", "sh", "-c", "mount -t tmpfs none /mnt"],
        capture_output=True).returncode == 0)


class WheelTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.root = tempfile.mkdtemp(dir=os.environ.get("TEST_TMPDIR"))
        env_dir = os.path.join(cls.root, "venv")
        venv.create(env_dir, system_site_packages=True, with_pip=True)
        cls.python = os.path.join(env_dir, "bin", "python")
        cls.environment = dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1")
        cls.environment.pop("PYTHONPATH", None)  # Not the source tree's.
        subprocess.run([cls.python, "-m", "pip", "install", "--quiet",
                        "--no-index", "--no-deps", WHEEL],
                       check=True, env=cls.environment)

    def smoke(self, prefix=()):
        result = subprocess.run(list(prefix) + [self.python, "-c", SMOKE],
                                cwd=self.root, env=self.environment,
                                capture_output=True, text=True)
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertIn("installed dflash", result.stdout)
        return result.stdout

    def test_installs_and_runs(self):
        print(self.smoke(), end="")

    def test_imports_and_runs_without_cuda(self):
        # Nothing of CUDA is needed until a CUDA tensor arrives: the runtime
        # is linked statically and cuBLAS opened on first use.
        if not can_hide_folders():
            self.skipTest("hiding folders needs root and mount namespaces")
        hidden = [d for d in ("/usr/local/cuda", "/usr/local/cuda-13",
                              "/usr/local/cuda-13.0")
                  if os.path.isdir(d)]
        self.smoke(["unshare", "-m", "sh", "-c", HIDE, "sh"] + hidden +
                   ["--"])


if __name__ == "__main__":
    unittest.main(verbosity=2)
