"""podscale's import graph: layers point down (import-linter's contract in pyproject.toml), every
module sits in a layer, and JAX's private names have one home; and the code's size: the step class
is small and no module is over 600 lines."""

from __future__ import annotations

import ast
import inspect
import pathlib
import textwrap
import tomllib

from importlinter.cli import lint_imports

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "podscale"


def _modules() -> dict[str, ast.Module]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = ast.parse(path.read_text(), str(path))
    return found


def _layers() -> list[str]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    (contract,) = config["contracts"]
    return [m.strip() for layer in contract["layers"] for m in layer.replace(":", "|").split("|")]


def test_the_layers_point_down():
    assert lint_imports(str(ROOT / "pyproject.toml"), no_cache=True, no_logo=True) == 0


def test_every_module_is_in_a_layer():
    """A new module or package joins the contract; only the package's own ``__init__`` (the
    public API, which re-exports from every layer) stands above them all, and a subpackage's
    ``__init__`` that imports nothing is a docstring."""
    layers = _layers()
    outside = [
        m
        for m, tree in _modules().items()
        if m != "podscale"
        and not any(m == x or m.startswith(x + ".") for x in layers)
        and any(isinstance(n, ast.Import | ast.ImportFrom) for n in ast.walk(tree))
    ]
    assert not outside, f"add these to a layer of [tool.importlinter] in pyproject.toml: {outside}"


def test_no_module_reaches_the_public_api_from_below():
    """``from podscale import data_parallel`` inside the package would import every layer through
    ``podscale/__init__.py``, hidden from the contract; modules import what they use from its home."""
    modules = _modules()
    through_root = []
    for name, tree in modules.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "podscale":
                through_root += [f"{name}: {a.name}" for a in node.names if f"podscale.{a.name}" not in modules]
    assert not through_root, through_root


def test_jax_private_names_have_one_home():
    """Only ``podscale/_jax.py`` imports ``jax._src``."""
    private = []
    for name, tree in _modules().items():
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            private += [f"{name}: {n}" for n in names if n == "jax._src" or n.startswith("jax._src.")]
    assert all(p.startswith("podscale._jax:") for p in private), private
    assert private, "podscale._jax imports nothing private: the check would be empty"


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _reaches_into(module: str, package: str, tree: ast.Module) -> list[str]:
    """Where ``module`` (in ``package``) takes another podscale module's underscore names:
    ``from podscale.x import _name``, a read of ``m._name`` where ``m`` was imported from podscale
    (a module, or anything a module exports), or an import from an underscore-named module
    (``podscale._jax``, the one home of JAX's private names, aside)."""
    imported: set[str] = set()  # the names bound here by imports from podscale
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            source = node.module or ""
            if node.level:  # relative to the package this module sits in
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([source] if source else []))
            if source.split(".")[0] != "podscale":
                continue
            sources = [source]
            for a in node.names:
                imported.add(a.asname or a.name)
                if _private(a.name):
                    found.append(f"{module}:{node.lineno}: from {source} import {a.name}")
        elif isinstance(node, ast.Import):
            sources = [a.name for a in node.names if a.name.split(".")[0] == "podscale"]
            imported |= {a.asname or a.name.split(".")[0] for a in node.names if a.name in sources}
        else:
            continue
        for source in sources:
            if source != "podscale._jax" and any(_private(part) for part in source.split(".")):
                found.append(f"{module}:{node.lineno}: imports {source}, an underscore-named module")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and root.id in imported:
                found.append(f"{module}:{node.lineno}: reads {ast.unparse(node)}")
    return found


def test_no_module_imports_another_s_underscore_names():
    """A name another module imports is that module's API, and is named without an underscore; an
    underscore name is its own module's alone (issue 43). JAX's private names are read in
    ``podscale/_jax.py`` and exported from there under public names."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        package = ".".join(parts[:-1])  # a package's __init__ is the package itself
        module = package if parts[-1] == "__init__" else ".".join(parts)
        found += _reaches_into(module, package, ast.parse(path.read_text()))
    assert not found, "drop the underscore of these names at their definition:\n" + "\n".join(found)


def test_the_underscore_check_sees_each_way_in():
    """The check above finds what it is for (it would pass on an empty walk too)."""
    source = """
import podscale.compiled.hlo
from podscale.compiled import hlo_cost
from podscale.parallel.partition.sums import _narrow_float, widen
from podscale.parallel._interpret import sub_jaxprs
from . import _rules
from podscale._jax import mlir, xla_bridge
hlo_cost._bytes("f32[2]"), podscale.compiled.hlo._HEADER, xla_bridge._backends, hlo_cost.__name__
"""
    found = _reaches_into("podscale.parallel.partition.core", "podscale.parallel.partition", ast.parse(source))
    assert sorted(f.split(": ", 1)[1] for f in found) == [
        "from podscale.parallel.partition import _rules",
        "from podscale.parallel.partition.sums import _narrow_float",
        "imports podscale.parallel._interpret, an underscore-named module",
        "reads hlo_cost._bytes",
        "reads podscale.compiled.hlo._HEADER",
        "reads xla_bridge._backends",
    ]


def _public_members(cls) -> set[str]:
    """A class's public names: those defined in its body and the ``self.x = ...`` attributes its
    methods set (dunders such as ``__call__`` are not members)."""
    (tree,) = ast.parse(textwrap.dedent(inspect.getsource(cls))).body
    names = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    for node in ast.walk(tree):
        targets = (
            node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        )
        for t in targets:
            for n in ast.walk(t):
                if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self":
                    names.add(n.attr)
    return {n for n in names if not n.startswith("_")}


def test_the_step_class_is_small():
    """``DataParallelStep`` keeps what a user of the step needs; the strategy's fields are
    ``dp.strategy``'s, the axes' roles ``dp.roles``', and building the step is
    :mod:`podscale.parallel.compile_step`'s."""
    from podscale.parallel.engine import DataParallelStep

    members = _public_members(DataParallelStep)
    assert {"step", "mesh", "strategy", "roles", "layout", "prepare", "place_state"} <= members, members
    assert len(members) <= 20, sorted(members)
    lines, _ = inspect.getsourcelines(DataParallelStep)
    assert len(lines) < 200, len(lines)


def test_no_module_is_over_600_lines():
    long = {str(p.relative_to(ROOT)): n for p in PACKAGE.rglob("*.py") if (n := len(p.read_text().splitlines())) > 600}
    assert not long, long
