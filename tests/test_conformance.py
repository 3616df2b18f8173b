"""The conformance check plugin authors run: it passes on identity and fails on each difference."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from mmproc.fields import BatchedField, FlatField
from mmproc.norm_spec import ChannelLayout, NormSpec
from mmproc.processor import MultiModalFeature, ProcessedInputs
from mmproc.prompt_update import PlaceholderRange
from mmproc.testing.conformance import assert_matches_hf, token_runs

PAD = 7
FIELDS = {"pixel_values": FlatField.from_grid("image", "grid"), "grid": BatchedField("image")}
SPEC = NormSpec(
    mean=(0.5,),
    std=(0.25,),
    rescale=1 / 255,
    layout=ChannelLayout(axis=-1),
    pixel_keys=("pixel_values",),
)


def case(normalised: bool):
    raw = [
        torch.randint(0, 256, (2, 1), dtype=torch.uint8),
        torch.randint(0, 256, (1, 1), dtype=torch.uint8),
    ]
    floats = [(r.float() / 255 - 0.5) / 0.25 for r in raw]
    grids = [torch.tensor([1, 1, 2]), torch.tensor([1, 1, 1])]
    ids = [1, PAD, PAD, 2, PAD, 3]
    features = [
        MultiModalFeature(
            "image",
            i,
            f"h{i}",
            {"pixel_values": raw[i] if normalised else floats[i], "grid": grids[i]},
            PlaceholderRange(*run),
            SPEC if normalised else None,
        )
        for i, run in enumerate(token_runs(ids, PAD))
    ]
    hf = {
        "input_ids": torch.tensor([ids]),
        "pixel_values": torch.cat(floats),
        "grid": torch.stack(grids),
    }
    return ProcessedInputs(ids, features), hf


@pytest.mark.parametrize("normalised", [True, False])
def test_identity_passes(normalised: bool) -> None:
    out, hf = case(normalised)
    assert_matches_hf(
        out, hf, fields=FIELDS, placeholder_token_ids={"image": PAD}, normalised=normalised
    )


def test_each_difference_fails() -> None:
    out, hf = case(True)
    check = dict(fields=FIELDS, placeholder_token_ids={"image": PAD})
    with pytest.raises(AssertionError, match="prompt ids differ"):
        assert_matches_hf(
            dataclasses.replace(out, prompt_token_ids=[9, *out.prompt_token_ids[1:]]), hf, **check
        )
    shifted = [
        dataclasses.replace(out.features[0], placeholder=PlaceholderRange(1, 1)),
        out.features[1],
    ]
    with pytest.raises(AssertionError, match="placeholder ranges"):
        assert_matches_hf(dataclasses.replace(out, features=shifted), hf, **check)
    off = dict(hf, pixel_values=hf["pixel_values"] + 1e-3)
    with pytest.raises(AssertionError, match="after FusedInputNorm"):
        assert_matches_hf(out, off, **check)
    float_out, _ = case(False)
    with pytest.raises(AssertionError, match="norm spec missing"):
        assert_matches_hf(float_out, hf, normalised=True, **check)
    assert_matches_hf(
        out, dict(hf, extra=torch.zeros(1)), text_keys={"input_ids", "extra"}, **check
    )
    with pytest.raises(AssertionError, match="has no field spec"):
        assert_matches_hf(out, dict(hf, extra=torch.zeros(1)), **check)


def test_prompt_outputs_must_equal_the_ones_hf_returns() -> None:
    out, hf = case(True)
    check = dict(fields=FIELDS, placeholder_token_ids={"image": PAD})
    types = torch.tensor([0, 1, 1, 0, 1, 0])
    marked = dataclasses.replace(out, prompt_outputs={"mm_token_type_ids": types, "mask": types})
    assert_matches_hf(marked, dict(hf, mm_token_type_ids=types[None], mask=types[None]), **check)
    assert_matches_hf(marked, hf, **check)  # outputs HF does not return are the plugin's own
    with pytest.raises(AssertionError, match="prompt output 'mask' differs"):
        assert_matches_hf(marked, dict(hf, mask=torch.zeros(1, 6, dtype=torch.long)), **check)
