"""Compiles .cu sources with nvcc (no rules_cuda can be fetched here).

cuda_library() drives nvcc through a genrule per source and wraps the objects
in a cc_library that links cudart. When local_config_cuda found no toolkit,
CUDA_ENABLED is False and BUILD files leave CUDA targets out via if_cuda().
"""

load("@local_config_cuda//:defs.bzl", "CUDA_ARCHS", "CUDA_ENABLED", "NVCC")

def if_cuda(if_true, if_false = []):
    return if_true if CUDA_ENABLED else if_false

def cuda_library(name, srcs, hdrs = [], deps = [], nvcc_inputs = [], copts = [], visibility = None, testonly = False):
    """A cc_library whose .cu sources are compiled by nvcc for CUDA_ARCHS.

    nvcc_inputs: headers of deps that the .cu files include (a genrule sees
    only the files it is given).
    """
    if not CUDA_ENABLED:
        fail("cuda_library(%s) needs CUDA; guard it with if_cuda()" % name)

    # The repo's own headers live under external/<repo> when dflash is
    # someone else's dependency.
    root = Label("//:BUILD").workspace_root or "."
    gencode = " ".join([
        "-gencode=arch=compute_%s,code=sm_%s" % (a, a)
        for a in CUDA_ARCHS
    ])
    objs = []
    for src in srcs:
        obj = "_%s_objs/%s.o" % (name, src.replace(".cu", ""))
        native.genrule(
            name = "%s_%s_nvcc" % (name, src.replace("/", "_").replace(".", "_")),
            srcs = [src] + hdrs + nvcc_inputs,
            outs = [obj],
            cmd = " ".join([
                NVCC,
                "-std=c++17 -O3 -Xcompiler -fPIC -ccbin /usr/bin/g++",
                "--expt-relaxed-constexpr",
                gencode,
                "-I%s -I$(GENDIR)/%s" % (root, root),
                " ".join(copts),
                "-c $(location %s) -o $@" % src,
            ]),
            testonly = testonly,
        )
        objs.append(obj)
    native.cc_library(
        name = name,
        srcs = objs,
        hdrs = hdrs,
        deps = deps + ["@local_config_cuda//:cudart"],
        visibility = visibility,
        testonly = testonly,
        alwayslink = True,
    )
