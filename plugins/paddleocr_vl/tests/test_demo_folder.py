"""The paddleocr_vl demo folder loads with transformers' Auto classes, offline, like the hub's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from mmproc_paddleocr_vl.demo import PADDLEOCR_VL_SPECIAL_TOKENS, write_paddleocr_vl_folder
from PIL import Image
from transformers import AutoConfig, AutoProcessor, AutoTokenizer


def image(width: int = 90, height: int = 60) -> Image.Image:
    rng = np.random.default_rng(width * 1000 + height)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def load(folder: Path, **kwargs: Any) -> Any:
    return AutoProcessor.from_pretrained(folder, local_files_only=True, **kwargs)


@pytest.fixture(scope="module", params=["hub", "save_pretrained"])
def paddle(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_paddleocr_vl_folder(
        tmp_path_factory.mktemp(f"paddle-{request.param}"), layout=request.param
    )


@pytest.mark.parametrize("backend", [None, "pil"])
def test_paddleocr_vl_folder_loads_and_expands_the_placeholder(
    paddle: Path, backend: str | None
) -> None:
    processor = load(paddle, **({} if backend is None else {"backend": backend}))
    assert type(processor).__name__ == "PaddleOCRVLProcessor"
    expected_ip = (
        "PaddleOCRVLImageProcessorPil" if backend == "pil" else "PaddleOCRVLImageProcessor"
    )
    assert type(processor.image_processor).__name__ == expected_ip
    ip = processor.image_processor
    assert (ip.patch_size, ip.merge_size, ip.temporal_patch_size) == (14, 2, 1)
    assert (ip.size["shortest_edge"], ip.size["longest_edge"]) == (147384, 2822400)
    assert list(ip.image_mean) == [0.5] * 3 and list(ip.image_std) == [0.5] * 3
    assert int(ip.resample) == 3

    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "OCR:"}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|begin_of_sentence|>User: <|IMAGE_START|><|IMAGE_PLACEHOLDER|><|IMAGE_END|>OCR:\n"
        "Assistant:\n"
    )
    out = processor(text=[text], images=[image(90, 60)])
    grid = np.asarray(out["image_grid_thw"])
    # 90x60 is grown to the 147384-pixel minimum: 476 x 336 pixels, 34 x 24 patches
    assert grid.tolist() == [[1, 24, 34]]
    assert np.asarray(out["pixel_values"]).shape == (24 * 34, 3, 14, 14)
    config = AutoConfig.from_pretrained(paddle, local_files_only=True)
    assert processor.image_token == "<|IMAGE_PLACEHOLDER|>"
    assert processor.image_token_id == config.image_token_id
    ids = list(out["input_ids"][0])
    assert ids.count(config.image_token_id) == 24 * 34 // 4
    assert ids.count(config.vision_start_token_id) == 1
    assert ids.count(config.vision_end_token_id) == 1


def test_paddleocr_vl_tokenizer_keeps_the_special_tokens_whole(paddle: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(paddle, local_files_only=True)
    for token in PADDLEOCR_VL_SPECIAL_TOKENS:
        token_id = tokenizer.convert_tokens_to_ids(token)
        assert tokenizer(f"x{token}y", add_special_tokens=False).input_ids.count(token_id) == 1
    assert tokenizer.image_token == "<|IMAGE_PLACEHOLDER|>"
    assert tokenizer.cls_token == "<|begin_of_sentence|>"
    assert tokenizer.eos_token == "</s>" and tokenizer.pad_token == "<unk>"
