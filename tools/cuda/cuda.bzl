"""Compiles .cu sources with nvcc (no rules_cuda can be fetched here).

cuda_library() drives nvcc through a genrule per source and wraps the objects
in a cc_library that links cudart. CUDA targets exist on every machine: where
local_config_cuda found no toolkit they are incompatible, so `bazel build
//...` skips them (and everything that depends on them) and naming one says
why, instead of a missing target.
"""

load(
    "@local_config_cuda//:defs.bzl",
    "CUDA_ARCHS",
    "CUDA_ENABLED",
    "HOST_CXX",
    "NVCC",
    _CUDA_LIB_DIR = "CUDA_LIB_DIR",
)

# The toolkit's library folder the build found ("" without one): the last
# place the CUDA head looks for cuBLAS at run time.
CUDA_LIB_DIR = _CUDA_LIB_DIR

def if_cuda(if_true, if_false = []):
    """Chooses by whether the toolkit was found (e.g. a source with CUDA)."""
    return if_true if CUDA_ENABLED else if_false

# For target_compatible_with of anything that needs the toolkit. Tests of
# CUDA code also carry tags = ["cuda"]: CI runs them under the emulation
# (--config=cuda_emulated --test_tag_filters=cuda).
CUDA_COMPATIBLE = [] if CUDA_ENABLED else ["@platforms//:incompatible"]

# For target_compatible_with of what ships (the Python extension and its
# wheel): never built against the CUDA emulation, which is for tests.
NOT_EMULATED = select({
    str(Label("//tools/cuda:emulated")): ["@platforms//:incompatible"],
    "//conditions:default": [],
})

def _gencode():
    # SASS for every listed architecture, plus PTX of the newest one, which
    # the driver compiles for GPUs newer than any listed.
    codes = [
        "-gencode=arch=compute_%s,code=sm_%s" % (a, a)
        for a in CUDA_ARCHS
    ]
    if CUDA_ARCHS:
        newest = CUDA_ARCHS[-1]
        codes.append("-gencode=arch=compute_%s,code=compute_%s" % (newest, newest))
    return " ".join(codes)

def cuda_library(name, srcs, hdrs = [], deps = [], nvcc_inputs = [], copts = [], visibility = None, testonly = False):
    """A cc_library whose .cu sources are compiled by nvcc for CUDA_ARCHS.

    nvcc_inputs: headers of deps that the .cu files include (a genrule sees
    only the files it is given). Optimisation follows --compilation_mode;
    line info is always kept for compute-sanitizer and profilers.
    """
    if not CUDA_ENABLED:
        native.cc_library(
            name = name,
            hdrs = hdrs,
            deps = deps,
            visibility = visibility,
            testonly = testonly,
            target_compatible_with = CUDA_COMPATIBLE,
        )
        return

    # The repo's own headers live under external/<repo> when dflash is
    # someone else's dependency.
    root = Label("//:BUILD").workspace_root or "."
    objs = []
    for src in srcs:
        obj = "_%s_objs/%s.o" % (name, src.replace(".cu", ""))
        native.genrule(
            name = "%s_%s_nvcc" % (name, src.replace("/", "_").replace(".", "_")),
            srcs = [src] + hdrs + nvcc_inputs,
            outs = [obj],
            cmd = " ".join([
                NVCC,
                "-std=c++17 -Xcompiler -fPIC -lineinfo",
                "-ccbin %s" % HOST_CXX,
                "--expt-relaxed-constexpr",
                _gencode(),
                "-I%s -I$(GENDIR)/%s" % (root, root),
                " ".join(copts),
            ]) + " " + select({
                str(Label("//tools/cuda:dbg")): "-O0 -g",
                str(Label("//tools/cuda:fastbuild")): "-O1",
                "//conditions:default": "-O3",
            }) + " -c $(location %s) -o $@" % src,
            # The emulated build compiles the sources below instead.
            target_compatible_with = NOT_EMULATED,
            testonly = testonly,
        )
        objs.append(obj)
    # --config=cuda_emulated: the same sources compiled as C++ against the
    # CPU emulation (a build-time copy, for the .cc extension).
    emulated = []
    for src in srcs:
        cc = "_%s_emulated/%s" % (name, src.replace(".cu", ".cc"))
        native.genrule(
            name = "%s_%s_emulated" % (name, src.replace("/", "_").replace(".", "_")),
            srcs = [src],
            outs = [cc],
            cmd = "cp $< $@",
            testonly = testonly,
        )
        emulated.append(cc)
    native.cc_library(
        name = name,
        srcs = select({
            str(Label("//tools/cuda:emulated")): emulated,
            "//conditions:default": objs,
        }),
        hdrs = hdrs,
        deps = deps + ["@local_config_cuda//:cudart"],
        visibility = visibility,
        testonly = testonly,
        alwayslink = True,
    )
