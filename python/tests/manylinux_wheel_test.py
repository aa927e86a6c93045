"""The self-contained wheel (tools/build_wheel.sh) where drafts are trained:
manylinux_wheel_test.py WHEEL, run by a Python whose torch is PyPI's.

- auditwheel show calls it manylinux_2_34 or older;
- it installs into a fresh venv that sees only this Python's torch, and the
  README's PyTorch example runs from there in a mount namespace in which the
  CUDA toolkit and every library the build linked from the system (oneDNN,
  OpenBLAS, abseil, protobuf, libgomp, libgfortran, OpenCL) are hidden;
- the process then holds one OpenMP runtime, torch's, whichever of torch
  and dflash is imported first.

Needs root (mount namespaces); auditwheel from DFLASH_WHEEL_TOOLS (default
~/.cache/dflash/wheel-tools, as tools/build_wheel.sh makes it).
"""

import glob
import os
import re
import subprocess
import sys
import tempfile
import time
import unittest
import venv

WHEEL = os.path.abspath(sys.argv.pop(1))
HERE = os.path.dirname(os.path.abspath(__file__))
TOOLS = os.environ.get("DFLASH_WHEEL_TOOLS",
                       os.path.expanduser("~/.cache/dflash/wheel-tools"))
SYSTEM_LIBS = "/usr/lib/x86_64-linux-gnu"
HIDDEN_FILES = [
    pattern for name in ("libdnnl*", "libopenblas*", "libabsl_*",
                         "libprotobuf*", "libgomp*", "libgfortran*",
                         "libquadmath*", "libOpenCL*")
    for pattern in glob.glob(os.path.join(SYSTEM_LIBS, name)) +
    glob.glob(os.path.join("/usr/lib/gcc/x86_64-linux-gnu/*", name))]
HIDDEN_DIRS = [d for d in glob.glob("/usr/local/cuda*") +
               [os.path.join(SYSTEM_LIBS, "openblas-pthread")]
               if os.path.isdir(d)]

# Hides every path after "--dirs" / "--files" (an empty tmpfs over a
# folder, /dev/null over a file), then runs what follows "--".
HIDE = """
set -e
mode=
while [ "$1" != -- ]; do
  case "$1" in
    --dirs|--files) mode=$1 ;;
    *) if [ "$mode" = --dirs ]; then mount -t tmpfs none "$1";
       else mount --bind /dev/null "$1"; fi ;;
  esac
  shift
done
shift
exec "$@"
"""

# The README's first python block, then what the process loaded.
CHECK = """
import importlib.metadata, os, re, sys, time
start = time.perf_counter()
{first}
{second}
imported = time.perf_counter() - start
import dflash, torch
assert dflash.__file__.startswith(sys.prefix), dflash.__file__
exec(compile(open({readme!r}).read(), "README.md", "exec"))
assert torch.isfinite(hidden.grad).all()
gomp = set()
with open("/proc/self/maps") as maps:
    for line in maps:
        path = line.split()[-1]
        if re.search(r"/libgomp[^/]*\\.so", path):
            gomp.add(os.path.realpath(path))
print("openmp", sorted(gomp))
print("imported in %.2f s" % imported)
"""


def can_hide():
    # Root, and a mount namespace in which a mount is allowed.
    return (os.geteuid() == 0 and subprocess.run(
        ["unshare", "-m", "sh", "-c", "mount -t tmpfs none /mnt"],
        capture_output=True).returncode == 0)


class ManylinuxWheelTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.root = tempfile.mkdtemp()
        with open(os.path.join(HERE, "..", "..", "README.md")) as f:
            blocks = re.findall(r"```python\n(.*?)```", f.read(), re.S)
        cls.readme = os.path.join(cls.root, "readme_example.py")
        with open(cls.readme, "w") as f:
            f.write(blocks[0])
        env_dir = os.path.join(cls.root, "venv")
        venv.create(env_dir, with_pip=True)
        cls.python = os.path.join(env_dir, "bin", "python")
        # Only this Python's torch (and numpy) beside the fresh venv.
        import torch
        site = os.path.dirname(os.path.dirname(torch.__file__))
        (purelib,) = glob.glob(os.path.join(env_dir, "lib", "python*",
                                            "site-packages"))
        with open(os.path.join(purelib, "torch_site.pth"), "w") as f:
            f.write(site + "\n")
        cls.torch_lib = os.path.realpath(os.path.join(
            os.path.dirname(torch.__file__), "lib", "libgomp.so.1"))
        cls.environment = dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1")
        cls.environment.pop("PYTHONPATH", None)
        cls.environment.pop("LD_LIBRARY_PATH", None)
        subprocess.run([cls.python, "-m", "pip", "install", "--quiet",
                        "--no-index", "--no-deps", WHEEL],
                       check=True, env=cls.environment)

    def test_tagged_manylinux_2_34_or_older(self):
        shown = subprocess.run([os.path.join(TOOLS, "bin", "auditwheel"),
                                "show", WHEEL], capture_output=True,
                               text=True, check=True).stdout
        tag = re.search(r'platform tag:\s+"(manylinux_2_(\d+)_x86_64)"',
                        shown)
        self.assertIsNotNone(tag, shown)
        self.assertLessEqual(int(tag.group(2)), 34, shown)
        size = os.path.getsize(WHEEL)
        print(f"{os.path.basename(WHEEL)}: {size / 2**20:.1f} MiB, "
              f"{tag.group(1)}")

    def run_hidden(self, first, second):
        if not can_hide():
            self.skipTest("hiding the system's libraries needs root and "
                          "mount namespaces")
        script = CHECK.format(first=first, second=second, readme=self.readme)
        # Files first: some are links into the folders.
        command = (["unshare", "-m", "sh", "-c", HIDE, "sh", "--files"] +
                   HIDDEN_FILES + ["--dirs"] + HIDDEN_DIRS +
                   ["--", self.python, "-c", script])
        result = subprocess.run(command, cwd=self.root, env=self.environment,
                                capture_output=True, text=True)
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertIn(f"openmp ['{self.torch_lib}']", result.stdout)
        print(result.stdout, end="")

    def test_runs_without_the_systems_libraries_torch_first(self):
        self.assertIn(os.path.join(SYSTEM_LIBS, "libgomp.so.1"), HIDDEN_FILES)
        self.run_hidden("import torch", "import dflash.torch")

    def test_runs_without_the_systems_libraries_dflash_first(self):
        self.run_hidden("import dflash.torch", "import torch")

    def test_installed_size(self):
        site = subprocess.run(
            [self.python, "-c", "import dflash, os; "
             "print(os.path.dirname(os.path.dirname(dflash.__file__)))"],
            capture_output=True, text=True, check=True,
            env=self.environment).stdout.strip()
        total = sum(os.path.getsize(p)
                    for d in ("dflash", "dflash.libs")
                    for p in glob.glob(os.path.join(site, d, "**"),
                                       recursive=True)
                    if os.path.isfile(p))
        print(f"installed: {total / 2**20:.1f} MiB")
        self.assertGreater(total, 0)


if __name__ == "__main__":
    unittest.main(verbosity=2)
