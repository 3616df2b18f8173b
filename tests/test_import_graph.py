"""The core's import graph: no circle anywhere, lazy imports (inside functions, and the lazy
name tables of ``mmproc`` and ``mmproc.plugin``) counted; and the faces stay light."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import mmproc.plugin

CORE = Path(__file__).resolve().parents[1] / "core"
LAZY_TABLES = ("mmproc", "mmproc.plugin")


def core_modules() -> dict[str, Path]:
    modules = {}
    for path in CORE.rglob("*.py"):
        parts = list(path.relative_to(CORE).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def import_edges(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the core modules it imports, wherever in it the import statement is."""

    def known(name: str) -> str:
        while name not in modules and "." in name:
            name = name.rsplit(".", 1)[0]
        return name

    edges: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*parts, *([node.module] if node.module else [])])
                targets = [f"{base}.{alias.name}" for alias in node.names]
            else:
                continue
            edges[name].update(known(t) for t in targets if t.split(".")[0] == "mmproc")
        if name in LAZY_TABLES:
            edges[name].update(re.findall(r'": "(mmproc[\w.]*)"', path.read_text()))
        edges[name].discard(name)
    return edges


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in edges[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in edges:
        if node not in index:
            visit(node)
    return found


def test_the_graph_sees_lazy_imports() -> None:
    # If this fails, the circle test checks less than it says: fix import_edges.
    edges = import_edges(core_modules())
    assert "mmproc.processor" in edges["mmproc"]  # a lazy name of mmproc
    assert "mmproc.fused_norm" in edges["mmproc.processor"]  # imported inside a method
    assert "mmproc.media.container" in edges["mmproc.media.video"]


def test_a_circle_is_found_where_there_is_one() -> None:
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_core_has_no_import_circle() -> None:
    assert circles(import_edges(core_modules())) == []


def test_importing_the_plugin_face_imports_nothing_heavy() -> None:
    code = (
        "import sys, mmproc.plugin; from mmproc.plugin import hookimpl; "
        "print(sorted(m for m in ('torch', 'numpy', 'PIL', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_every_name_of_the_plugin_face_resolves_and_is_documented() -> None:
    assert set(mmproc.plugin.__all__) == set(mmproc.plugin._LAZY)
    for name in mmproc.plugin.__all__:
        value = getattr(mmproc.plugin, name)
        if callable(value):
            assert value.__doc__, f"mmproc.plugin.{name} has no docstring"
