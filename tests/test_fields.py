"""mmproc.fields: splitting batched processor outputs per item, and joining them back."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
import torch
from mmproc.errors import FieldSpecError
from mmproc.fields import (
    BatchedField,
    FieldSpec,
    FlatField,
    PaddedField,
    SharedField,
    join_items,
    split_outputs,
)

GRID = [[1, 2, 2], [1, 4, 2], [2, 2, 2]]  # 4, 8 and 8 patches
VIDEO_GRID = [[2, 2, 4]]  # 16 patches


def _qwen_like() -> dict[str, Any]:
    """Outputs shaped like Qwen2-VL's for 3 images and 1 video (patch dim 6)."""
    return {
        "input_ids": torch.zeros(1, 40, dtype=torch.long),
        "attention_mask": torch.ones(1, 40, dtype=torch.long),
        "pixel_values": torch.arange(20 * 6, dtype=torch.float32).reshape(20, 6),
        "image_grid_thw": torch.tensor(GRID),
        "pixel_values_videos": torch.arange(16 * 6, dtype=torch.float32).reshape(16, 6),
        "video_grid_thw": torch.tensor(VIDEO_GRID),
        "second_per_grid_ts": torch.tensor([1.0]),
    }


FIELDS = {
    "pixel_values": FlatField.from_grid("image", "image_grid_thw"),
    "image_grid_thw": BatchedField("image"),
    "pixel_values_videos": FlatField.from_grid("video", "video_grid_thw"),
    "video_grid_thw": BatchedField("video"),
    "second_per_grid_ts": BatchedField("video"),
}
COUNTS = {"image": 3, "video": 1}


def test_flat_split_by_grid_gives_views() -> None:
    outputs = _qwen_like()
    items = split_outputs(outputs, FIELDS, COUNTS)
    pixel_values = outputs["pixel_values"]
    assert [len(i["pixel_values"]) for i in items["image"]] == [4, 8, 8]
    offset = 0
    for item in items["image"]:
        part = item["pixel_values"]
        assert part.untyped_storage().data_ptr() == pixel_values.untyped_storage().data_ptr()
        assert part.storage_offset() == offset * 6
        assert torch.equal(part, pixel_values[offset : offset + len(part)])
        offset += len(part)
    # Views: writing through the batch shows in the item.
    pixel_values[4, 0] = -1.0
    assert items["image"][1]["pixel_values"][0, 0] == -1.0


def test_batched_rows_drop_the_batch_dim() -> None:
    items = split_outputs(_qwen_like(), FIELDS, COUNTS)
    assert [i["image_grid_thw"].tolist() for i in items["image"]] == GRID
    assert items["video"][0]["video_grid_thw"].tolist() == VIDEO_GRID[0]
    assert items["video"][0]["second_per_grid_ts"].item() == 1.0
    assert set(items["image"][0]) == {"pixel_values", "image_grid_thw"}


def test_shared_field_is_the_same_object_for_every_item() -> None:
    outputs = {"pixel_values": torch.zeros(3, 2), "mean": torch.tensor([0.5, 0.5, 0.5])}
    fields = {"pixel_values": BatchedField("image"), "mean": SharedField("image")}
    items = split_outputs(outputs, fields, {"image": 3})["image"]
    assert all(i["mean"] is outputs["mean"] for i in items)
    assert join_items(items, fields)["mean"] is outputs["mean"]


def test_incomplete_spec_lists_every_missing_key() -> None:
    fields = {k: v for k, v in FIELDS.items() if k not in ("pixel_values", "video_grid_thw")}
    with pytest.raises(FieldSpecError, match="incomplete") as info:
        split_outputs(_qwen_like(), fields, COUNTS)
    message = str(info.value)
    assert "pixel_values, video_grid_thw" in message
    assert "input_ids" not in message.split("(covered")[0]  # text keys are ignored by default


def test_ignore_is_configurable() -> None:
    with pytest.raises(FieldSpecError, match="attention_mask, input_ids"):
        split_outputs(_qwen_like(), FIELDS, COUNTS, ignore=())
    outputs = _qwen_like()
    outputs["extra"] = torch.zeros(1)
    split_outputs(outputs, FIELDS, COUNTS, ignore={"input_ids", "attention_mask", "extra"})


def test_flat_sizes_that_do_not_add_up() -> None:
    outputs = _qwen_like()
    outputs["pixel_values"] = outputs["pixel_values"][:19]
    with pytest.raises(FieldSpecError) as info:
        split_outputs(outputs, FIELDS, COUNTS)
    message = str(info.value)
    for needle in ("'pixel_values'", "image", "[4, 8, 8]", "sum to 20", "19 rows"):
        assert needle in message


def test_batched_rows_that_do_not_match_the_count() -> None:
    with pytest.raises(FieldSpecError, match=r"'image_grid_thw'.*3 rows.*2 image item"):
        split_outputs(_qwen_like(), FIELDS, {"image": 2, "video": 1})


def test_grid_with_wrong_row_count() -> None:
    outputs = _qwen_like()
    fields = dict(FIELDS, image_grid_thw=SharedField("image"))
    outputs["image_grid_thw"] = torch.tensor(GRID[:2])
    with pytest.raises(FieldSpecError, match=r"grid 'image_grid_thw' has 2 rows for 3 image"):
        split_outputs(outputs, fields, COUNTS)


def test_missing_grid_key() -> None:
    outputs = _qwen_like()
    del outputs["image_grid_thw"]
    fields = {k: v for k, v in FIELDS.items() if k != "image_grid_thw"}
    with pytest.raises(FieldSpecError, match="grid key 'image_grid_thw' is not in the outputs"):
        split_outputs(outputs, fields, COUNTS)


def test_grid_divisor() -> None:
    outputs = {"embeds": torch.zeros(5, 2), "grid": torch.tensor([[1, 2, 2], [1, 4, 4]])}
    fields = {
        "embeds": FlatField.from_grid("image", "grid", divisor=4),
        "grid": BatchedField("image"),
    }
    items = split_outputs(outputs, fields, {"image": 2})["image"]
    assert [len(i["embeds"]) for i in items] == [1, 4]
    outputs["grid"] = torch.tensor([[1, 2, 2], [1, 3, 1]])
    with pytest.raises(FieldSpecError, match="not a multiple of the divisor 4"):
        split_outputs(outputs, fields, {"image": 2})


def test_explicit_and_callable_sizes() -> None:
    outputs = {"features": torch.arange(10).reshape(5, 2), "lengths": torch.tensor([2, 3])}
    fixed = {"features": FlatField("audio", sizes=[2, 3]), "lengths": BatchedField("audio")}
    computed = {
        "features": FlatField("audio", sizes=lambda out: out["lengths"].tolist()),
        "lengths": BatchedField("audio"),
    }
    for fields in (fixed, computed):
        items = split_outputs(outputs, fields, {"audio": 2})["audio"]
        assert [i["features"].shape[0] for i in items] == [2, 3]
    with pytest.raises(FieldSpecError, match="2 sizes for 3 audio"):
        split_outputs(outputs, fixed, {"audio": 3})
    with pytest.raises(FieldSpecError, match="negative"):
        bad = dict(fixed, features=FlatField("audio", sizes=[6, -1]))
        split_outputs(outputs, bad, {"audio": 2})


def test_flat_field_needs_exactly_one_size_source() -> None:
    with pytest.raises(FieldSpecError, match="exactly one"):
        FlatField("image")
    with pytest.raises(FieldSpecError, match="exactly one"):
        FlatField("image", sizes=[1], grid_key="grid")
    with pytest.raises(FieldSpecError, match="grid_divisor"):
        FlatField.from_grid("image", "grid", divisor=0)


def test_flat_along_another_dim() -> None:
    outputs = {"mel": torch.zeros(80, 7), "n": torch.tensor([3, 4])}
    fields = {"mel": FlatField("audio", sizes=[3, 4], dim=1), "n": BatchedField("audio")}
    items = split_outputs(outputs, fields, {"audio": 2})["audio"]
    assert [tuple(i["mel"].shape) for i in items] == [(80, 3), (80, 4)]
    assert join_items(items, fields)["mel"].shape == (80, 7)


def test_numpy_values_split_as_views() -> None:
    outputs = {"pv": np.arange(40.0).reshape(20, 2), "grid": np.array(GRID)}
    fields = {"pv": FlatField.from_grid("image", "grid"), "grid": BatchedField("image")}
    items = split_outputs(outputs, fields, {"image": 3})["image"]
    assert [len(i["pv"]) for i in items] == [4, 8, 8]
    assert all(np.shares_memory(i["pv"], outputs["pv"]) for i in items)
    joined = join_items(items, fields)
    assert np.array_equal(joined["pv"], outputs["pv"])
    assert np.array_equal(joined["grid"], outputs["grid"])


def test_list_values() -> None:
    outputs = {"tokens": ["a", "b", "c"], "crops": [1, 2, 3, 4, 5]}
    fields = {"tokens": BatchedField("image"), "crops": FlatField("image", sizes=[1, 2, 2])}
    items = split_outputs(outputs, fields, {"image": 3})["image"]
    assert [i["crops"] for i in items] == [[1], [2, 3], [4, 5]]
    assert join_items(items, fields) == outputs


def test_unsplittable_value() -> None:
    with pytest.raises(FieldSpecError, match="cannot split a int"):
        split_outputs({"x": 3}, {"x": BatchedField("image")}, {"image": 1})
    with pytest.raises(FieldSpecError, match="0-d"):
        split_outputs({"x": torch.tensor(3)}, {"x": BatchedField("image")}, {"image": 1})


def test_modality_without_items() -> None:
    outputs = _qwen_like()
    for key in ("pixel_values_videos", "video_grid_thw", "second_per_grid_ts"):
        del outputs[key]
    items = split_outputs(outputs, FIELDS, {"image": 3})
    assert list(items) == ["image"]
    items = split_outputs(outputs, FIELDS, {"image": 3, "video": 0})
    assert items["video"] == []
    # A key with rows for a modality that has no items does not fit.
    with pytest.raises(FieldSpecError, match="for 0 video item"):
        split_outputs(_qwen_like(), FIELDS, {"image": 3})


def test_join_inverts_split() -> None:
    outputs = _qwen_like()
    items = split_outputs(outputs, FIELDS, COUNTS)
    for modality in ("image", "video"):
        joined = join_items(items[modality], FIELDS)
        expected = {k: v for k, v in outputs.items() if k in FIELDS}
        expected = {k: v for k, v in expected.items() if FIELDS[k].modality == modality}
        assert joined.keys() == expected.keys()
        for key, value in expected.items():
            assert torch.equal(joined[key], value), key


def test_join_items_from_different_batches() -> None:
    """What the pipeline does with cache hits: items from separate calls batch together."""
    first = split_outputs(_qwen_like(), FIELDS, COUNTS)["image"]
    second = split_outputs(_qwen_like(), FIELDS, COUNTS)["image"]
    joined = join_items([second[2], first[0]], FIELDS)
    assert joined["image_grid_thw"].tolist() == [GRID[2], GRID[0]]
    assert joined["pixel_values"].shape == (12, 6)
    assert join_items([], FIELDS) == {}


def test_join_rejects_mismatched_or_unknown_keys() -> None:
    items = split_outputs(_qwen_like(), FIELDS, COUNTS)
    with pytest.raises(FieldSpecError, match="item 1 has keys"):
        join_items([items["image"][0], items["video"][0]], FIELDS)
    with pytest.raises(FieldSpecError, match="no field for item key"):
        join_items([{"mystery": torch.zeros(1)}], FIELDS)


def test_real_qwen2_vl_outputs_split_like_single_item_calls() -> None:
    """Per-item slices of a batched HF call equal what the processor gives for each item alone."""
    import transformers
    from mmproc.inputs import parse_mm_data

    rng = np.random.default_rng(0)
    images = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in [(100, 120), (60, 200)]]
    video = rng.integers(0, 256, (4, 56, 84, 3), dtype=np.uint8)
    parsed = parse_mm_data({"image": images, "video": video})
    image_processor = transformers.Qwen2VLImageProcessor()
    video_processor = transformers.Qwen2VLVideoProcessor(cap_pixels_per_frame=False)
    outputs = {
        **image_processor(images=parsed["image"], return_tensors="pt"),
        **video_processor(videos=[v.frames for v in parsed["video"]], return_tensors="pt"),
    }
    items = split_outputs(outputs, FIELDS, {"image": 2, "video": 1})
    for image, item in zip(parsed["image"], items["image"], strict=True):
        alone = image_processor(images=[image], return_tensors="pt")
        assert torch.equal(item["pixel_values"], alone["pixel_values"])
        assert torch.equal(item["image_grid_thw"], alone["image_grid_thw"][0])
    assert items["video"][0]["pixel_values_videos"].shape[0] == outputs["video_grid_thw"].prod()


# --- padded batches -----------------------------------------------------------------------------


def test_padded_rows_are_cut_to_their_own_length_and_join_pads_them_back() -> None:
    values = torch.tensor([[1.0, 2.0, 3.0, 0.0], [4.0, 5.0, 0.0, 0.0], [6.0, 7.0, 8.0, 9.0]])
    outputs = {"input_values": values, "audio_length": torch.tensor([3, 2, 4])}
    fields = {
        "input_values": PaddedField("audio", "audio_length"),
        "audio_length": BatchedField("audio"),
    }
    items = split_outputs(outputs, fields, {"audio": 3})["audio"]
    assert [item["input_values"].tolist() for item in items] == [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    assert items[1]["input_values"].data_ptr() == values[1].data_ptr()  # a view
    assert torch.equal(join_items(items, fields)["input_values"], values)
    # An item computed with shorter company joins a longer batch: padded to the new longest.
    rejoined = join_items([items[1], items[0]], fields)["input_values"]
    assert rejoined.tolist() == [[4, 5, 0], [1, 2, 3]]
    arrays = [np.ones(2, np.float32), np.ones(4, np.float32)]
    assert PaddedField("audio", "n").join("x", arrays).tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]


def test_padded_lengths_that_do_not_fit_name_the_key() -> None:
    field = PaddedField("audio", "audio_length")
    values = torch.zeros(2, 4)
    with pytest.raises(FieldSpecError, match=r"lengths \[3, 5\] from 'audio_length' do not fit"):
        field.split("input_values", values, 2, {"audio_length": torch.tensor([3, 5])})
    with pytest.raises(FieldSpecError, match="length key 'audio_length' is not in the outputs"):
        field.split("input_values", values, 2, {})


def tiles_per_image(outputs: dict[str, Any]) -> list[int]:
    """LLaVA-OneVision-like: one tile per 2x2 cell of the image, plus the base image."""
    return [1 + (h // 2) * (w // 2) for h, w in outputs["image_sizes"].tolist()]


def padded_tiles() -> dict[str, Any]:
    """Three images' tiles (3 channels, 2x2 pixels), padded to the batch's 5 tiles."""
    counts = [2, 5, 1]
    pixel_values = torch.zeros(3, 5, 3, 2, 2)
    for i, n in enumerate(counts):
        pixel_values[i, :n] = torch.arange(n * 12, dtype=torch.float32).reshape(n, 3, 2, 2) + i
    return {"pixel_values": pixel_values, "image_sizes": torch.tensor([[2, 2], [4, 4], [1, 1]])}


def test_padded_tiles_take_their_lengths_from_a_callable_of_the_outputs() -> None:
    outputs = padded_tiles()
    fields = {
        "pixel_values": PaddedField("image", lengths=tiles_per_image, dim=1),
        "image_sizes": BatchedField("image"),
    }
    items = split_outputs(outputs, fields, {"image": 3})["image"]
    assert [tuple(item["pixel_values"].shape) for item in items] == [
        (2, 3, 2, 2),
        (5, 3, 2, 2),
        (1, 3, 2, 2),
    ]
    assert torch.equal(items[1]["pixel_values"], outputs["pixel_values"][1])
    assert torch.equal(join_items(items, fields)["pixel_values"], outputs["pixel_values"])
    # A sequence of lengths works the same, and no output has to hold them.
    listed = PaddedField("image", lengths=[2, 5, 1], dim=1)
    parts = listed.split("pixel_values", outputs["pixel_values"], 3, outputs)
    assert [len(part) for part in parts] == [2, 5, 1]


def test_a_padded_field_needs_exactly_one_of_length_key_and_lengths() -> None:
    with pytest.raises(FieldSpecError, match=r"PaddedField\('image'\) needs exactly one of"):
        PaddedField("image")
    with pytest.raises(FieldSpecError, match=r"PaddedField\('image'\) needs exactly one of"):
        PaddedField("image", "image_sizes", lengths=[1])


def test_padded_lengths_from_a_callable_that_do_not_fit_name_the_key() -> None:
    field = PaddedField("image", lengths=lambda outputs: [6, 1], dim=1)
    with pytest.raises(FieldSpecError, match=r"'pixel_values' \(padded, image\): lengths \[6, 1\]"):
        field.split("pixel_values", torch.zeros(2, 5, 3), 2, {})


@pytest.mark.parametrize(("positive", "negative"), [(1, -2), (2, -1)])
def test_positive_and_negative_padded_dims_count_the_batched_value_and_agree(
    positive: int, negative: int
) -> None:
    values = torch.arange(2 * 5 * 5, dtype=torch.float32).reshape(2, 5, 5)
    outputs = {"n": torch.tensor([2, 5])}
    want = [(2, 5), (5, 5)] if positive == 1 else [(5, 2), (5, 5)]
    for dim in (positive, negative):
        field = PaddedField("audio", "n", dim=dim)
        parts = field.split("x", values, 2, outputs)
        assert [tuple(part.shape) for part in parts] == want, dim
        rejoined = field.join("x", parts)
        assert rejoined.shape == values.shape, dim
        keep = torch.arange(5)[None, :] < torch.tensor([2, 5])[:, None]  # (2, 5): unpadded
        mask = keep[:, :, None] if positive == 1 else keep[:, None, :]
        assert torch.equal(rejoined, values * mask), dim
        arrays = field.join("x", [part.numpy() for part in parts])
        assert np.array_equal(arrays, rejoined.numpy()), dim


def test_the_issue_s_shapes_for_dim_1() -> None:
    values = torch.zeros(2, 5, 3)
    parts = PaddedField("audio", "n", dim=1).split("x", values, 2, {"n": [2, 5]})
    assert [tuple(part.shape) for part in parts] == [(2, 3), (5, 3)]


def test_a_padded_dim_naming_the_batch_dimension_is_refused() -> None:
    with pytest.raises(FieldSpecError, match="dim 0 is the batch"):
        PaddedField("audio", "n", dim=0)
    with pytest.raises(FieldSpecError, match=r"dim -3 of a 3-d value is the batch"):
        PaddedField("audio", "n", dim=-3).split("x", torch.zeros(2, 5, 3), 2, {"n": [1, 1]})
    with pytest.raises(FieldSpecError, match=r"dim 3 is out of range for a 3-d value"):
        PaddedField("audio", "n", dim=3).split("x", torch.zeros(2, 5, 3), 2, {"n": [1, 1]})


@dataclasses.dataclass(frozen=True)
class EveryOtherRow(FieldSpec):
    """A field of one's own: items interleaved row by row (item i has rows i, i + N, ...)."""

    modality: str

    def split(self, key: str, value: Any, count: int, outputs: Any) -> list[Any]:
        return [value[i::count] for i in range(count)] if count else []

    def join(self, key: str, values: Any) -> Any:
        return torch.stack(list(values), dim=1).reshape(-1, *values[0].shape[1:])


def test_a_field_of_ones_own_that_keeps_the_contract_splits_and_joins_like_the_built_in_ones() -> (
    None
):
    value = torch.arange(12).reshape(6, 2)  # 3 items, 2 rows each, interleaved
    fields = {"x": EveryOtherRow("image")}
    items = split_outputs({"x": value}, fields, {"image": 3})["image"]
    assert [item["x"][:, 0].tolist() for item in items] == [[0, 6], [2, 8], [4, 10]]
    assert torch.equal(join_items(items, fields)["x"], value)
    assert split_outputs({}, fields, {"image": 0}) == {"image": []}
