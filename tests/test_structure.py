"""The package's structure, as CI checks it: no import cycle among fxfuse's modules, no private name used across
modules, every package installed by the packaging configuration, and docs/architecture.md naming only files and
passes that exist.

Imports are read from the source (``ast``), function-level ones included: a lazy import hides a cycle from the
interpreter, not from a reader.
"""
from __future__ import annotations

import ast
import os
import re
from pathlib import Path
from typing import Dict, List, Set, Tuple

import pytest

ROOT = Path(__file__).resolve().parent.parent
# package name -> source folder, as pyproject's [tool.setuptools.package-dir] maps them
TREES = {"fxfuse": ROOT / "fxfuse", "fxfuse.passes": ROOT / "passes"}


def _modules() -> Dict[str, Path]:
    mods: Dict[str, Path] = {}
    for pkg, folder in TREES.items():
        for path in folder.rglob("*.py"):
            if "__pycache__" in path.parts:
                continue
            rel = path.relative_to(folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            mods[".".join([pkg, *parts])] = path
    return mods


MODULES = _modules()


def _is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def _resolve(importer: str, path: Path, level: int, module: str | None) -> str:
    if not level:
        return module or ""
    base = importer.split(".")
    if not _is_package(path):
        base = base[:-1]
    base = base[:len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def _imports(name: str, path: Path) -> Tuple[Set[str], List[str]]:
    """(fxfuse modules ``name`` imports, private names it takes from other fxfuse modules)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    deps: Set[str] = set()
    private: List[str] = []
    aliases: Dict[str, str] = {}  # local name -> fxfuse module it is bound to
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            target = _resolve(name, path, node.level, node.module)
            if not target.startswith("fxfuse"):
                continue
            for a in node.names:
                full = f"{target}.{a.name}"
                if full in MODULES:  # `from pkg import module`
                    deps.add(full)
                    aliases[a.asname or a.name] = full
                    continue
                deps.add(target)
                if a.name.startswith("_") and not a.name.startswith("__"):
                    private.append(f"line {node.lineno}: from {target} import {a.name}")
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("fxfuse"):
                    deps.add(a.name)
                    if a.asname:
                        aliases[a.asname] = a.name
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                and node.attr.startswith("_") and not node.attr.startswith("__")):
            private.append(f"line {node.lineno}: {aliases[node.value.id]}.{node.attr}")
    return {d for d in deps if d in MODULES and d != name}, private


def _cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    found: List[List[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle():
    graph = {name: _imports(name, path)[0] for name, path in MODULES.items()}
    assert _cycles(graph) == [], "import cycles among fxfuse's modules"


def test_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_every_import_of_fxfuse_names_a_module_that_exists():
    """Function-level imports included: a moved module breaks them only when that code path runs."""
    missing = []
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                target = _resolve(name, path, node.level, node.module)
                if target.startswith("fxfuse") and target not in MODULES:
                    missing.append(f"{name} line {node.lineno}: from {target} import ...")
            elif isinstance(node, ast.Import):
                missing += [f"{name} line {node.lineno}: import {a.name}" for a in node.names
                            if a.name.startswith("fxfuse") and a.name not in MODULES]
    assert missing == []


def test_no_private_name_across_modules():
    found = {name: priv for name, path in MODULES.items() for priv in [_imports(name, path)[1]] if priv}
    assert found == {}, "private names imported or read from another fxfuse module (make them public or move them)"


def test_every_package_is_installed_by_pyproject():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    packages = set(cfg["packages"])
    expected = {name for name, path in MODULES.items() if _is_package(path)}
    assert packages == expected
    assert cfg["package-dir"] == {"fxfuse": "fxfuse", "fxfuse.passes": "passes"}


def test_architecture_doc_matches_the_code():
    import fxfuse

    doc = (ROOT / "docs" / "architecture.md").read_text()
    paths = set(re.findall(r"`((?:fxfuse|passes|tests|benchmarks|docs)/[\w/.\-]+\.(?:py|md))`", doc))
    assert paths, "docs/architecture.md names no source file"
    missing = sorted(p for p in paths if not (ROOT / p).exists())
    assert missing == [], "files docs/architecture.md names that do not exist"
    for spec in fxfuse.registered_passes():
        assert f"`{spec.name}`" in doc, f"docs/architecture.md does not list the pass {spec.name}"
    for name in re.findall(r"`fxfuse\.(\w+)\(`", doc):
        assert hasattr(fxfuse, name), f"docs/architecture.md calls fxfuse.{name}(), which does not exist"


def test_architecture_doc_user_pass_example_runs():
    """The worked example of docs/architecture.md, as written there, fuses x * sigmoid(x) under the backend."""
    import torch

    import fxfuse

    doc = (ROOT / "docs" / "architecture.md").read_text()
    block = next(b for b in re.findall(r"```python\n(.*?)```", doc, re.S) if "def fuse_silu" in b)
    code = block.split("\nmodel = ")[0]  # the pass itself; the model lines use the reader's own model
    scope: dict = {}
    exec(compile(code, "docs/architecture.md", "exec"), scope)

    def f(x):
        return (x * torch.sigmoid(x)).sum()

    x = torch.randn(6, 5)
    got = torch.compile(f, backend="fxfuse", options={"extra_passes": [scope["fuse_silu"]]})(x)
    rows = [r for r in fxfuse.report().records if r.pass_name == "fuse_silu"]
    assert [r.status for r in rows] == ["fused"] and rows[0].detail == {"sites": 1}
    torch.testing.assert_close(got, f(x))
