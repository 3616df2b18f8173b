"""Audits of the plugins shipped in plugins/: hooks that check out, and the worker pool's clones.

A ``process_mm_data`` that ignores the ``processor`` it is given and reaches for one stored on the
model would make every worker thread share one HF processor: the failure is silent under light
load and corrupts outputs under concurrency. The AST audit keeps every shipped plugin honest.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from mmproc.model_hooks import load_model_hooks
from mmproc.registry import get_registry

PLUGINS = Path(__file__).resolve().parents[1] / "plugins"
PLUGIN_SOURCES = sorted(PLUGINS.glob("*/mmproc_*/*.py"))
SHIPPED = {
    "qwen_vl": ["Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration"],
    "paddleocr_vl": ["PaddleOCRVLForConditionalGeneration"],
}


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


@pytest.mark.parametrize(
    ("plugin", "architecture"),
    [(plugin, arch) for plugin, archs in SHIPPED.items() for arch in archs],
)
def test_shipped_plugins_serve_their_architectures_with_checked_hooks(
    plugin: str, architecture: str
) -> None:
    registry = get_registry()
    reference = registry.resolve(architecture)
    assert reference.plugin == plugin
    hooks = load_model_hooks(reference)  # imports the class and checks it against the specs
    assert hooks.reference.target.startswith(f"mmproc_{plugin}.")
