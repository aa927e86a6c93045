#!/usr/bin/env bash
# Runs one Python test of dflash (see //python:defs.bzl, dflash_py_test):
#   run_python_test.sh PYTHON SCRIPT [ARGS...]
# with dflash importable from the build's python/ directory. PYTHON is the
# interpreter the extension was built for; DFLASH_TEST_PYTHON (--test_env)
# names another of the same version, e.g. a virtualenv with a newer torch.
set -euo pipefail

python="${DFLASH_TEST_PYTHON:-$1}"
script="$2"
shift 2
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONDONTWRITEBYTECODE=1

# An extension built with ASan (--config=asan or sanitize) loads only into a
# process whose first library is ASan's runtime: preload it, and libstdc++
# with it, so that ASan finds the C++ runtime it intercepts (exceptions
# thrown through pybind11) when it starts. Python and torch are not built
# with ASan: leaks (Python keeps its objects at exit) and allocator
# mismatches outside dflash are not dflash's findings.
if readelf -d python/dflash/_core.so 2>/dev/null | grep libasan >/dev/null; then
  export LD_PRELOAD="$(gcc -print-file-name=libasan.so):libstdc++.so.6${LD_PRELOAD:+:$LD_PRELOAD}"
  export ASAN_OPTIONS="${ASAN_OPTIONS:-}:detect_leaks=0:alloc_dealloc_mismatch=0"
fi

exec "$python" "$script" "$@"
