"""The package's public surface: api_test.py WHEEL.

- `__all__` of dflash and dflash.torch lists every public name, each
  importable;
- every public function, class and method of the Python modules is
  annotated, and typing.get_type_hints resolves the annotations; the
  extension's stub (_core.pyi) declares every name the extension has;
- the wheel ships py.typed and _core.pyi, and its version (file name and
  METADATA) is dflash.__version__;
- with mypy in this Python (CI's newer-torch venv has it), `mypy --strict`
  accepts the package and a typed use of it from the installed wheel, and
  rejects a misuse; `python -m mypy.stubtest` finds the declarations in
  _core.pyi consistent with the built extension.
"""

import ast
import dataclasses
import glob
import importlib.util
import inspect
import os
import re
import subprocess
import sys
import tempfile
import types
import typing
import unittest
import venv
import zipfile

import dflash
import dflash.specforge
import dflash.torch
from dflash import _core

WHEEL = os.path.abspath(sys.argv.pop(1))
PACKAGE = os.path.dirname(os.path.abspath(dflash.__file__))

# A training step as a user types it: mypy --strict must accept it.
TYPED_USE = '''
from __future__ import annotations

from typing import Optional

import torch

import dflash
from dflash.torch import (CheckpointOptions, FusedHead, HeadStats,
                          ObjectiveDiagnostics, ObjectiveTerms,
                          checkpoint_options, chunked_reduce,
                          dflash_objective)


def step(hidden: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor,
         mask: torch.Tensor) -> float:
    config: dflash.ObjectiveConfig = dflash.objective_config(
        loss_type="dflash", gamma=7.0, chunk_blocks=4)
    prepared = dflash.PreparedProjection(weight)
    terms: ObjectiveTerms = dflash_objective(
        hidden, weight, ids, mask, config=config,
        prepared_projection=prepared, top_k=4)
    loss_num, loss_den, correct_num, accuracy_den, *_ = terms
    diagnostics: ObjectiveDiagnostics = terms.diagnostics
    stats: HeadStats = diagnostics.stats
    threads: int = stats["threads"]
    l1: float = diagnostics.family_terms["l1_loss_num"]
    values: Optional[torch.Tensor] = diagnostics.top_k_values
    accuracy: torch.Tensor = diagnostics.accuracy_per_position
    head = FusedHead(torch.nn.Linear(8, 13, bias=False), config)
    again: ObjectiveTerms = head(hidden, ids, mask)
    options: CheckpointOptions = checkpoint_options(config)
    (total,) = chunked_reduce(lambda x: (x.sum(),), hidden, chunk_size=2,
                              checkpoint=options["checkpoint"])
    version: str = dflash.__version__
    cuda: bool = dflash.built_with_cuda()
    dflash.release_cached_memory()
    return float(terms.loss + again.loss + total) + threads + l1 + len(
        version) + cuda + float(loss_num + loss_den + correct_num
                                + accuracy_den + accuracy.sum()) + (
        0.0 if values is None else float(values.sum()))
'''

# Moved to diagnostics, a wrong type, a wrong keyword: three errors.
MISUSE = '''
import torch

from dflash.torch import dflash_objective

terms = dflash_objective(torch.zeros(1), torch.zeros(1), torch.zeros(1),
                         torch.zeros(1))
print(terms.stats)
bad: str = terms.loss_den_offset
dflash_objective(torch.zeros(1), torch.zeros(1), torch.zeros(1),
                 torch.zeros(1), top_k="4")
'''


def public_names(module):
    """The names a module's namespace offers, less submodules (dflash.config,
    dflash.torch.objective, ...)."""
    return {name for name, value in vars(module).items()
            if not name.startswith("_")
            and not isinstance(value, types.ModuleType)}


def python_defined(module):
    """The public names of `module` that Python modules of dflash define."""
    return [name for name in module.__all__
            if getattr(module, name).__module__ != _core.__name__]


def public_members(cls):
    """A class's own public methods and properties, with their names."""
    for name, member in vars(cls).items():
        if name.startswith("_") and name != "__init__":
            continue
        if isinstance(member, property):
            yield f"{name} (property)", member.fget
        elif isinstance(member, (staticmethod, classmethod)):
            yield name, member.__func__
        elif inspect.isfunction(member):
            yield name, member


class AllTest(unittest.TestCase):
    def test_all_lists_every_public_name(self):
        for module in (dflash, dflash.torch):
            with self.subTest(module=module.__name__):
                self.assertEqual(sorted(module.__all__),
                                 sorted(public_names(module)))
                self.assertEqual(len(module.__all__), len(set(module.__all__)))

    def test_every_listed_name_imports(self):
        for module in (dflash, dflash.torch):
            for name in module.__all__:
                with self.subTest(name=f"{module.__name__}.{name}"):
                    scope = {}
                    exec(f"from {module.__name__} import {name}", scope)
                    self.assertIs(scope[name], getattr(module, name))

    def test_specforge_lists_what_it_defines(self):
        # dflash.specforge imports without SpecForge (apply() imports it).
        module = dflash.specforge
        defined = [name for name, value in vars(module).items()
                   if not name.startswith("_")
                   and not isinstance(value, types.ModuleType)
                   and getattr(value, "__module__",
                               module.__name__) == module.__name__]
        self.assertEqual(sorted(module.__all__), sorted(defined))
        self.assertIn("apply", module.__all__)
        self.assertIn("revert", module.__all__)

    def test_prepared_projection_is_listed(self):
        # The name the issue found missing, used by dflash_objective's
        # prepared_projection.
        self.assertIn("PreparedProjection", dflash.__all__)


class TypeHintsTest(unittest.TestCase):
    def assertAnnotated(self, what, function):
        signature = inspect.signature(function)
        missing = [name for name, p in signature.parameters.items()
                   if name not in ("self", "cls")
                   and p.annotation is inspect.Parameter.empty]
        self.assertEqual(missing, [], f"{what}: parameters not annotated")
        self.assertIsNot(signature.return_annotation,
                         inspect.Signature.empty,
                         f"{what}: return not annotated")
        hints = typing.get_type_hints(function)
        self.assertIn("return", hints, what)

    def test_every_public_python_name_is_annotated(self):
        checked = 0
        for module in (dflash, dflash.torch):
            for name in python_defined(module):
                value = getattr(module, name)
                what = f"{module.__name__}.{name}"
                with self.subTest(name=what):
                    if inspect.isfunction(value):
                        self.assertAnnotated(what, value)
                    else:
                        self.assertIsInstance(value, type, what)
                        # Fields (NamedTuple, dataclass, TypedDict) resolve.
                        typing.get_type_hints(value)
                        for member, function in public_members(value):
                            self.assertAnnotated(f"{what}.{member}", function)
                    checked += 1
        self.assertGreaterEqual(checked, 10)

    def test_specforge_names_are_annotated(self):
        module = dflash.specforge
        for name in module.__all__:
            value = getattr(module, name)
            with self.subTest(name=f"dflash.specforge.{name}"):
                if inspect.isfunction(value):
                    self.assertAnnotated(name, value)
                elif isinstance(value, type):
                    for member, function in public_members(value):
                        self.assertAnnotated(f"{name}.{member}", function)
                else:
                    self.assertIn(name, typing.get_type_hints(module))

    def test_result_classes_have_typed_documented_fields(self):
        terms = typing.get_type_hints(dflash.torch.ObjectiveTerms)
        self.assertEqual(list(terms)[:4], ["loss_num", "loss_den",
                                           "correct_num", "accuracy_den"])
        self.assertIs(terms["diagnostics"], dflash.torch.ObjectiveDiagnostics)
        fields = [f.name for f in dataclasses.fields(
            dflash.torch.ObjectiveDiagnostics)]
        for cls, names in ((dflash.torch.ObjectiveTerms, list(terms)),
                           (dflash.torch.ObjectiveDiagnostics, fields)):
            for name in names:
                with self.subTest(field=f"{cls.__name__}.{name}"):
                    self.assertRegex(cls.__doc__, rf"\b{name}\b")

    def test_typed_dicts_match_a_run(self):
        # The binding writes these dicts (python/native/module.cc): their
        # keys and value types as HeadStats and FamilyTerms declare them.
        import torch
        terms = dflash.torch.dflash_objective(
            torch.randn(1, 2, 4, 8), torch.randn(13, 8),
            torch.randint(0, 13, (1, 2, 4)), torch.ones(1, 2, 4))
        for cls, got in ((dflash.torch.HeadStats, terms.diagnostics.stats),
                         (dflash.torch.FamilyTerms,
                          terms.diagnostics.family_terms)):
            hints = typing.get_type_hints(cls)
            self.assertEqual(sorted(got), sorted(hints), cls.__name__)
            for key, value in got.items():
                want = typing.get_origin(hints[key]) or hints[key]
                with self.subTest(key=f"{cls.__name__}[{key!r}]"):
                    # An int where a float is declared, as PEP 484 allows.
                    self.assertIsInstance(
                        value, (int, float) if want is float else want)

    def test_stub_declares_every_extension_name(self):
        with open(os.path.join(PACKAGE, "_core.pyi")) as f:
            stub = ast.parse(f.read())
        declared = {node.name for node in stub.body
                    if isinstance(node, (ast.FunctionDef, ast.ClassDef))}
        runtime = {name for name in dir(_core) if not name.startswith("_")}
        self.assertEqual(declared, runtime)


class WheelTest(unittest.TestCase):
    def test_ships_the_typing_marker_and_stub(self):
        with zipfile.ZipFile(WHEEL) as wheel:
            names = set(wheel.namelist())
            record = wheel.read(next(n for n in names
                                     if n.endswith(".dist-info/RECORD")))
        for name in ("dflash/py.typed", "dflash/_core.pyi",
                     "dflash/_version.py"):
            self.assertIn(name, names)
            self.assertIn(name.encode() + b",sha256=", record)

    def test_one_version(self):
        # The file name and METADATA are written from python/defs.bzl's
        # VERSION by build_wheel.py; __version__ by the package's genrule.
        version = os.path.basename(WHEEL).split("-")[1]
        with zipfile.ZipFile(WHEEL) as wheel:
            metadata = wheel.read(next(
                n for n in wheel.namelist()
                if n.endswith(".dist-info/METADATA"))).decode()
            scope = {}
            exec(wheel.read("dflash/_version.py").decode(), scope)
        self.assertEqual(re.search(r"^Version: (.*)$", metadata,
                                   re.M).group(1), version)
        self.assertEqual(scope["__version__"], version)
        self.assertEqual(dflash.__version__, version)
        self.assertRegex(version, r"^\d+\.\d+\.\d+$")


@unittest.skipIf(importlib.util.find_spec("mypy") is None,
                 "mypy is not installed in this Python (CI's newer-torch "
                 "venv has it)")
class MypyTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.root = tempfile.mkdtemp(dir=os.environ.get("TEST_TMPDIR"))
        # The wheel in a venv of its own beside this Python's torch: mypy
        # reads it as an installed package, which needs py.typed.
        env_dir = os.path.join(cls.root, "venv")
        venv.create(env_dir, with_pip=True)
        cls.python = os.path.join(env_dir, "bin", "python")
        import torch
        (purelib,) = glob.glob(os.path.join(env_dir, "lib", "python*",
                                            "site-packages"))
        with open(os.path.join(purelib, "torch_site.pth"), "w") as f:
            f.write(os.path.dirname(os.path.dirname(torch.__file__)) + "\n")
        # Not the build's package on PYTHONPATH: mypy would read it there.
        cls.installed = dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1")
        cls.installed.pop("PYTHONPATH", None)
        subprocess.run([cls.python, "-m", "pip", "install", "--quiet",
                        "--no-index", "--no-deps", WHEEL],
                       check=True, env=cls.installed)
        cls.cache = os.path.join(cls.root, "mypy_cache")

    def mypy(self, *args, source=None, environment=None):
        command = [sys.executable, "-m", "mypy", "--strict",
                   "--cache-dir", self.cache, *args]
        if source is not None:
            path = os.path.join(self.root, "use.py")
            with open(path, "w") as f:
                f.write(source)
            command.append(path)
        return subprocess.run(command, cwd=self.root, env=environment,
                              capture_output=True, text=True)

    def test_installed_wheel_types_a_training_step(self):
        result = self.mypy("--python-executable", self.python,
                           source=TYPED_USE, environment=self.installed)
        self.assertEqual(result.returncode, 0, result.stdout + result.stderr)

    def test_installed_wheel_rejects_misuse(self):
        result = self.mypy("--python-executable", self.python,
                           source=MISUSE, environment=self.installed)
        self.assertEqual(result.returncode, 1, result.stdout + result.stderr)
        self.assertIn('"ObjectiveTerms" has no attribute "stats"',
                      result.stdout)
        self.assertIn('expression has type "float", variable has type "str"',
                      result.stdout)
        self.assertRegex(result.stdout, r'"top_k".*"str"')
        self.assertRegex(result.stdout, r"Found 3 errors")

    def test_package_sources_are_strict_clean(self):
        # The build's package (this test's PYTHONPATH), with this torch.
        result = self.mypy("-p", "dflash", environment=dict(
            os.environ, MYPYPATH=os.path.dirname(PACKAGE)))
        self.assertEqual(result.returncode, 0, result.stdout + result.stderr)

    def test_stub_matches_the_extension(self):
        # pybind11's classes have a metaclass of their own, and
        # ObjectiveConfig and SavedHead have no constructor (static methods
        # and start_objective make them).
        allowlist = os.path.join(self.root, "stubtest_allowlist.txt")
        with open(allowlist, "w") as f:
            f.write("dflash._core.ObjectiveConfig\n"
                    "dflash._core.ObjectiveConfig.__init__\n"
                    "dflash._core.PreparedProjection\n"
                    "dflash._core.VocabShard\n"
                    "dflash._core.SavedHead\n"
                    "dflash._core.SavedHead.__init__\n")
        environment = dict(os.environ,
                           MYPYPATH=os.path.dirname(PACKAGE))
        result = subprocess.run(
            [sys.executable, "-m", "mypy.stubtest", "--allowlist", allowlist,
             "--mypy-config-file", os.devnull, "dflash._core"],
            cwd=self.root, env=environment, capture_output=True, text=True)
        self.assertEqual(result.returncode, 0, result.stdout + result.stderr)


if __name__ == "__main__":
    unittest.main(verbosity=2)
