"""One OpenMP runtime per process. dflash's threads (its loss, oneDNN's
GEMMs) are libgomp's, as torch's are; two copies of libgomp in a process
would each start a thread per core and fight over the cores. The dynamic
loader reuses a library already loaded under the name a binary asks for
(libgomp.so.1), so loading torch's before dflash's extension makes it the
one both use, whichever of torch and dflash is imported first. Without
torch, the wheel's own (or the system's) is loaded by the extension."""

from __future__ import annotations

import ctypes
import importlib.util
import os


def share_torchs() -> None:
    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        return
    if spec is None or not spec.submodule_search_locations:
        return
    for folder in spec.submodule_search_locations:
        path = os.path.join(folder, "lib", "libgomp.so.1")
        if os.path.exists(path):
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            return
