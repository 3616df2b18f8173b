"""The public API: what ``mmproc`` exports, and that every hook is documented and tested."""

from __future__ import annotations

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


@pytest.mark.parametrize("hook", MODEL_HOOK_NAMES)
def test_every_model_hook_is_exercised_by_some_test(hook: str) -> None:
    sources = [p.read_text() for p in (ROOT / "tests").glob("test_*.py")]
    sources += [p.read_text() for p in (ROOT / "plugins").glob("*/tests/test_*.py")]
    assert any(hook in text for text in sources if "def test_" in text), hook
