"""The demo folders: the converted one is a folder transformers' Auto classes read as ERNIE-4.5-VL,
offline; both chat templates write the model's chat format, and a rendered conversation with a
picture and a video runs through mmproc."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mmproc
import pytest
from mmproc.testing import noise_image
from transformers import AutoConfig, AutoProcessor

CONVERSATION = [
    {"role": "system", "content": "You are ERNIE."},
    {
        "role": "user",
        "content": [
            {"type": "image"},
            {"type": "video"},
            {"type": "image"},
            {"type": "text", "text": "What changed?"},
        ],
    },
]


def test_transformers_reads_the_converted_demo_as_ernie_4_5_vl(converted_folder: Path) -> None:
    config = AutoConfig.from_pretrained(converted_folder, local_files_only=True)
    processor = AutoProcessor.from_pretrained(converted_folder, local_files_only=True)
    assert type(config).__name__ == "Ernie4_5_VLMoeConfig"
    assert type(processor).__name__ == "Ernie4_5_VLMoeProcessor"
    tokenizer = processor.tokenizer
    for name in ("image", "image_start", "image_end", "video", "video_start", "video_end"):
        assert getattr(config, f"{name}_token_id") == getattr(tokenizer, f"{name}_token_id")
    assert Path(processor.video_processor.font) == converted_folder / "Roboto-Regular.ttf"
    assert config.vision_config.patch_size == 14 and config.vision_config.temporal_merge_size == 2


@pytest.mark.parametrize(
    ("layout", "image", "video"),
    [
        ("converted", "<|IMAGE_PLACEHOLDER|>", "<|VIDEO_PLACEHOLDER|>"),
        ("original", "<|image@placeholder|>", "<|video@placeholder|>"),
    ],
)
def test_the_chat_template_writes_the_models_format_and_the_prompt_runs(
    converted_folder: Path,
    original_folder: Path,
    make_frames: Any,
    layout: str,
    image: str,
    video: str,
) -> None:
    folder = converted_folder if layout == "converted" else original_folder
    with mmproc.get_processor(folder) as processor:
        prompt = processor.hf_processor.apply_chat_template(
            CONVERSATION, add_generation_prompt=True, tokenize=False
        )
        expected = (
            "<|begin_of_sentence|>You are ERNIE.\n"
            f"User: Picture 1:<|IMAGE_START|>{image}<|IMAGE_END|>"
            f"Video 1:<|VIDEO_START|>{video}<|VIDEO_END|>"
            f"Picture 2:<|IMAGE_START|>{image}<|IMAGE_END|>What changed?\n"
            "Assistant: "
        )
        thinking_off = "<think>\n\n</think>\n\n" if layout == "converted" else ""
        assert prompt == expected + thinking_off
        mm_data = {
            "image": [noise_image(90, 60, seed=1), noise_image(60, 90, seed=2)],
            "video": [make_frames(2, 64, 48)],
        }
        out = processor.process(prompt, mm_data)
    assert [f.modality for f in out.features] == ["image", "video", "image"]
