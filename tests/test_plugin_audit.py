"""Audits of the plugins shipped in plugins/: hooks that check out, the worker pool's clones, and
what they import.

A ``process_mm_data`` that ignores the ``processor`` it is given and reaches for one stored on the
model would make every worker thread share one HF processor: the failure is silent under light
load and corrupts outputs under concurrency. The AST audit keeps every shipped plugin honest.

A plugin imports mmproc through its face, :mod:`mmproc.plugin`, and nothing else of the core, so
that the core can change behind it; another plugin only through a module that plugin publishes
for the purpose (``mmproc_qwen_vl.shared``). Its tests may also use the kit (``mmproc.testing``)
and what a user of mmproc uses (``mmproc``, ``mmproc.inputs``, ``mmproc.media``, the engine side).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from mmproc.model_hooks import load_model_hooks
from mmproc.registry import PluginStatus, get_registry

ROOT = Path(__file__).resolve().parents[1]
PLUGINS = ROOT / "plugins"
PLUGIN_SOURCES = sorted(PLUGINS.glob("*/mmproc_*/*.py"))
PLUGIN_TESTS = sorted(PLUGINS.glob("*/tests/*.py"))
SCAFFOLD_ROOT = ROOT / "core" / "mmproc" / "scaffold" / "template"
# Template files stand for folders with "+" in their names (__package__+model.py.tmpl).
SCAFFOLD = sorted(SCAFFOLD_ROOT.rglob("__package__+*.py.tmpl"))
SCAFFOLD_TESTS = sorted(SCAFFOLD_ROOT.rglob("tests+*.py.tmpl"))
SHIPPED = sorted(path.name for path in PLUGINS.iterdir() if (path / "pyproject.toml").is_file())
# What a plugin's tests may import of mmproc besides the face: the kit and the user's API.
TEST_IMPORTS = ("mmproc.testing", "mmproc.inputs", "mmproc.media", "mmproc.wire", "mmproc.engine")
TEST_IMPORTS += ("mmproc.fused_norm",)
# Modules one plugin publishes for others.
SHARED_MODULES = ("mmproc_qwen_vl.shared",)


def imported_modules(path: Path) -> list[str]:
    """Every module ``path`` imports, lazy imports inside functions included."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append(node.module)
    return found


def own_package(path: Path) -> str:
    return "mmproc_" + path.relative_to(PLUGINS).parts[0]


def process_mm_data_overrides() -> list[tuple[Path, str, ast.FunctionDef]]:
    found = []
    for path in PLUGIN_SOURCES:
        tree = ast.parse(path.read_text(), filename=str(path))
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            for fn in cls.body:
                if isinstance(fn, ast.FunctionDef) and fn.name == "process_mm_data":
                    found.append((path, cls.name, fn))
    return found


def test_the_audit_sees_the_shipped_overrides() -> None:
    # If this fails, the audit below silently checks nothing: fix the discovery.
    assert any(cls == "QwenVLModel" for _, cls, _ in process_mm_data_overrides())


@pytest.mark.parametrize(
    ("path", "cls", "fn"),
    process_mm_data_overrides(),
    ids=lambda v: v if isinstance(v, str) else getattr(v, "name", ""),
)
def test_process_mm_data_uses_the_worker_clone(path: Path, cls: str, fn: ast.FunctionDef) -> None:
    where = f"{path.relative_to(PLUGINS)}: {cls}.process_mm_data"
    params = [a.arg for a in fn.args.args]
    assert "processor" in params, f"{where} must take the worker's `processor` clone"
    for node in ast.walk(fn):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "self"
            and "processor" in node.attr
        ):
            pytest.fail(f"{where} uses self.{node.attr}: use the `processor` argument instead")


@pytest.mark.parametrize("plugin", SHIPPED)
def test_every_shipped_plugin_serves_its_architectures_with_checked_hooks(plugin: str) -> None:
    registry = get_registry()
    [info] = [info for info in registry.plugins() if info.name == plugin]
    assert info.status is PluginStatus.LOADED, info.error
    assert info.architectures, f"plugin {plugin!r} registers no architecture"
    for architecture in info.architectures:
        reference = registry.resolve(architecture)
        assert reference.plugin == plugin
        hooks = load_model_hooks(reference)  # imports the class and checks it against the specs
        assert hooks.reference.target.startswith(f"mmproc_{plugin}.")


def test_the_import_audit_sees_every_shipped_plugin_and_the_scaffold() -> None:
    # If this fails, the audits below silently check nothing: fix the discovery.
    assert len(SHIPPED) >= 5 and "qwen_vl" in SHIPPED
    assert {own_package(path) for path in PLUGIN_SOURCES} == {f"mmproc_{p}" for p in SHIPPED}
    assert any(path.name == "__package__+model.py.tmpl" for path in SCAFFOLD)
    assert SCAFFOLD_TESTS


@pytest.mark.parametrize(
    "path", [*PLUGIN_SOURCES, *SCAFFOLD], ids=lambda p: f"{p.parts[-2]}/{p.name}"
)
def test_plugin_code_imports_only_the_plugin_face_of_mmproc(path: Path) -> None:
    own = own_package(path) if path.is_relative_to(PLUGINS) else None
    for module in imported_modules(path):
        top = module.split(".")[0]
        if top == "mmproc":
            assert module == "mmproc.plugin", f"{path}: imports {module}; use mmproc.plugin"
        elif top.startswith("mmproc_") and top != own:
            assert module in SHARED_MODULES, (
                f"{path}: imports {module}, another plugin's internals; "
                f"only {', '.join(SHARED_MODULES)} is published for other plugins"
            )


@pytest.mark.parametrize(
    "path", [*PLUGIN_TESTS, *SCAFFOLD_TESTS], ids=lambda p: f"{p.parts[-2]}/{p.name}"
)
def test_plugin_tests_import_the_face_the_kit_and_the_users_api_only(path: Path) -> None:
    allowed = ("mmproc", "mmproc.plugin", *TEST_IMPORTS)
    for module in imported_modules(path):
        if module.split(".")[0] == "mmproc":
            assert module in allowed or module.startswith(tuple(f"{a}." for a in allowed[1:])), (
                f"{path}: imports {module}, an internal module of mmproc"
            )
