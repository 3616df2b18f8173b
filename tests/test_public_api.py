"""The public API: what ``mmproc`` exports, and that every hook is documented and tested."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import mmproc
import pytest
from mmproc.hookspecs import MODEL_HOOK_NAMES, DiscoverySpec, ModelSpec

ROOT = Path(__file__).resolve().parents[1]


def test_all_is_sorted_and_every_name_resolves() -> None:
    assert mmproc.__all__ == sorted(mmproc.__all__)
    assert set(mmproc.__all__) == {*mmproc._LAZY, "__version__"}
    for name in mmproc.__all__:
        assert getattr(mmproc, name) is not None


def test_unknown_attribute_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        mmproc.nope  # noqa: B018


@pytest.mark.parametrize("hook", [*MODEL_HOOK_NAMES, "mmproc_register_models"])
def test_every_hook_is_documented_with_its_signature(hook: str) -> None:
    spec = getattr(ModelSpec, hook, None) or getattr(DiscoverySpec, hook)
    doc = inspect.getdoc(spec) or ""
    params = [p for p in inspect.signature(spec).parameters if p != "self"]
    assert f"Signature: ``{hook}({', '.join(params)})" in doc
    assert "Called" in doc, f"{hook}'s docstring must say when and on which thread it is called"


def _test_function_names() -> set[str]:
    paths = [*(ROOT / "tests").glob("test_*.py"), *(ROOT / "plugins").glob("*/tests/test_*.py")]
    return {
        node.name
        for path in paths
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")
    }


@pytest.mark.parametrize("hook", [*MODEL_HOOK_NAMES, "mmproc_register_models"])
def test_every_hook_has_a_test_of_its_own(hook: str) -> None:
    # A test *named* for the hook (tests/test_hooks.py), not just its name somewhere in a file.
    assert any(name.startswith(f"test_hook_{hook}_") for name in _test_function_names()), (
        f"no test_hook_{hook}_... test: add one to tests/test_hooks.py"
    )


@pytest.mark.parametrize("hook", [*MODEL_HOOK_NAMES, "mmproc_register_models"])
def test_the_plugin_guide_has_a_section_for_every_hook_with_its_signature(hook: str) -> None:
    spec = getattr(ModelSpec, hook, None) or getattr(DiscoverySpec, hook)
    params = [p for p in inspect.signature(spec).parameters if p != "self"]
    guide = (ROOT / "docs" / "plugins.md").read_text()
    assert f"\n### `{hook}({', '.join(params)})`\n" in guide, (
        f"docs/plugins.md lacks the section '### `{hook}({', '.join(params)})`'"
    )


def test_mypy_checks_every_shipped_plugin() -> None:
    import tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]
    packages = {
        str(path.relative_to(ROOT))
        for path in ROOT.glob("plugins/*/mmproc_*")
        if (path / "__init__.py").is_file()
    }
    assert packages and packages <= set(config["files"]), "add the plugin to [tool.mypy] files"
