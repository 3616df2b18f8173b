"""mmproc.fields: splitting batched processor outputs per item, and joining them back."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from mmproc.errors import FieldSpecError
from mmproc.fields import (
    BatchedField,
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
