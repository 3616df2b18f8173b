"""Shared fixtures of the qwen_vl plugin's Qwen3 tests: one demo folder per Qwen3 family, written
once per session, transformers' own processor for each (built without the plugin), and mmproc
processors on them."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import mmproc
import pytest
from mmproc_qwen_vl.demo import write_qwen3_vl_folder


@pytest.fixture(scope="session")
def qwen3_folder(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """``variant`` -> its demo folder (hub layout), written on first use."""
    folders: dict[str, Path] = {}

    def folder(variant: str) -> Path:
        if variant not in folders:
            root = tmp_path_factory.mktemp(variant)
            folders[variant] = write_qwen3_vl_folder(root / "hub", variant=variant)  # type: ignore[arg-type]
        return folders[variant]

    return folder


@pytest.fixture(scope="session")
def qwen3_reference(qwen3_folder: Callable[[str], Path]) -> Callable[[str, str], Any]:
    """``(variant, backend)`` -> transformers' ``AutoProcessor`` on its folder with that image
    backend, built without the plugin: the reference."""
    from transformers import AutoImageProcessor, AutoProcessor

    built: dict[tuple[str, str], Any] = {}

    def reference(variant: str, backend: str = "torchvision") -> Any:
        if (variant, backend) not in built:
            folder = qwen3_folder(variant)
            image_processor = AutoImageProcessor.from_pretrained(
                folder, local_files_only=True, backend=backend
            )
            built[(variant, backend)] = AutoProcessor.from_pretrained(
                folder, local_files_only=True, image_processor=image_processor
            )
        return built[(variant, backend)]

    return reference


@pytest.fixture(scope="module")
def qwen3_processor(
    qwen3_folder: Callable[[str], Path],
) -> Iterator[Callable[..., mmproc.Processor]]:
    """``(variant, **options)`` -> an mmproc processor on the variant's folder, opened once per
    module and option set."""
    opened: dict[tuple[str, tuple[tuple[str, Any], ...]], mmproc.Processor] = {}
    with ExitStack() as stack:

        def processor(variant: str, **options: Any) -> mmproc.Processor:
            key = (variant, tuple(sorted(options.items())))
            if key not in opened:
                opened[key] = stack.enter_context(
                    mmproc.get_processor(qwen3_folder(variant), **options)
                )
            return opened[key]

        yield processor
