"""dflash: chunked, checkpointed vocabulary-projection heads and
DFlash-family losses for training speculative-decoding draft models.

`ObjectiveConfig` holds one objective (proto/objective.proto of the dflash
repository); `dflash.torch` runs it on PyTorch tensors.
"""

from dflash import _openblas, _openmp

_openblas.choose_kernels()
_openmp.share_torchs()

from dflash._core import (  # noqa: E402
    ObjectiveConfig, PreparedProjection, built_with_cuda,
    release_cached_memory)
from dflash.config import objective_config  # noqa: E402
# Written by the build from python/defs.bzl's VERSION, the wheel's version.
from dflash._version import __version__ as __version__  # noqa: E402

__all__ = [
    "ObjectiveConfig",
    "PreparedProjection",
    "built_with_cuda",
    "objective_config",
    "release_cached_memory",
]
