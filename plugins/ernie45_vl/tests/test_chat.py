"""ERNIE-4.5-VL chat requests: images and a video file in the parts, both folder layouts, equal
to the same request given to ``process`` as the text transformers renders from the template."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import mmproc
import pytest
import torch
from mmproc.testing import noise_image


def video_part(path: Path) -> dict[str, Any]:
    url = "data:video/mp4;base64," + base64.b64encode(path.read_bytes()).decode()
    return {"type": "video_url", "video_url": {"url": url}}


def rendered(processor: mmproc.Processor, messages: list[dict[str, Any]]) -> str:
    """The template's text for the same messages, placeholders written by the template."""
    as_hf = [
        {
            **m,
            "content": [{"type": "video"} if p["type"] == "video_url" else p for p in m["content"]],
        }
        for m in messages
    ]
    hf = processor.hf_processor
    return hf.tokenizer.apply_chat_template(
        as_hf, chat_template=hf.chat_template, tokenize=False, add_generation_prompt=True
    )


@pytest.mark.parametrize("layout", ["converted", "original"])
def test_a_chat_with_an_image_and_a_video_file_is_the_rendered_request(
    layout: str, request: pytest.FixtureRequest, clip: Path
) -> None:
    processor: mmproc.Processor = request.getfixturevalue(layout)
    picture = noise_image(120, 90, seed=3)
    messages = [
        {"role": "system", "content": [{"type": "text", "text": "Watch closely."}]},
        {
            "role": "user",
            "content": [
                {"type": "image", "image": picture},
                {"type": "text", "text": "and then"},
                video_part(clip),
            ],
        },
    ]
    chat = processor.process_chat(messages)
    plain = processor.process(
        rendered(processor, messages), {"image": [picture], "video": [clip.read_bytes()]}
    )
    assert chat.prompt_token_ids == plain.prompt_token_ids
    assert [(f.modality, f.placeholder) for f in chat.features] == [
        (f.modality, f.placeholder) for f in plain.features
    ]
    for ours, theirs in zip(chat.features, plain.features):
        for key in ours.data:
            assert torch.equal(torch.as_tensor(ours.data[key]), torch.as_tensor(theirs.data[key]))
    assert chat.prompt_outputs.keys() == plain.prompt_outputs.keys()
