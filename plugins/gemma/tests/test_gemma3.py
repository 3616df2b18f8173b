"""Gemma 3 through mmproc equals transformers' ``Gemma3Processor`` called directly.

The reference is built without the plugin (``AutoProcessor`` with the backend's image processor)
on the demo folders, which carry ``google/gemma-3-4b-it``'s settings: 896 x 896 bilinear, mean /
std 0.5, 256 soft tokens, pan-and-scan ``null`` (a second folder switches it on). What must match:
prompt ids (the newlines around every image fused with the prompt as transformers' tokenizer fuses
them), each image's pixels with its crops, ranges whose embedding positions are exactly the soft
tokens, ``token_type_ids``; on both backends, with pixels as uint8 (within 1e-6 after the engine's
normalisation) and as floats (equal).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mmproc
import pytest
import torch
from mmproc.testing import call_hf_processor, noise_image

FAMILY = "gemma3"
BOI = "<start_of_image>"
PAN_AND_SCAN = {
    "do_pan_and_scan": True,
    "pan_and_scan_min_crop_size": 256,
    "pan_and_scan_max_num_crops": 4,
    "pan_and_scan_min_ratio_to_activate": 1.2,
}


@pytest.fixture(scope="module")
def pan_and_scan(folders: Any) -> Path:
    """The folder that switches pan-and-scan on (its own settings are the recommended ones)."""
    return folders("gemma3-pan-and-scan")


def test_odd_sizes_and_modes_match_transformers(gemma: Any, combo: Any) -> None:
    processor, reference, norm = combo
    sizes = [(1, 1), (3, 1000), (1000, 3), (899, 301), (1920, 1080), (896, 896), (17, 333)]
    modes = ["RGB", "L", "RGBA", "P+transparency", "CMYK", "LA", "1"]
    prompt = f"<start_of_turn>user\n{BOI}What is it?<end_of_turn>\n<start_of_turn>model\n"
    for seed, ((width, height), mode) in enumerate(zip(sizes, modes, strict=True)):
        image = noise_image(width, height, mode, seed=100 + seed)
        out = processor.process(prompt, {"image": [image]})
        hf = call_hf_processor(reference, prompt, {"image": [image]})
        context = f"{width}x{height} {mode}"
        gemma.assert_like_hf(
            out, hf, "gemma3", reference.tokenizer, normalised=norm, context=context
        )
        assert out.features[0].placeholder.embed_count == 256


# Prompts whose images sit where the newlines around them fuse differently with the text.
SEAMS = [
    f"<start_of_turn>user\n{BOI}Describe.<end_of_turn>",  # "\n" + "\n\n": one "\n\n\n"
    f"{BOI}{BOI}{BOI}",  # "\n\n" + "\n\n" between images: "\n\n\n\n"
    f"{BOI} {BOI}\n\n\n{BOI}",  # a space between; newlines that make a run longer than one token
    f"Look at this:{BOI}\nand this.{BOI}",
    f"<bos><start_of_turn>user\n{BOI}<end_of_turn>\n<start_of_turn>model\n",  # two BOS
]


@pytest.mark.parametrize("prompt", SEAMS)
def test_the_newlines_around_each_image_merge_with_the_prompt_as_transformers_tokenizes_them(
    gemma: Any, folder: Path, processors: Any, references: Any, prompt: str
) -> None:
    images = [noise_image(40 + 30 * i, 60, seed=200 + i) for i in range(prompt.count(BOI))]
    processor, reference = processors[("torchvision", True)], references["torchvision"]
    hf = call_hf_processor(reference, prompt, {"image": images})
    text = processor.process(prompt, {"image": images})
    gemma.assert_like_hf(text, hf, "gemma3", reference.tokenizer, normalised=True)
    ids = processor.process(reference.tokenizer(prompt)["input_ids"], {"image": images})
    assert ids.prompt_token_ids == text.prompt_token_ids
    with mmproc.get_processor(folder, hf_prompt_expansion=True) as expanding:
        expanded = expanding.process(prompt, {"image": images})
    assert expanded.prompt_token_ids == text.prompt_token_ids
    assert [f.placeholder for f in expanded.features] == [f.placeholder for f in text.features]
    # Each range is <start_of_image> ... <end_of_image>: its length never depends on the text
    # around it, though the newlines next to it fused with that text or not.
    start, end = reference.tokenizer.convert_tokens_to_ids([BOI, "<end_of_image>"])
    for feature in text.features:
        r = feature.placeholder
        assert r.length == 258 and text.prompt_token_ids[r.offset] == start
        assert text.prompt_token_ids[r.end - 1] == end


def test_a_prompt_written_with_bos_gets_two_as_transformers_gives_it(processors: Any) -> None:
    processor = processors[("pil", True)]
    tokenizer = processor.hf_processor.tokenizer
    prompt = f"<bos><start_of_turn>user\n{BOI}Hi<end_of_turn>\n"
    out = processor.process(prompt, {"image": [noise_image(50, 50, seed=300)]})
    assert out.prompt_token_ids[:3] == [tokenizer.bos_token_id] * 2 + [
        tokenizer.convert_tokens_to_ids("<start_of_turn>")
    ]


def test_token_type_ids_mark_the_soft_tokens_as_transformers_does(combo: Any) -> None:
    processor, reference, _ = combo
    prompt = f"{BOI} and {BOI}"
    images = [noise_image(64, 48, seed=310), noise_image(48, 64, seed=311)]
    out = processor.process(prompt, {"image": images})
    hf = call_hf_processor(reference, prompt, {"image": images})
    types = out.prompt_outputs["token_type_ids"]
    assert types.tolist() == hf["token_type_ids"][0].tolist()
    assert int(types.sum()) == 512


def test_the_chat_path_gives_what_apply_chat_template_gives(gemma: Any, processors: Any) -> None:
    processor = processors[("torchvision", False)]
    images = [noise_image(90, 60, seed=320), noise_image(60, 90, seed=321)]
    turns: list[dict[str, Any]] = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "And?"}]},
        {"role": "assistant", "content": "A picture."},
        {"role": "user", "content": [{"type": "text", "text": "Now"}, {"type": "image"}]},
    ]
    ours = [dict(turn) for turn in turns]
    theirs = [dict(turn) for turn in turns]
    for index, turn in ((1, 0), (3, 1)):
        parts = list(turns[index]["content"])
        position = [p["type"] for p in parts].index("image")
        url = gemma.png_url(images[turn])
        ours[index]["content"] = [
            *parts[:position],
            {"type": "image_url", "image_url": {"url": url}},
            *parts[position + 1 :],
        ]
        theirs[index]["content"] = [
            *parts[:position],
            {"type": "image", "url": url},
            *parts[position + 1 :],
        ]
    out = processor.process_chat(ours)
    hf = processor.hf_processor.apply_chat_template(
        theirs,
        tokenize=True,
        return_dict=True,
        return_tensors="pt",
        sanitize_control_tokens=True,
        add_generation_prompt=True,
    )
    gemma.assert_like_hf(out, hf, "gemma3", processor.hf_processor.tokenizer, normalised=False)
    # apply_chat_template gives one BOS: the template's.
    assert out.prompt_token_ids[1] != processor.hf_processor.tokenizer.bos_token_id


# --- pan-and-scan ------------------------------------------------------------------------------


def test_transformers_ignores_the_folders_pan_and_scan_and_mmproc_serves_it(
    gemma: Any,
    pan_and_scan: Path,
) -> None:
    image = noise_image(1200, 400, seed=400)
    prompt = f"<start_of_turn>user\n{BOI}Read it.<end_of_turn>"
    for backend in gemma.BACKENDS:
        reference = gemma.build_reference(pan_and_scan, "gemma3", backend)
        assert reference.image_processor.do_pan_and_scan is True  # the folder says so ...
        ignored = call_hf_processor(reference, prompt, {"image": [image]})
        assert ignored["pixel_values"].shape[0] == 1  # ... and transformers makes no crops
        with mmproc.get_processor(pan_and_scan, backend=backend) as processor:
            out = processor.process(prompt, {"image": [image]})
        hf = call_hf_processor(reference, prompt, {"image": [image]}, **PAN_AND_SCAN)
        assert hf["pixel_values"].shape[0] == 4
        gemma.assert_like_hf(
            out, hf, "gemma3", reference.tokenizer, normalised=True, context=backend
        )


def test_an_image_and_its_crops_are_one_item_with_one_range(
    pan_and_scan: Path,
) -> None:
    with mmproc.get_processor(pan_and_scan) as processor:
        tokenizer = processor.hf_processor.tokenizer
        out = processor.process(
            f"<start_of_turn>user\n{BOI}{BOI}Compare.",
            {"image": [noise_image(1200, 400), noise_image(90, 90)]},
        )
    wide, square = out.features
    assert wide.data["pixel_values"].shape == (4, 3, 896, 896)  # the image, then 3 crops
    assert square.data["pixel_values"].shape == (1, 3, 896, 896)
    r = wide.placeholder
    text = tokenizer.decode(out.prompt_token_ids[r.offset : r.end])
    # From the image's <start_of_image> to its last crop's <end_of_image>, the prose between.
    assert text.startswith(BOI) and text.endswith("<end_of_image>")
    assert text.count(BOI) == 4 and "here are some crops to help you see better" in text
    soft = tokenizer.convert_tokens_to_ids("<image_soft_token>")
    embedded = [i for i, e in enumerate(r.embed_mask(), r.offset) if e]
    assert embedded == [i for i in range(r.offset, r.end) if out.prompt_token_ids[i] == soft]
    assert r.embed_count == 4 * 256 and square.placeholder.embed_count == 256
    # The prose before the image ("Here is the original image") is text next to the prompt.
    before = tokenizer.decode(out.prompt_token_ids[: r.offset])
    assert before.endswith("user\nHere is the original image \n\n")


@pytest.mark.parametrize(
    ("size", "crops"),
    [
        ((1199, 1000), 0),  # an aspect ratio under 1.2: no crops
        ((1201, 1000), 2),  # 1.2 and over: at least 2
        ((1000, 1201), 2),  # portrait alike
        ((780, 260), 3),  # 3 crops of 260 x 260
        ((600, 200), 0),  # 2 crops of 300 x 200 would be under 256 pixels: none
        ((3000, 300), 4),  # at most 4
        ((2000, 2000), 0),
    ],
)
def test_crops_start_at_an_aspect_ratio_of_1_2_and_are_never_under_256_pixels(
    gemma: Any, pan_and_scan: Path, size: tuple[int, int], crops: int
) -> None:
    image = noise_image(*size, seed=410)
    reference = gemma.build_reference(pan_and_scan, "gemma3", "pil")
    hf = call_hf_processor(reference, BOI, {"image": [image]}, **PAN_AND_SCAN)
    with mmproc.get_processor(pan_and_scan, backend="pil") as processor:
        out = processor.process(BOI, {"image": [image]})
    assert out.features[0].data["pixel_values"].shape[0] == 1 + crops
    gemma.assert_like_hf(out, hf, "gemma3", reference.tokenizer, normalised=True)


def test_pan_and_scan_asked_per_request_gives_crops_and_its_own_cache_entry(
    gemma: Any, processors: Any, references: Any
) -> None:
    processor, reference = processors[("torchvision", True)], references["torchvision"]
    image = noise_image(900, 300, seed=420)
    prompt = f"<start_of_turn>user\n{BOI}"
    plain = processor.process(prompt, {"image": [image]})
    before = processor.cache.stats()
    cropped = processor.process(prompt, {"image": [image]}, hf_kwargs={"do_pan_and_scan": True})
    assert processor.cache.stats().misses == before.misses + 1  # not the plain one's entry
    hf = call_hf_processor(reference, prompt, {"image": [image]}, do_pan_and_scan=True)
    gemma.assert_like_hf(cropped, hf, "gemma3", reference.tokenizer, normalised=True)
    assert plain.features[0].data["pixel_values"].shape[0] == 1
    assert cropped.features[0].data["pixel_values"].shape[0] == 4
    again = processor.process(prompt, {"image": [image]})
    assert processor.cache.stats().hits == before.hits + 1
    assert torch.equal(
        again.features[0].data["pixel_values"], plain.features[0].data["pixel_values"]
    )
