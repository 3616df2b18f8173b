"""The sarashina2 plugin: the folder's own settings, the model's ``_preprocess`` contract under
transformers 5 and the pool, its prompt markers, and identity with transformers' Qwen2-VL image
processor configured from the folder."""

from __future__ import annotations

import copy
import json
import shutil
import threading
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mmproc
import pytest
import torch
from mmproc.plugin import ProcessorLoadError
from mmproc.testing import noise_image
from mmproc.testing.probes import links_to_original
from mmproc_sarashina2.demo import PREPROCESSOR, write_demo_folder
from mmproc_sarashina2.loading import MODEL_PREPROCESS_KWARGS
from mmproc_sarashina2.model import IMAGE_PLACEHOLDER
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor

BACKENDS = {"pil": Qwen2VLImageProcessorPil, "torchvision": Qwen2VLImageProcessor}
# (width, height): tiny (grown to min_pixels), thin, the 200:1 limit, odd, large (shrunk to
# max_pixels), exactly on the 28-pixel grid.
SIZES = [(1, 1), (12, 900), (1000, 5), (57, 113), (333, 77), (2500, 1400), (56, 84)]
MODES = ["RGB", "L", "RGBA", "P", "P+transparency", "LA"]
PROMPT = f"<s>{IMAGE_PLACEHOLDER}A chat between a curious human and an artificial intelligence "


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_demo_folder(tmp_path_factory.mktemp("sarashina2") / "demo")


@pytest.fixture(scope="module", params=sorted(BACKENDS))
def backend(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def processor(folder: Path, backend: str) -> Iterator[mmproc.Processor]:
    with mmproc.get_processor(folder, backend=backend, device_normalize=False) as processor:
        yield processor


def reference(backend: str) -> Any:
    """transformers' Qwen2-VL image processor with the folder's settings, built apart."""
    keys = ("min_pixels", "max_pixels", "patch_size", "merge_size", "temporal_patch_size")
    keys += ("image_mean", "image_std", "resample", "rescale_factor")
    return BACKENDS[backend](**{key: PREPROCESSOR[key] for key in keys})


@pytest.mark.parametrize("mode", MODES)
def test_pixels_and_grids_equal_transformers_qwen2_vl_image_processor(
    processor: mmproc.Processor, backend: str, mode: str
) -> None:
    expected = reference(backend)
    for seed, (width, height) in enumerate(SIZES):
        image = noise_image(width, height, mode, seed=seed)
        out = processor.process(PROMPT, {"image": [image]})
        want = expected(images=[image], return_tensors="pt")
        (feature,) = out.features
        where = f"{width}x{height} {mode}"
        assert torch.equal(feature.data["image_grid_thw"], want["image_grid_thw"][0]), where
        assert torch.equal(feature.data["pixel_values"], want["pixel_values"]), where
        # <|file|> expands to prod(grid) / merge_size**2 copies, between the markers
        tokens = int(want["image_grid_thw"].prod()) // 4
        assert feature.placeholder.length == tokens, where
        ids = out.prompt_token_ids
        file_id = processor.hf_processor.image_token_id
        start = feature.placeholder.offset
        assert ids[start : start + tokens] == [file_id] * tokens, where
        tokenizer = processor.hf_processor.tokenizer
        assert tokenizer.convert_ids_to_tokens([ids[start - 1], ids[start + tokens]]) == [
            "<|prefix|>",
            "<|suffix|>",
        ]


# transformers warns that per-call max_pixels is deprecated: the call is what is under test.
@pytest.mark.filterwarnings("ignore:Passing `min_pixels` and `max_pixels`:FutureWarning")
@pytest.mark.parametrize(
    "overrides",
    [
        {"size": {"shortest_edge": 3136, "longest_edge": 28 * 28 * 16}},
        {"max_pixels": 28 * 28 * 16},
        {"patch_size": 16, "merge_size": 4},
        {"temporal_patch_size": 1, "do_pad": True},
    ],
    ids=["size", "max_pixels", "patch_settings", "temporal_and_pad"],
)
def test_per_call_size_and_patch_overrides_are_ignored_as_the_model_ignores_them(
    processor: mmproc.Processor, overrides: dict[str, Any]
) -> None:
    image = noise_image(640, 480, seed=7)
    plain = processor.process(PROMPT, {"image": [image]})
    overridden = processor.process(PROMPT, {"image": [image]}, hf_kwargs=overrides)
    assert overridden.prompt_token_ids == plain.prompt_token_ids
    for key in ("pixel_values", "image_grid_thw"):
        assert torch.equal(overridden.features[0].data[key], plain.features[0].data[key])


def test_the_models_own_switches_still_apply(processor: mmproc.Processor) -> None:
    image = noise_image(200, 100, seed=8)
    raw = processor.process(PROMPT, {"image": [image]}, hf_kwargs={"do_normalize": False})
    plain = processor.process(PROMPT, {"image": [image]})
    raw_pixels, pixels = (out.features[0].data["pixel_values"] for out in (raw, plain))
    assert not torch.equal(raw_pixels, pixels)
    assert float(raw_pixels.min()) >= 0  # rescaled, not normalised


def test_the_prompt_markers_and_chat_template_come_from_the_folder(
    processor: mmproc.Processor,
) -> None:
    hf = processor.hf_processor
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "何?"}]}]
    prompt = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert prompt.startswith(f"<s>{IMAGE_PLACEHOLDER}A chat between")
    assert prompt.endswith("### Human: 何?\n### Assistant:")
    out = processor.process(prompt, {"image": [noise_image(90, 60, seed=9)]})
    assert out.prompt_token_ids[0] == hf.tokenizer.convert_tokens_to_ids("<s>")
    assert out.prompt_token_ids.count(hf.tokenizer.bos_token_id) == 1  # no second, added BOS


def test_ids_come_from_config_and_a_folder_whose_ids_disagree_is_refused(
    folder: Path, tmp_path: Path
) -> None:
    config = json.loads((folder / "config.json").read_text())
    with mmproc.get_processor(folder) as processor:
        assert processor.hf_processor.image_token_id == config["image_token_index"]
    broken = tmp_path / "broken"
    shutil.copytree(folder, broken)
    config["end_image_token_index"] = config["image_token_index"]
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(ProcessorLoadError, match=r"end_image_token_index is \d+, but the folder's"):
        mmproc.get_processor(broken)


def test_the_folders_python_files_are_never_executed(folder: Path, tmp_path: Path) -> None:
    remote = tmp_path / "remote"
    shutil.copytree(folder, remote)
    marker = tmp_path / "executed"
    (remote / "processing_sarashina2_vision.py").write_text(
        f"open({str(marker)!r}, 'w').close()\nfrom transformers.image_utils import VideoInput\n"
    )
    config = json.loads((remote / "config.json").read_text())
    config["auto_map"] = {"AutoProcessor": "processing_sarashina2_vision.Sarashina2VisionProcessor"}
    (remote / "config.json").write_text(json.dumps(config))
    with mmproc.get_processor(remote) as processor:
        assert processor.process(PROMPT, {"image": [noise_image(60, 60, seed=10)]}).features
    assert not marker.exists()


# --- the kwarg filter and the pool -----------------------------------------------------------


def _closure_filter(image_processor: Any) -> Any:
    """The seed's bug: a filter closing over the image processor it was installed on."""
    original = image_processor._preprocess

    def _preprocess(images: Any, **kwargs: Any) -> Any:
        kept = {k: v for k, v in kwargs.items() if k in MODEL_PREPROCESS_KWARGS}
        return original(images, **kept)

    image_processor._preprocess = _preprocess
    return image_processor


def _bindings_seen_by_each_worker(processor: mmproc.Processor) -> list[tuple[bool, list[str]]]:
    """On both worker threads at once: is the thread's clone's ``_preprocess`` bound to the
    clone's own image processor, and what of the original does the clone still reach?"""
    barrier = threading.Barrier(2)
    original = processor.hf_processor

    def inspect(*, processor: Any) -> tuple[bool, list[str]]:
        barrier.wait(timeout=30)  # one task per worker thread
        ip = processor.image_processor
        method = ip.__dict__["_preprocess"]
        bound_to_clone = isinstance(method, types.MethodType) and method.__self__ is ip
        return bound_to_clone, links_to_original(original, processor)

    futures = [processor.pool.submit(inspect) for _ in range(2)]
    return [future.result(timeout=60) for future in futures]


def test_every_workers_filter_is_bound_to_its_own_clone(folder: Path) -> None:
    with mmproc.get_processor(folder, workers=2, warm_up=True) as processor:
        seen = _bindings_seen_by_each_worker(processor)
    assert seen == [(True, []), (True, [])]


def test_a_closure_based_filter_fails_the_same_test(folder: Path) -> None:
    # Clones are made on each worker's first task, from the processor as it is then.
    with mmproc.get_processor(folder, workers=2, warm_up=False) as processor:
        # As the seed's engine did: the filter installed as a closure over the original.
        _closure_filter(processor.hf_processor.image_processor)
        seen = _bindings_seen_by_each_worker(processor)
    for bound_to_clone, links in seen:
        assert not bound_to_clone
        assert any("closure over the original" in link for link in links), links


def test_a_filtered_processor_deep_copies_into_an_independent_one(folder: Path) -> None:
    with mmproc.get_processor(folder, device_normalize=False) as processor:
        original = processor.hf_processor
        clone = copy.deepcopy(original)
        assert clone.image_processor._preprocess.__self__ is clone.image_processor
        image = noise_image(70, 70, seed=11)
        out = clone(text=[PROMPT], images=[image], do_pad=True, size={"longest_edge": 1})
        want = original(text=[PROMPT], images=[image])
        assert torch.equal(out["pixel_values"], want["pixel_values"])


@pytest.mark.parametrize("backend", ["pil", "torchvision"])
def test_an_image_the_model_refuses_is_named_by_its_index_in_the_request(
    folder: Path, backend: str
) -> None:
    # Items 0 and 1 cached, item 2 at 300:1 (transformers refuses over 200): item 2 is named.
    images = [noise_image(90, 60, seed=1), noise_image(60, 90, seed=2), noise_image(600, 2)]
    with mmproc.get_processor(folder, backend=backend) as proc:
        proc.process(IMAGE_PLACEHOLDER * 2, {"image": images[:2]})
        with pytest.raises(mmproc.MediaItemError) as info:
            proc.process(IMAGE_PLACEHOLDER * 3, {"image": images})
    assert (info.value.modality, info.value.index) == ("image", 2)
    assert "aspect ratio" in str(info.value)
