"""Fuzz targets: a libFuzzer binary and a corpus-replay test from one source.

dflash_fuzz_target(name, srcs, deps) defines, for a source that implements
LLVMFuzzerTestOneInput:
  name          the libFuzzer binary; build and run it with --config=fuzz
                (clang, -fsanitize=fuzzer,address,undefined). Tagged manual,
                so `bazel test //...` (gcc) does not try to build it.
  name_replay   a cc_test that feeds every file of corpus/<name>/ (the seed
                corpus and every crash found, kept as a regression) through
                the same function with any compiler, sanitizers per config.
"""

def dflash_fuzz_target(name, srcs, deps = []):
    corpus = native.glob(["corpus/%s/*" % name])
    native.cc_binary(
        name = name,
        srcs = srcs,
        deps = deps,
        linkopts = ["-fsanitize=fuzzer"],
        tags = ["manual"],
        testonly = True,
    )
    native.cc_test(
        name = name + "_replay",
        size = "small",
        srcs = srcs,
        deps = deps + [Label("//tools/fuzz:replay_main")],
        data = corpus,
        args = ["$(location %s)" % f for f in corpus],
    )
