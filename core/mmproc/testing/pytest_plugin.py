"""mmproc's pytest plugin (entry point ``pytest11: mmproc``): fixtures for plugin authors' tests.

Loaded by pytest in every environment where mmproc is installed, so it stays inactive until a
test asks for one of its fixtures, and imports nothing heavy until then:

``mmproc_isolated_registry``
    ``mmproc_isolated_registry("my_model")``: a registry that loads that installed plugin and no
    other (so another installed plugin claiming the same architecture cannot break your tests),
    strict (a plugin that fails to load raises with its error). Pass it as
    ``get_processor(folder, registry=...)``.
``mmproc_demo_folder``
    ``mmproc_demo_folder("demo:my-model")`` (or ``"my-model"``): writes a plugin's demo model
    into a temporary folder and returns the path.

The conformance matrix itself is :class:`mmproc.testing.suite.PluginConformance`: subclass it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

__all__ = ["mmproc_demo_folder", "mmproc_isolated_registry"]


@pytest.fixture
def mmproc_isolated_registry() -> Callable[[str], Any]:
    """``mmproc_isolated_registry(plugin)``: a strict registry holding that plugin alone."""
    from mmproc.testing.suite import isolated_registry

    return isolated_registry


@pytest.fixture
def mmproc_demo_folder(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """``mmproc_demo_folder(name, registry=None)``: a demo model written to a temporary folder."""

    def write(name: str, registry: Any = None) -> Path:
        from mmproc.registry import get_registry

        demo = (registry or get_registry()).demo_model(name.removeprefix("demo:"))
        return demo.write(tmp_path_factory.mktemp("demo") / demo.name)

    return write
