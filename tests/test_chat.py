"""Chat requests: OpenAI-style messages rendered with the model's own template, media from parts.

On the qwen_vl plugin's demo folder (Qwen2-VL's real chat template and special tokens); the
other shipped plugins' chat paths are tested in their own suites.
"""

from __future__ import annotations

import asyncio
import base64
import io
from pathlib import Path
from typing import Any

import mmproc
import numpy as np
import pytest
import torch
from mmproc.errors import ChatRequestError, ChatTemplateError, PromptUpdateError
from mmproc.testing import noise_image
from PIL import Image

IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
STRING_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def processor(qwen_folder: Path):
    with mmproc.get_processor(qwen_folder, device_normalize=False) as proc:
        yield proc


def jpeg_url(seed: int, size: tuple[int, int] = (90, 60)) -> str:
    buffer = io.BytesIO()
    noise_image(*size, seed=seed).save(buffer, "JPEG", quality=90)
    return "data:image/jpeg;base64," + base64.b64encode(buffer.getvalue()).decode()


def image_part(seed: int, size: tuple[int, int] = (90, 60)) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": jpeg_url(seed, size)}}


def text(value: str) -> dict[str, Any]:
    return {"type": "text", "text": value}


def decoded(processor: Any, ids: list[int]) -> str:
    return processor.hf_processor.tokenizer.decode(ids)


def hf_chat(processor: Any, messages: list[dict[str, Any]], **kwargs: Any) -> dict[str, Any]:
    """transformers' own: the processor's apply_chat_template, tokenised, with its media."""
    return processor.hf_processor.apply_chat_template(
        messages,
        tokenize=True,
        return_dict=True,
        return_tensors="pt",
        sanitize_control_tokens=True,
        **kwargs,
    )


def as_hf(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The same messages in transformers' form: each image_url part as {"type": "image"}."""
    out = []
    for message in messages:
        content = message["content"]
        if isinstance(content, list):
            content = [
                {"type": "image", "url": part["image_url"]["url"]}
                if part["type"] == "image_url"
                else part
                for part in content
            ]
        out.append({**message, "content": content})
    return out


def assert_like_transformers(processor: Any, messages: list[dict[str, Any]], **kwargs: Any) -> Any:
    out = processor.process_chat(messages, **kwargs)
    reference = hf_chat(processor, as_hf(messages), **kwargs)
    assert out.prompt_token_ids == reference["input_ids"][0].tolist(), (
        decoded(processor, out.prompt_token_ids),
        decoded(processor, reference["input_ids"][0].tolist()),
    )
    if out.features:
        pixels = torch.cat([f.data["pixel_values"] for f in out.features])
        assert torch.equal(pixels, reference["pixel_values"])
        grids = torch.stack([f.data["image_grid_thw"] for f in out.features])
        assert torch.equal(grids, reference["image_grid_thw"])
    return out


# --- what transformers renders ------------------------------------------------------------------


def test_a_text_only_chat_is_the_models_template_tokenised(processor) -> None:
    messages = [{"role": "user", "content": "Hello there"}]
    out = assert_like_transformers(processor, messages, add_generation_prompt=True)
    assert decoded(processor, out.prompt_token_ids).endswith("<|im_start|>assistant\n")
    assert out.features == []


def test_one_image_gives_what_transformers_gives(processor) -> None:
    messages = [{"role": "user", "content": [image_part(1), text("What is this?")]}]
    out = assert_like_transformers(processor, messages, add_generation_prompt=True)
    [feature] = out.features
    pad = processor.hf_processor.image_token_id
    start, length = feature.placeholder.offset, feature.placeholder.length
    assert out.prompt_token_ids[start : start + length] == [pad] * length


def test_several_images_in_several_turns_are_items_in_message_order(processor) -> None:
    sizes = [(90, 60), (60, 90), (120, 60)]
    messages = [
        {"role": "system", "content": "You compare pictures."},
        {
            "role": "user",
            "content": [image_part(2, sizes[0]), text("and"), image_part(3, sizes[1])],
        },
        {"role": "assistant", "content": "Two pictures."},
        {"role": "user", "content": [text("A third:"), image_part(4, sizes[2])]},
    ]
    out = assert_like_transformers(processor, messages, add_generation_prompt=True)
    assert [f.item_index for f in out.features] == [0, 1, 2]
    grids = [tuple(f.data["image_grid_thw"].tolist()) for f in out.features]
    assert len(set(grids)) == 3  # three sizes, each item its own
    offsets = [f.placeholder.offset for f in out.features]
    assert offsets == sorted(offsets)


def test_the_generation_prompt_and_continuing_the_final_message(processor) -> None:
    messages = [
        {"role": "user", "content": [image_part(5), text("Describe it")]},
        {"role": "assistant", "content": "It shows"},
    ]
    closed = assert_like_transformers(processor, messages, add_generation_prompt=False)
    continued = assert_like_transformers(
        processor, messages, add_generation_prompt=False, continue_final_message=True
    )
    assert decoded(processor, closed.prompt_token_ids).endswith("It shows<|im_end|>\n")
    assert decoded(processor, continued.prompt_token_ids).endswith("It shows")
    with pytest.raises(ChatRequestError, match="cannot both be set"):
        processor.process_chat(messages, continue_final_message=True)


def test_tools_and_template_arguments_reach_the_template(processor) -> None:
    tools = [{"type": "function", "function": {"name": "zoom", "parameters": {}}}]
    messages = [{"role": "user", "content": [image_part(6), text("zoom in")]}]
    out = processor.process_chat(messages, chat_template=TOOLS_TEMPLATE, tools=tools)
    assert '"name": "zoom"' in decoded(processor, out.prompt_token_ids)
    plain = processor.process_chat(messages, chat_template=TOOLS_TEMPLATE)
    assert "Tools:" not in decoded(processor, plain.prompt_token_ids)
    named = processor.process_chat(
        messages,
        chat_template="{{ greeting }}" + TOOLS_TEMPLATE,
        chat_template_kwargs={"greeting": "Hi! "},
    )
    assert decoded(processor, named.prompt_token_ids).startswith("Hi! ")
    with pytest.raises(ChatRequestError, match="may not set add_generation_prompt"):
        processor.process_chat(messages, chat_template_kwargs={"add_generation_prompt": False})


def test_a_string_template_gets_each_placeholder_where_its_part_was(processor) -> None:
    messages = [
        {"role": "user", "content": [text("first"), image_part(7), text("then"), image_part(8)]}
    ]
    out = processor.process_chat(messages, chat_template=STRING_TEMPLATE)
    pad = processor.hf_processor.image_token_id
    collapsed = []
    for token in out.prompt_token_ids:
        if token != pad or not collapsed or collapsed[-1] != pad:
            collapsed.append(token)
    assert decoded(processor, collapsed) == (
        f"<|im_start|>user\nfirst\n{IMAGE}\nthen\n{IMAGE}<|im_end|>\n<|im_start|>assistant\n"
    )
    assert [f.item_index for f in out.features] == [0, 1]


_PARTS_LOOP = "{% for part in PARTS %}{{ part['text'] }}{% endfor %}"


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        ("{% for m in messages %}{{ m['content'] }}{% endfor %}", "string"),
        (
            "{% for m in messages %}" + _PARTS_LOOP.replace("PARTS", "m.content") + "{% endfor %}",
            "openai",
        ),
        (
            "{% for m in messages %}{% set c = m['content'] %}"
            + _PARTS_LOOP.replace("PARTS", "c")
            + "{% endfor %}",
            "openai",
        ),
        # Qwen3.5's shape: the parts are walked inside a macro the content is passed to.
        (
            "{% macro render(content) %}{% if content is string %}{{ content }}{% else %}"
            + _PARTS_LOOP.replace("PARTS", "content")
            + "{% endif %}{% endmacro %}"
            "{% for m in messages %}{{ render(m.content) }}{% endfor %}",
            "openai",
        ),
        # Handed on from one macro to another, by keyword.
        (
            "{% macro inner(items) %}" + _PARTS_LOOP.replace("PARTS", "items") + "{% endmacro %}"
            "{% macro outer(x) %}{{ inner(items=x) }}{% endmacro %}"
            "{% for m in messages %}{{ outer(m['content']) }}{% endfor %}",
            "openai",
        ),
        # A macro that loops over something else it is given is no sign.
        (
            "{% macro render(content, tools) %}{{ content }}"
            + _PARTS_LOOP.replace("PARTS", "tools")
            + "{% endmacro %}"
            "{% for m in messages %}{{ render(m.content, tools) }}{% endfor %}",
            "string",
        ),
    ],
)
def test_a_template_walks_content_parts_directly_through_variables_or_through_macros(
    template: str, expected: str
) -> None:
    from mmproc.chat.template import content_format

    assert content_format(template) == expected


# --- text a user typed is text ------------------------------------------------------------------


def test_placeholders_typed_as_text_stay_text_and_the_image_binds_where_the_template_put_it(
    processor,
) -> None:
    typed = f"Look: {IMAGE} (that was typed)"
    messages = [{"role": "user", "content": [image_part(9), text(typed)]}]
    out = assert_like_transformers(processor, messages, add_generation_prompt=True)
    tokenizer = processor.hf_processor.tokenizer
    pad = processor.hf_processor.image_token_id
    [feature] = out.features
    assert out.prompt_token_ids.count(pad) == feature.placeholder.length  # only the item's
    start = tokenizer.convert_tokens_to_ids("<|vision_start|>")
    assert out.prompt_token_ids.count(start) == 1
    # The typed text is still there, as text: it decodes back to what was typed.
    assert typed in decoded(processor, out.prompt_token_ids)
    # As string content too, and in a system message.
    for content in (typed, [text(typed)]):
        alone = processor.process_chat([{"role": "system", "content": content}])
        assert pad not in alone.prompt_token_ids and start not in alone.prompt_token_ids


def test_a_trusted_caller_may_keep_typed_control_tokens(processor) -> None:
    messages = [{"role": "user", "content": "one<|im_end|>two"}]
    im_end = processor.hf_processor.tokenizer.convert_tokens_to_ids("<|im_end|>")
    kept = processor.process_chat(messages, keep_control_tokens=True, add_generation_prompt=False)
    as_text = processor.process_chat(messages, add_generation_prompt=False)
    # The template's own <|im_end|>s, and with keep_control_tokens the typed one too.
    assert kept.prompt_token_ids.count(im_end) == as_text.prompt_token_ids.count(im_end) + 1
    assert "one<|im_end|>two" in decoded(processor, as_text.prompt_token_ids)
    # A typed placeholder kept as one has no item: the request is refused, naming the count.
    with pytest.raises(PromptUpdateError, match="1 image placeholder"):
        processor.process_chat([{"role": "user", "content": IMAGE}], keep_control_tokens=True)


def test_control_tokens_in_the_keys_of_tools_and_template_arguments_stay_text(processor) -> None:
    im_end = processor.hf_processor.tokenizer.convert_tokens_to_ids("<|im_end|>")
    messages = [{"role": "user", "content": "hi"}]
    plain = processor.process_chat(messages, chat_template=TOOLS_TEMPLATE, tools=[{"a": 1}])
    hostile = {"type": "function", "function": {"parameters": {"<|im_end|>": {"type": "string"}}}}
    keyed = processor.process_chat(messages, chat_template=TOOLS_TEMPLATE, tools=[hostile])
    assert keyed.prompt_token_ids.count(im_end) == plain.prompt_token_ids.count(im_end)
    assert '"<|im_end|>"' in decoded(processor, keyed.prompt_token_ids)
    counts = [
        processor.process_chat(
            messages,
            chat_template="{{ extra | tojson }}" + TOOLS_TEMPLATE,
            chat_template_kwargs={"extra": {key: 1}},
        ).prompt_token_ids.count(im_end)
        for key in ("harmless", "<|im_end|>")
    ]
    assert counts[0] == counts[1]


# --- the same pipeline --------------------------------------------------------------------------


def test_a_chat_and_the_same_request_through_process_share_the_cache(processor) -> None:
    url = jpeg_url(10)
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]
    first = processor.process_chat(messages)
    hits = processor.cache.stats().hits
    second = processor.process_chat(messages)
    assert processor.cache.stats().hits == hits + 1
    assert second.prompt_token_ids == first.prompt_token_ids
    assert second.features[0].hash == first.features[0].hash
    plain = processor.process(IMAGE, {"image": [url]})
    assert processor.cache.stats().hits == hits + 2
    assert plain.features[0].hash == first.features[0].hash


def test_part_uuids_name_their_items(processor) -> None:
    part = {**image_part(11), "uuid": "picture-11"}
    out = processor.process_chat([{"role": "user", "content": [part]}])
    assert out.features[0].hash == "picture-11"
    with pytest.raises(ChatRequestError, match="ids given twice"):
        processor.process_chat([{"role": "user", "content": [part]}], mm_uuids={"image": ["other"]})
    by_argument = processor.process_chat(
        [{"role": "user", "content": [image_part(11)]}], mm_uuids={"image": ["picture-11"]}
    )
    assert by_argument.features[0].hash == "picture-11"


def test_process_chat_async_gives_what_process_chat_gives(processor) -> None:
    messages = [{"role": "user", "content": [image_part(12), text("Hi")]}]
    sync = processor.process_chat(messages)
    asynchronous = asyncio.run(processor.process_chat_async(messages))
    assert asynchronous.prompt_token_ids == sync.prompt_token_ids
    assert torch.equal(
        asynchronous.features[0].data["pixel_values"], sync.features[0].data["pixel_values"]
    )


def test_transformers_forms_of_media_parts_are_taken_too(processor, tmp_path: Path) -> None:
    picture = noise_image(90, 60, seed=13)
    path = tmp_path / "picture.png"
    picture.save(path)
    buffer = io.BytesIO()
    picture.save(buffer, "PNG")
    forms = [
        {"type": "image", "image": picture},
        {"type": "image", "path": str(path)},
        {"type": "image", "url": f"file://{path}"},
        {"type": "image", "base64": base64.b64encode(buffer.getvalue()).decode()},
        {"type": "image_url", "image_url": f"file://{path}"},
        {"image_url": {"url": f"file://{path}", "detail": "low"}},  # no type: told by its key
        {"type": "input_image", "image_url": f"file://{path}"},
    ]
    outs = [processor.process_chat([{"role": "user", "content": [form]}]) for form in forms]
    for out in outs[1:]:
        assert out.prompt_token_ids == outs[0].prompt_token_ids
        assert torch.equal(
            out.features[0].data["pixel_values"], outs[0].features[0].data["pixel_values"]
        )


# --- bad input is a named error -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("messages", "where", "message"),
    [
        ("hello", (None, None), "messages must be a list"),
        ([], (None, None), "messages is empty"),
        ([{"content": "hi"}], (0, None), "it has no role"),
        ([{"role": 3, "content": "hi"}], (0, None), "its role must be a string"),
        ([{"role": "user", "content": 7}], (0, None), "content must be a string or a list"),
        ([{"role": "user", "content": [{"words": "x"}]}], (0, 0), "has no 'type'"),
        (
            [
                {
                    "role": "user",
                    "content": [{**image_part(1), "image_url": {"url": "x", "detail": "max"}}],
                }
            ],
            (0, 0),
            "its detail must be one of auto, low, high, original",
        ),
        (
            [{"role": "user", "content": [text("a"), {"type": "hologram"}]}],
            (0, 1),
            "unknown content part type 'hologram'",
        ),
        ([{"role": "user", "content": [{"type": "text"}]}], (0, 0), "needs a string 'text'"),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
            (0, 0),
            "needs image_url",
        ),
        (
            [
                {"role": "user", "content": "hi"},
                {"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]},
            ],
            (1, 0),
            "needs input_audio",
        ),
        (
            [{"role": "user", "content": [{"type": "audio_url", "audio_url": {"url": "x.wav"}}]}],
            (0, 0),
            "takes no audio items; it takes image",
        ),
        (
            [{"role": "user", "content": [{"type": "image", "base64": "***"}]}],
            (0, 0),
            "not valid base64",
        ),
        (
            [
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": "data:image/png;base64,%%%"}}
                    ],
                }
            ],
            (0, 0),
            "invalid base64",
        ),
        (
            [
                {
                    "role": "user",
                    "content": [
                        text("x"),
                        {
                            "type": "image_url",
                            "image_url": {"url": "data:image/png;base64,aGVsbG8="},
                        },
                    ],
                }
            ],
            (0, 1),
            "cannot identify the image data",
        ),
    ],
)
def test_bad_chat_input_names_the_message_and_part_and_the_processor_keeps_serving(
    processor, messages: Any, where: tuple[int | None, int | None], message: str
) -> None:
    with pytest.raises(ChatRequestError, match=message) as info:
        processor.process_chat(messages)
    assert (info.value.message_index, info.value.part_index) == where
    assert processor.process_chat([{"role": "user", "content": [image_part(14)]}]).features


def test_a_template_that_fails_is_a_chat_template_error(processor) -> None:
    refusing = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        processor.process_chat([{"role": "user", "content": "hi"}], chat_template=refusing)
    with pytest.raises(ChatTemplateError, match="not valid jinja"):
        processor.process_chat([{"role": "user", "content": "hi"}], chat_template="{% for %}")
    with pytest.raises(ChatTemplateError, match="no chat template named 'tool_use'"):
        processor.process_chat([{"role": "user", "content": "hi"}], chat_template="tool_use")


def test_more_items_than_the_per_request_limit_are_refused(qwen_folder: Path) -> None:
    with mmproc.get_processor(qwen_folder, max_items_per_request={"image": 2}) as limited:
        parts = [image_part(15), image_part(16), image_part(17)]
        with pytest.raises(ChatRequestError, match="more than 2 image items") as info:
            limited.process_chat([{"role": "user", "content": parts}])
        assert (info.value.message_index, info.value.part_index) == (0, 2)
        with pytest.raises(mmproc.MediaItemError, match="more than 2 image items"):
            limited.process(IMAGE * 3, {"image": [noise_image(30, 30)] * 3})
        assert limited.process_chat([{"role": "user", "content": parts[:2]}]).features


def test_a_chat_over_the_prompt_character_limit_is_refused_before_tokenising(
    qwen_folder: Path,
) -> None:
    with mmproc.get_processor(qwen_folder, max_prompt_chars=1000) as limited:
        with pytest.raises(ChatRequestError, match=r"characters, over the limit of 1,000"):
            limited.process_chat([{"role": "user", "content": "x " * 2500}])
        assert limited.process_chat([{"role": "user", "content": "x " * 100}]).prompt_token_ids


def test_a_chat_without_a_template_anywhere_is_refused(qwen_folder: Path, tmp_path: Path) -> None:
    import json
    import shutil

    bare = shutil.copytree(qwen_folder, tmp_path / "bare")
    for name in ("chat_template.jinja", "chat_template.json"):
        (bare / name).unlink(missing_ok=True)
    config = json.loads((bare / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (bare / "tokenizer_config.json").write_text(json.dumps(config))
    with mmproc.get_processor(bare) as proc:
        with pytest.raises(ChatTemplateError, match="has no chat template"):
            proc.process_chat([{"role": "user", "content": "hi"}])
        assert proc.process_chat(
            [{"role": "user", "content": "hi"}], chat_template=STRING_TEMPLATE
        ).prompt_token_ids


def test_images_as_arrays_in_parts(processor) -> None:
    array = np.asarray(noise_image(90, 60, seed=18))
    out = processor.process_chat([{"role": "user", "content": [{"type": "image", "image": array}]}])
    ref = processor.process_chat(
        [{"role": "user", "content": [{"type": "image", "image": Image.fromarray(array)}]}]
    )
    assert torch.equal(out.features[0].data["pixel_values"], ref.features[0].data["pixel_values"])


def test_a_part_named_by_its_uuid_alone_is_served_from_the_cache(processor) -> None:
    part = {**image_part(19), "uuid": "picture-19"}
    full = processor.process_chat([{"role": "user", "content": [part, text("Hi")]}])
    by_id = {"type": "image_url", "image_url": None, "uuid": "picture-19"}
    again = processor.process_chat([{"role": "user", "content": [by_id, text("Hi")]}])
    assert again.prompt_token_ids == full.prompt_token_ids
    assert torch.equal(
        again.features[0].data["pixel_values"], full.features[0].data["pixel_values"]
    )
    unknown = {"type": "image_url", "image_url": None, "uuid": "never-seen"}
    with pytest.raises(
        ChatRequestError, match="only its id, and the cache does not hold it"
    ) as info:
        processor.process_chat([{"role": "user", "content": [text("Hi"), unknown]}])
    assert (info.value.message_index, info.value.part_index) == (0, 1)
    with pytest.raises(mmproc.MediaItemError, match="image item 0: no data was sent"):
        processor.process(IMAGE, {"image": [None]})
    assert processor.process(IMAGE, {"image": [None]}, mm_uuids={"image": ["picture-19"]}).features


def test_a_developer_message_is_a_system_message_for_a_template_without_that_role(
    processor,
) -> None:
    developer = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "system", "content": [text("And polite.")]},
    ]
    system = [
        {"role": "system", "content": "Be brief.\n\nAnd polite."},
        {"role": "user", "content": "Hi"},
    ]
    assert (
        processor.process_chat(developer).prompt_token_ids
        == processor.process_chat(system).prompt_token_ids
    )
    knows_it = (
        "{% for m in messages %}{{ m['role'] }}{% if m['role'] == 'developer' %}!{% endif %}"
        "{% endfor %}"
    )
    out = processor.process_chat(developer[:2], chat_template=knows_it, add_generation_prompt=False)
    assert decoded(processor, out.prompt_token_ids) == "developer!user"
