"""Debian's OpenBLAS picks its kernels when it loads, from the CPU model, and
falls back to slow generic ones (4-5x slower SGEMM) on CPUs it does not
know, as virtual machines often report. Before dflash loads it, name the
kernels from the CPU's flags, as the repository's tools/bazel does; a
process that loaded OpenBLAS already (torch imported first) keeps its
choice, and OPENBLAS_CORETYPE set by the user always wins."""

from __future__ import annotations

import os
from typing import Set


def _cpu_flags() -> Set[str]:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _openblas_loaded() -> bool:
    try:
        with open("/proc/self/maps") as maps:
            return any("libopenblas" in line for line in maps)
    except OSError:
        return False


def choose_kernels() -> None:
    if "OPENBLAS_CORETYPE" in os.environ or _openblas_loaded():
        return
    flags = _cpu_flags()
    if "avx512_bf16" in flags:
        os.environ["OPENBLAS_CORETYPE"] = "Cooperlake"
    elif {"avx512f", "avx512bw", "avx512vl"} <= flags:
        os.environ["OPENBLAS_CORETYPE"] = "SkylakeX"
    elif {"avx2", "fma"} <= flags:
        os.environ["OPENBLAS_CORETYPE"] = "Haswell"
