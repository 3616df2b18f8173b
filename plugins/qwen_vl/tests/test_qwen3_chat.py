"""Chat requests on Qwen3-VL's and Qwen3.5's templates: ``process_chat`` gives what transformers'
``apply_chat_template(..., tokenize=True, return_dict=True, sanitize_control_tokens=True)``
gives, on the processor built without the plugin; Qwen3.5's thinking switch reaches its
template; a video part is timed as the same video given to ``process``.

Qwen3.5's template walks each message's content parts inside a macro (``render_content``), as
the hub's does. The core's ``mmproc.chat.template.content_format`` looks for a loop over
``message.content`` itself, takes the template for one that prints strings, and joins the parts
with new lines: those tests are expected to fail until the core follows content into macros.
"""

from __future__ import annotations

import base64
import io
import re
from typing import Any

import pytest
import torch
from mmproc.testing import assert_matches_hf, noise_image
from mmproc.testing.identity import GRID_FIELDS
from mmproc.testing.samples import encode_video, numbered_frames
from mmproc_qwen_vl.demo import QWEN3_VARIANTS


def image_url(seed: int, size: tuple[int, int]) -> str:
    buffer = io.BytesIO()
    noise_image(*size, seed=seed).save(buffer, "PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def conversation() -> list[dict[str, Any]]:
    """A system turn, two user turns with pictures, and an answer that thought first."""
    return [
        {"role": "system", "content": "You compare pictures."},
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": image_url(1, (90, 60))}},
                {"type": "text", "text": "and"},
                {"type": "image_url", "image_url": {"url": image_url(2, (300, 20))}},
            ],
        },
        {"role": "assistant", "content": "<think>\nTwo of them.\n</think>\n\nTwo pictures."},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "A third:"},
                {"type": "image_url", "image_url": {"url": image_url(3, (64, 640))}},
            ],
        },
    ]


def as_transformers(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The same messages in transformers' form: each image_url part as an image with a url."""
    return [
        {
            **message,
            "content": message["content"]
            if isinstance(message["content"], str)
            else [
                {"type": "image", "url": part["image_url"]["url"]}
                if part["type"] == "image_url"
                else part
                for part in message["content"]
            ],
        }
        for message in messages
    ]


def assert_chat_like_transformers(processor: Any, reference: Any, **kwargs: Any) -> Any:
    out = processor.process_chat(conversation(), **kwargs)
    hf = reference.apply_chat_template(
        as_transformers(conversation()),
        tokenize=True,
        return_dict=True,
        return_tensors="pt",
        sanitize_control_tokens=True,
        add_generation_prompt=True,
        **kwargs.get("chat_template_kwargs", {}),
    )
    pad = reference.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert_matches_hf(out, hf, fields=GRID_FIELDS, placeholder_token_ids={"image": pad})
    assert [f.item_index for f in out.features] == [0, 1, 2]
    return out


@pytest.mark.parametrize("variant", tuple(QWEN3_VARIANTS))
def test_a_chat_gives_what_transformers_chat_template_gives(
    variant: str, qwen3_processor: Any, qwen3_reference: Any
) -> None:
    processor = qwen3_processor(variant, device_normalize=False)
    out = assert_chat_like_transformers(processor, qwen3_reference(variant))
    text = processor.hf_processor.tokenizer.decode(out.prompt_token_ids)
    if variant.startswith("qwen3_5"):
        # The thinking template: the earlier answer's reasoning is dropped, a new one opens.
        assert "Two of them" not in text and text.endswith("<|im_start|>assistant\n<think>\n")
    else:
        assert "<think>\nTwo of them.\n</think>" in text
        assert text.endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("variant", ("qwen3_5", "qwen3_5_moe"))
def test_qwen3_5_thinking_can_be_switched_off_through_the_template_arguments(
    variant: str, qwen3_processor: Any, qwen3_reference: Any
) -> None:
    processor = qwen3_processor(variant, device_normalize=False)
    out = assert_chat_like_transformers(
        processor, qwen3_reference(variant), chat_template_kwargs={"enable_thinking": False}
    )
    text = processor.hf_processor.tokenizer.decode(out.prompt_token_ids)
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


@pytest.mark.parametrize("variant", ("qwen3_vl", "qwen3_5"))
def test_a_video_part_is_timed_as_the_same_video_given_to_process(
    variant: str, qwen3_processor: Any, tmp_path: Any
) -> None:
    processor = qwen3_processor(variant)
    clip = tmp_path / "clip.mp4"
    clip.write_bytes(encode_video(numbered_frames(50), fps=20))
    messages = [
        {
            "role": "user",
            "content": [{"type": "video", "path": str(clip)}, {"type": "text", "text": "Why?"}],
        }
    ]
    out = processor.process_chat(messages)
    rendered = processor.hf_processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "Why?"}]}],
        add_generation_prompt=True,
        tokenize=False,
    )
    direct = processor.process(rendered, {"video": [str(clip)]})
    assert out.prompt_token_ids == direct.prompt_token_ids
    assert out.features[0].placeholder == direct.features[0].placeholder
    assert torch.equal(
        out.prompt_outputs["mm_token_type_ids"], direct.prompt_outputs["mm_token_type_ids"]
    )
    # 2.5 s at 20 fps sampled at 2 fps: 4 frames, at 0, 0.625, 1.25 and 1.875 s (frames 0, 12,
    # 25, 37): pairs at (0 + 0.6) / 2 and (1.25 + 1.85) / 2 s.
    text = processor.hf_processor.tokenizer.decode(out.prompt_token_ids)
    assert re.findall(r"<[\d.]+ seconds>", text) == ["<0.3 seconds>", "<1.6 seconds>"]
