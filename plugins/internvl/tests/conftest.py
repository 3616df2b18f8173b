"""Shared helpers of the internvl plugin's tests: transformers' outputs laid out as mmproc's
items, and the check that a request equals transformers' ``InternVLProcessor`` called directly."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import mmproc
import pytest
import torch
from mmproc.plugin import BatchedField, FieldSpec, FlatField
from mmproc.testing import assert_matches_hf
from mmproc_internvl.demo import write_internvl3_folder

# How each output joins across items, as the tests state it (not read from the plugin).
FIELDS: Mapping[str, FieldSpec] = {
    "pixel_values": FlatField("image", sizes=lambda outputs: outputs["num_patches"]),
    "num_patches": BatchedField("image"),
    "pixel_values_videos": BatchedField("video"),
}


def as_items(hf: Mapping[str, Any], out: mmproc.ProcessedInputs, context: int) -> dict[str, Any]:
    """transformers' outputs for a request, laid out as mmproc's InternVL items are.

    ``InternVLProcessor`` returns all tiles and frames of a call in one ``pixel_values``, in
    prompt order. It is cut here, in that order, into each image's tiles and each video's
    frames (as many rows as mmproc gives the item: the cut is checked to use every row), and
    each image's tile count is read from its ``<IMG_CONTEXT>`` tokens (id ``context``) in
    transformers' prompt (``image_seq_length``, 256, per tile).
    """
    reference = {key: value for key, value in hf.items() if key != "pixel_values"}
    pixels, ids = hf.get("pixel_values"), torch.as_tensor(hf["input_ids"])[0]
    images: list[torch.Tensor] = []
    counts: list[int] = []
    videos: list[torch.Tensor] = []
    row = 0
    for feature in out.features:  # in prompt order
        key = "pixel_values" if feature.modality == "image" else "pixel_values_videos"
        rows = int(feature.data[key].shape[0])
        assert pixels is not None, "transformers gave no pixel_values"
        part = pixels[row : row + rows]
        row += rows
        if feature.modality == "video":
            videos.append(part)
            continue
        images.append(part)
        span = ids[feature.placeholder.offset : feature.placeholder.end]
        counts.append(int((span == context).sum()) // 256)
    if pixels is not None:
        assert row == len(pixels), f"mmproc's items hold {row} rows, transformers' {len(pixels)}"
    if images:
        reference["pixel_values"] = torch.cat(images)
        reference["num_patches"] = torch.tensor(counts)
    if videos:
        reference["pixel_values_videos"] = torch.stack(videos)
    return reference


@pytest.fixture(scope="session")
def internvl_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo model's folder (hub layout, 12 tiles at most)."""
    return write_internvl3_folder(tmp_path_factory.mktemp("internvl") / "hub")


@pytest.fixture(scope="session")
def like_transformers() -> Callable[..., None]:
    """``check(out, hf, tokenizer, normalised=..., context=...)``: ``out`` equals
    transformers' outputs ``hf`` for the same request (see :func:`as_items`)."""

    def check(
        out: mmproc.ProcessedInputs,
        hf: Mapping[str, Any],
        tokenizer: Any,
        *,
        normalised: bool | None = None,
        bf16: bool = True,
        context: str = "",
    ) -> None:
        token = tokenizer.convert_tokens_to_ids("<IMG_CONTEXT>")
        assert_matches_hf(
            out,
            as_items(hf, out, token),
            fields=FIELDS,
            placeholder_token_ids={"image": token, "video": token},
            normalised=normalised,
            check_bf16=bf16,
            context=context,
        )

    return check
