"""Build helpers of dflash's Python package.

The package builds where local_config_python found a Python with headers and
pybind11 (deps.bzl); elsewhere its targets drop out, as CUDA's do.
"""

load(
    "@local_config_python//:defs.bzl",
    "PLATFORM_TAG",
    "PYTHON_ENABLED",
    "PYTHON_TAG",
    _PYTHON_BIN = "PYTHON_BIN",
)

# The interpreter the extension is built for (a loaded symbol is not
# exported from this file without a new name).
PYTHON_BIN = _PYTHON_BIN

# The wheel's version, and dflash.__version__ (//python/dflash:version writes
# it into the package).
VERSION = "0.1.0"

WHEEL = "dflash-%s-%s-%s-%s.whl" % (
    VERSION,
    PYTHON_TAG,
    PYTHON_TAG,
    PLATFORM_TAG,
)

def if_python(if_true, if_false = []):
    return if_true if PYTHON_ENABLED else if_false

def dflash_py_test(name, src, size = "small", data = [], args = []):
    """A Python test run by the interpreter the extension was built for.

    DFLASH_TEST_PYTHON (--test_env) names another, e.g. a virtualenv with a
    newer torch. The test imports dflash from the build's package.
    """
    if not PYTHON_ENABLED:
        return
    native.sh_test(
        name = name,
        size = size,
        srcs = [Label("//python:run_python_test.sh")],
        args = [PYTHON_BIN, "$(location %s)" % src] + args,
        data = [src, Label("//python/dflash:package")] + data,
    )
