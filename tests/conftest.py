"""Fixtures shared by the core tests.

Plain helpers shared by several test modules live in ``tests/_qwen_processor.py`` (a Qwen2-VL
processor built without the hub) and ``tests/_tiny_models.py`` (the in-process test model);
``tests`` is on pytest's ``pythonpath``, so ``import _qwen_processor`` works. Fixtures live here.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path

import pytest
from mmproc import hookimpl
from mmproc.registry import Registry


@pytest.fixture(scope="session")
def qwen_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The qwen_vl plugin's demo folder: a tiny Qwen2-VL with the real tokens and settings."""
    from mmproc_qwen_vl.demo import write_qwen2_vl_folder

    return write_qwen2_vl_folder(tmp_path_factory.mktemp("qwen") / "qwen2-vl")


@pytest.fixture(scope="session")
def folder_for(qwen_folder: Path) -> Callable[[str], Path]:
    """``folder_for(architecture)``: a copy of the tiny Qwen2-VL folder whose ``config.json``
    names ``architecture``, so that an in-process test model serves it."""

    def make(architecture: str) -> Path:
        target = qwen_folder.parent / architecture
        if not target.exists():
            shutil.copytree(qwen_folder, target)
            config = json.loads((target / "config.json").read_text())
            config["architectures"] = [architecture]
            (target / "config.json").write_text(json.dumps(config))
        return target

    return make


@pytest.fixture
def ipc_address(tmp_path: Path) -> str:
    """An ``ipc://`` address of the test's own (ipc paths are limited to about 100 bytes;
    pytest's ``tmp_path`` stays well under that)."""
    return f"ipc://{tmp_path}/engine.sock"


@pytest.fixture(scope="session")
def serving() -> Callable[[Mapping[str, type]], Registry]:
    """``serving({architecture: ModelClass, ...})``: a registry (no entry points) whose one
    in-process plugin, ``"tiny"``, serves those test model classes."""

    def make(models: Mapping[str, type]) -> Registry:
        class Registrar:
            @hookimpl
            def mmproc_register_models(self, registry):  # type: ignore[no-untyped-def]
                for architecture, cls in models.items():
                    registry.register(architecture, f"{cls.__module__}:{cls.__qualname__}")

        registry = Registry(entry_points=False)
        registry.add_plugin(Registrar(), name="tiny")
        return registry

    return make
