"""External repositories of dflash, wrapped from Debian's system packages.

Every repository is defined under its canonical upstream name and labels, and
only when the caller has not defined it already, so a consumer that builds
abseil, googletest, benchmark or protobuf from source keeps its own. Nothing
here downloads: this Bazel (4.2.3) runs offline.
"""

_ABSL_MODULES = {
    # package: {target: pkg-config module or None for header-only}
    "absl/base": {"base": "absl_base", "core_headers": None},
    "absl/container": {
        "flat_hash_map": "absl_flat_hash_map",
        "flat_hash_set": "absl_flat_hash_set",
        "inlined_vector": "absl_inlined_vector",
    },
    "absl/flags": {
        "flag": "absl_flags",
        "parse": "absl_flags_parse",
        "usage": "absl_flags_usage",
    },
    "absl/status": {"status": "absl_status", "statusor": "absl_statusor"},
    "absl/strings": {
        "cord": "absl_cord",
        "str_format": "absl_str_format",
        "strings": "absl_strings",
    },
    "absl/synchronization": {"synchronization": "absl_synchronization"},
    "absl/time": {"time": "absl_time"},
    "absl/types": {
        "optional": "absl_optional",
        "span": "absl_span",
        "variant": "absl_variant",
    },
}

def _pkg_config_libs(ctx, module):
    result = ctx.execute(["pkg-config", "--libs", module])
    if result.return_code == 0:
        return result.stdout.strip().split(" ")
    return ["-l" + module]

def _system_absl_impl(ctx):
    ctx.file("WORKSPACE", "workspace(name = \"%s\")\n" % ctx.name)
    ctx.file("BUILD", "")
    for package, targets in _ABSL_MODULES.items():
        rules = ['package(default_visibility = ["//visibility:public"])\n']
        for target, module in sorted(targets.items()):
            linkopts = _pkg_config_libs(ctx, module) if module else []
            rules.append("cc_library(name = %r, linkopts = %r)\n" % (target, linkopts))
        ctx.file(package + "/BUILD", "\n".join(rules))

_system_absl = repository_rule(implementation = _system_absl_impl, local = True)

def _build_only_impl(ctx):
    ctx.file("WORKSPACE", "workspace(name = \"%s\")\n" % ctx.name)
    for path, content in ctx.attr.files.items():
        ctx.file(path, content)
    for target, source in ctx.attr.symlinks.items():
        ctx.symlink(source, target)

# A repository made of generated BUILD/bzl files (and symlinks into /usr).
_build_only = repository_rule(
    implementation = _build_only_impl,
    attrs = {
        "files": attr.string_dict(),
        "symlinks": attr.string_dict(),
    },
    local = True,
)

_RULES_CC_DEFS = """
def cc_binary(**kwargs):
    native.cc_binary(**kwargs)

def cc_library(**kwargs):
    native.cc_library(**kwargs)

def cc_test(**kwargs):
    native.cc_test(**kwargs)

def cc_proto_library(**kwargs):
    native.cc_proto_library(**kwargs)

def cc_toolchain(**kwargs):
    native.cc_toolchain(**kwargs)

def cc_toolchain_suite(**kwargs):
    native.cc_toolchain_suite(**kwargs)

def cc_import(**kwargs):
    native.cc_import(**kwargs)

def objc_library(**kwargs):
    native.objc_library(**kwargs)
"""

_GTEST_BUILD = """
package(default_visibility = ["//visibility:public"])

cc_library(name = "gtest", linkopts = ["-lgmock", "-lgtest", "-lpthread"])

cc_library(name = "gtest_main", linkopts = ["-lgmock", "-lgtest_main", "-lgtest", "-lpthread"])
"""

_BENCHMARK_BUILD = """
package(default_visibility = ["//visibility:public"])

cc_library(name = "benchmark", linkopts = ["-lbenchmark", "-lpthread"])

cc_library(name = "benchmark_main", linkopts = ["-lbenchmark_main", "-lbenchmark", "-lpthread"])
"""

_PROTOBUF_BUILD = """
package(default_visibility = ["//visibility:public"])

exports_files(["protoc"])

cc_library(name = "protobuf", linkopts = ["-lprotobuf", "-lpthread"])

alias(name = "protobuf_headers", actual = ":protobuf")

proto_lang_toolchain(
    name = "cc_toolchain",
    command_line = "--cpp_out=$(OUT)",
    runtime = ":protobuf",
)
"""

_OPENBLAS_BUILD = """
package(default_visibility = ["//visibility:public"])

# cblas.h is on the system include path (Debian's libopenblas-dev).
cc_library(name = "cblas", linkopts = ["-lopenblas", "-lpthread"])
"""

_DNNL_BUILD = """
package(default_visibility = ["//visibility:public"])

# oneapi/dnnl/dnnl.hpp is on the system include path (Debian's libdnnl-dev,
# built on the OpenMP runtime: libgomp sets its threads).
cc_library(name = "dnnl", linkopts = ["-ldnnl", "-lgomp"])
"""

_COVERAGE_BUILD = """
package(default_visibility = ["//visibility:public"])

filegroup(name = "coverage_report_generator")

filegroup(name = "lcov_merger")
"""

def _maybe(rule, name, **kwargs):
    if name not in native.existing_rules():
        rule(name = name, **kwargs)

def dflash_dependencies():
    """Defines every external repository dflash needs, unless already defined."""
    _maybe(
        _build_only,
        name = "rules_cc",
        files = {"BUILD": "", "cc/BUILD": "", "cc/defs.bzl": _RULES_CC_DEFS},
    )
    _maybe(_build_only, name = "remote_coverage_tools", files = {"BUILD": _COVERAGE_BUILD})
    _maybe(
        native.local_repository,
        name = "platforms",
        path = "/usr/share/bazel/tools/platforms",
    )
    _maybe(
        native.local_repository,
        name = "bazel_skylib",
        path = "/usr/share/bazel/tools/skylib",
    )
    _maybe(
        native.local_repository,
        name = "rules_java",
        path = "/usr/share/bazel/rules/java",
    )
    _maybe(_system_absl, name = "com_google_absl")
    _maybe(_build_only, name = "com_google_googletest", files = {"BUILD": _GTEST_BUILD})
    _maybe(_build_only, name = "com_github_google_benchmark", files = {"BUILD": _BENCHMARK_BUILD})
    _maybe(
        _build_only,
        name = "com_google_protobuf",
        files = {"BUILD": _PROTOBUF_BUILD},
        symlinks = {"protoc": "/usr/bin/protoc"},
    )
    _maybe(_build_only, name = "openblas", files = {"BUILD": _OPENBLAS_BUILD})
    _maybe(_build_only, name = "dnnl", files = {"BUILD": _DNNL_BUILD})
    _maybe(_cuda_configure, name = "local_config_cuda")
    _maybe(_python_configure, name = "local_config_python")
    _maybe(_pybind11_configure, name = "pybind11")

# Where no toolkit is found, the CUDA libraries exist but are incompatible,
# so targets that need them are skipped by //... rather than missing.
_CUDA_DISABLED_BUILD = """
package(default_visibility = ["//visibility:public"])

[cc_library(
    name = name,
    target_compatible_with = ["@platforms//:incompatible"],
) for name in ["cuda_headers", "cudart"]]
"""

def _cuda_lib_dir(ctx, root):
    """The toolkit's library folder: lib64, lib or targets/<arch>/lib."""
    candidates = [root + "/lib64", root + "/lib"]
    targets = ctx.path(root + "/targets")
    if targets.exists:
        candidates += [str(t) + "/lib" for t in targets.readdir()]
    for lib in candidates:
        if ctx.path(lib + "/libcudart.so").exists:
            return lib
    return None

def _cudart_major(ctx, lib):
    """The major version in libcudart's file name (libcudart.so.13)."""
    for entry in ctx.path(lib).readdir():
        name = entry.basename
        if name.startswith("libcudart.so.") and name.count(".") == 2:
            return name.split(".")[2]
    fail("no libcudart.so.<major> in " + lib)

def _host_cxx(ctx):
    """nvcc's host compiler: CUDAHOSTCXX, else CXX, else g++ on PATH."""
    env = ctx.os.environ
    for name in ["CUDAHOSTCXX", "CXX"]:
        if env.get(name):
            return env[name]
    found = ctx.which("g++")
    return str(found) if found else "g++"

def _cuda_configure_impl(ctx):
    ctx.file("WORKSPACE", "workspace(name = \"local_config_cuda\")\n")
    env = ctx.os.environ
    root = env.get("CUDA_PATH", "/usr/local/cuda")
    nvcc = ctx.path(root + "/bin/nvcc")
    lib = _cuda_lib_dir(ctx, root) if nvcc.exists else None
    enabled = env.get("DFLASH_CUDA", "auto") != "0" and nvcc.exists and lib != None
    archs = [a for a in env.get("DFLASH_CUDA_ARCHS", "80,90").split(",") if a]
    if not enabled:
        ctx.file("BUILD", _CUDA_DISABLED_BUILD)
        ctx.file("defs.bzl", "CUDA_ENABLED = False\nCUDA_ROOT = \"\"\nCUDA_LIB_DIR = \"\"\nNVCC = \"\"\nHOST_CXX = \"\"\nCUDA_ARCHS = []\n")
        return
    ctx.symlink(root + "/include", "include")
    major = _cudart_major(ctx, lib)
    for name in ["libcudart_static.a", "libcudart.so." + major]:
        ctx.symlink(lib + "/" + name, "lib/" + name)
    ctx.file("BUILD", """
package(default_visibility = ["//visibility:public"])

# Under --config=cuda_emulated the project's CUDA code compiles against,
# and runs on, dflash's CPU emulation of CUDA (tools/cuda_emulation).
alias(
    name = "cuda_headers",
    actual = select({{
        "@dflash//tools/cuda:emulated": "@dflash//tools/cuda_emulation:headers",
        "//conditions:default": ":toolkit_headers",
    }}),
)

alias(
    name = "cudart",
    actual = select({{
        "@dflash//tools/cuda:emulated": "@dflash//tools/cuda_emulation:runtime",
        "//conditions:default": ":toolkit_cudart",
    }}),
)

cc_library(
    name = "toolkit_headers",
    hdrs = glob(["include/**"]),
    includes = ["include"],
)

# The CUDA runtime: static where a target links statically (a cc_binary,
# the Python extension module), so that it opens the driver (libcuda.so.1)
# itself on the first CUDA call and nothing of CUDA is needed to load it;
# the shared library where Bazel links tests dynamically.
cc_import(
    name = "cudart_import",
    static_library = "lib/libcudart_static.a",
    shared_library = "lib/libcudart.so.{major}",
)

cc_library(
    name = "toolkit_cudart",
    linkopts = ["-ldl", "-lrt", "-lpthread"],
    deps = [
        ":toolkit_headers",
        ":cudart_import",
    ],
)
""".format(major = major))
    ctx.file("defs.bzl", "CUDA_ENABLED = True\nCUDA_ROOT = %r\nCUDA_LIB_DIR = %r\nNVCC = %r\nHOST_CXX = %r\nCUDA_ARCHS = %r\n" % (
        root,
        lib,
        str(nvcc),
        _host_cxx(ctx),
        archs,
    ))

# Finds the CUDA toolkit (CUDA_PATH, else /usr/local/cuda). DFLASH_CUDA=0
# turns CUDA off; DFLASH_CUDA_ARCHS=80,90 picks the SM architectures (the
# last also gets PTX); CUDAHOSTCXX or CXX names nvcc's host compiler.
_cuda_configure = repository_rule(
    implementation = _cuda_configure_impl,
    environ = ["CUDA_PATH", "CUDAHOSTCXX", "CXX", "DFLASH_CUDA", "DFLASH_CUDA_ARCHS"],
    local = True,
)

# Where Debian's pybind11-dev puts pybind11/.
_PYBIND11_INCLUDE = "/usr/include"

def _python_configure_impl(ctx):
    ctx.file("WORKSPACE", "workspace(name = \"local_config_python\")\n")
    python = ctx.os.environ.get("DFLASH_PYTHON", "/usr/bin/python3")
    probe = ctx.execute([python, "-c", "\n".join([
        "import sys, sysconfig",
        "print(sysconfig.get_paths()['include'])",
        "print('cp%d%d' % sys.version_info[:2])",
        "print(sysconfig.get_platform().replace('-', '_').replace('.', '_'))",
    ])])
    lines = probe.stdout.strip().split("\n") if probe.return_code == 0 else []
    enabled = (
        len(lines) == 3 and ctx.path(lines[0] + "/Python.h").exists and
        ctx.path(_PYBIND11_INCLUDE + "/pybind11/pybind11.h").exists
    )
    if not enabled:
        ctx.file("BUILD", "")
        ctx.file("defs.bzl", "PYTHON_ENABLED = False\nPYTHON_BIN = \"\"\nPYTHON_TAG = \"\"\nPLATFORM_TAG = \"\"\n")
        return
    ctx.symlink(lines[0], "include")
    ctx.file("BUILD", """
package(default_visibility = ["//visibility:public"])

cc_library(
    name = "python_headers",
    hdrs = glob(["include/**/*.h"]),
    includes = ["include"],
)
""")
    ctx.file("defs.bzl", "PYTHON_ENABLED = True\nPYTHON_BIN = %r\nPYTHON_TAG = %r\nPLATFORM_TAG = %r\n" % (
        python,
        lines[1],
        lines[2],
    ))

# The Python that dflash's extension module is built for: DFLASH_PYTHON, else
# Debian's /usr/bin/python3 (the one python3-torch installs into; a python3
# earlier on PATH may lack torch). Its headers (python3-dev) and pybind11
# (pybind11-dev) must both be there; otherwise the Python targets drop out,
# as the CUDA ones do without a toolkit.
_python_configure = repository_rule(
    implementation = _python_configure_impl,
    environ = ["DFLASH_PYTHON"],
    local = True,
)

def _pybind11_configure_impl(ctx):
    ctx.file("WORKSPACE", "workspace(name = \"pybind11\")\n")
    if not ctx.path(_PYBIND11_INCLUDE + "/pybind11/pybind11.h").exists:
        ctx.file("BUILD", "")
        return
    ctx.symlink(_PYBIND11_INCLUDE + "/pybind11", "include/pybind11")
    ctx.file("BUILD", """
package(default_visibility = ["//visibility:public"])

# Header-only, from Debian's pybind11-dev.
cc_library(
    name = "pybind11",
    hdrs = glob(["include/pybind11/**/*.h"]),
    includes = ["include"],
    deps = ["@local_config_python//:python_headers"],
)
""")

_pybind11_configure = repository_rule(
    implementation = _pybind11_configure_impl,
    local = True,
)
