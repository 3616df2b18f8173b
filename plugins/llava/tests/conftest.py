"""Shared fixtures of the llava plugin's tests: one demo folder per family, written once per
session."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from mmproc_llava.demo import write_llava_folder


@pytest.fixture(scope="session")
def onevision_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The ``llava-onevision`` demo model's folder."""
    return write_llava_folder(tmp_path_factory.mktemp("llava") / "onevision", "onevision")


@pytest.fixture(scope="session")
def next_video_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The ``llava-next-video`` demo model's folder."""
    return write_llava_folder(tmp_path_factory.mktemp("llava") / "next_video", "next_video")


@pytest.fixture(scope="session")
def tokenised_chat() -> Callable[..., Any]:
    """``chat(processor, messages, **kwargs)``: transformers' own rendering of a chat request,
    tokenised with its media (``apply_chat_template(..., tokenize=True, return_dict=True)``)."""

    def chat(processor: Any, messages: list[dict[str, Any]], **kwargs: Any) -> Any:
        return processor.apply_chat_template(
            messages,
            add_generation_prompt=True,
            tokenize=True,
            return_dict=True,
            return_tensors="pt",
            **kwargs,
        )

    return chat
