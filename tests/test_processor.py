"""The request pipeline on a real transformers Qwen2-VL processor built from a local folder.

The model is a throwaway in-process plugin defined here (it relies on the core's default
``load_hf_processor`` and ``process_mm_data``), so these tests exercise the core alone; the
qwen_vl plugin has its own identity tests.
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest
import torch
from _tiny_models import IMAGE, TinyQwenImageModel
from mmproc import hookimpl
from mmproc.errors import (
    ConfigurationError,
    MediaItemError,
    PluginSpecError,
    ProcessingError,
    PromptUpdateError,
)
from mmproc.factory import get_processor
from mmproc.fields import FlatField
from mmproc.fused_norm import FusedInputNorm
from mmproc.norm_spec import ChannelLayout, NormSpec
from mmproc.prompt_update import PlaceholderRange
from mmproc.registry import Registry
from PIL import Image

ARCH = "TinyQwenForTest"


class TinyQwen(TinyQwenImageModel):
    """A Qwen2-VL model as a plugin author would write it, on the core's default hooks, counting
    its calls."""

    calls: list[int]
    norm: bool = False

    def __init__(self) -> None:
        self.calls = []
        self.update_calls: list[int] = []
        BUILT.append(self)

    @hookimpl
    def process_mm_data(self, mm_items):
        self.calls.append(len(mm_items.get("image", ())))
        return None  # the core's default runs the HF processor

    @hookimpl
    def get_prompt_updates(self, processor, item_outputs):
        self.update_calls.append(len(item_outputs.get("image", ())))
        return super().get_prompt_updates(processor, item_outputs)

    @hookimpl
    def device_norm_spec(self, processor):
        if not self.norm:
            return None
        return NormSpec.from_image_processor(
            processor.image_processor, layout=ChannelLayout.flat_patches(14, 2)
        )


class NormalisedTinyQwen(TinyQwen):
    norm = True


class BrokenRawTinyQwen(NormalisedTinyQwen):
    """Declares device normalisation but normalises on the CPU anyway (a plugin bug)."""

    @hookimpl
    def process_mm_data(self, prompt, mm_items, processor):
        return processor(text=[prompt], images=list(mm_items["image"]), return_tensors="pt")


class IncompleteFieldsTinyQwen(TinyQwen):
    """Forgets to say how image_grid_thw splits (a plugin bug)."""

    @hookimpl
    def get_mm_fields(self, outputs):
        return {"pixel_values": FlatField.from_grid("image", "image_grid_thw")}


class OptionTinyQwen(TinyQwen):
    """Reads an option of its own, and says so."""

    @hookimpl
    def extra_options(self):
        return ["crop_margin"]


class BadOptionsTinyQwen(TinyQwen):
    """Names its options wrongly (a plugin bug)."""

    @hookimpl
    def extra_options(self):
        return "crop_margin"


class GatedTinyQwen(TinyQwen):
    """Holds every computation at a gate the test opens, and fails on request."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = threading.Event()
        self.gate = threading.Event()
        self.failing = False

    @hookimpl
    def process_mm_data(self, mm_items):
        self.calls.append(len(mm_items.get("image", ())))
        self.entered.set()
        assert self.gate.wait(30), "the test never opened the gate"
        if self.failing:
            raise RuntimeError(f"gated model told to fail (call {len(self.calls)})")
        return None


class NestedTinyQwen(TinyQwen):
    """Calls its own processor from inside a worker, for the item being computed: as ``given``
    to the outer request when set, else as decoded."""

    processor: Any = None
    inner: Any = None
    given: Any = None

    @hookimpl
    def process_mm_data(self, mm_items):
        if NestedTinyQwen.inner is None:
            NestedTinyQwen.inner = "running"
            given = NestedTinyQwen.given
            items = list(mm_items["image"]) if given is None else [given]
            NestedTinyQwen.inner = self.processor.process(IMAGE, {"image": items})
        return None


class UnbatchableTinyQwen(TinyQwen):
    """Cannot batch images of different sizes (as a processor that stacks tiles without padding
    them cannot): a batch of such images fails, each alone passes."""

    @hookimpl
    def process_mm_data(self, mm_items):
        images = list(mm_items.get("image", ()))
        self.calls.append(len(images))
        if len({im.size for im in images}) > 1:
            raise ValueError("stack expects each tensor to be equal size")
        return None


class ThreadRecordingTinyQwen(TinyQwen):
    """Records the thread of every per-request hook call."""

    threads: ClassVar[set[int]] = set()

    @hookimpl
    def process_mm_data(self, mm_items):
        ThreadRecordingTinyQwen.threads.add(threading.get_ident())
        return None

    @hookimpl
    def get_prompt_outputs(self, prompt_token_ids):
        ThreadRecordingTinyQwen.threads.add(threading.get_ident())
        return None


MODELS: dict[str, type] = {}
BUILT: list[TinyQwen] = []  # every model object, in the order processors built them


def model_of(proc: Any) -> Any:
    """The model object whose hooks ``proc`` calls: the last one built of its class."""
    cls = MODELS[proc.ctx.architecture]
    return next(m for m in reversed(BUILT) if type(m) is cls)


MODELS.update(
    {
        ARCH: TinyQwen,
        "NormTinyQwen": NormalisedTinyQwen,
        "BrokenRawTinyQwen": BrokenRawTinyQwen,
        "IncompleteFieldsTinyQwen": IncompleteFieldsTinyQwen,
        "OptionTinyQwen": OptionTinyQwen,
        "BadOptionsTinyQwen": BadOptionsTinyQwen,
        "GatedTinyQwen": GatedTinyQwen,
        "NestedTinyQwen": NestedTinyQwen,
        "ThreadRecordingTinyQwen": ThreadRecordingTinyQwen,
        "UnbatchableTinyQwen": UnbatchableTinyQwen,
    }
)


@pytest.fixture(scope="module")
def registry(serving) -> Registry:
    return serving(MODELS)


@pytest.fixture(scope="module")
def folder(folder_for) -> Path:
    return folder_for(ARCH)


@pytest.fixture(scope="module")
def processor(folder: Path, registry: Registry):
    with get_processor(folder, registry=registry) as proc:
        yield proc


def image(seed: int, size: tuple[int, int] = (60, 90)) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8))


def hf_reference(processor, prompt: str, images: list[Image.Image], **kwargs: Any):
    """Call the transformers processor directly: HF expands the placeholders itself."""
    hf = processor.hf_processor
    if images:
        return hf(text=[prompt], images=images, return_tensors="pt", **kwargs)
    return hf(text=[prompt], return_tensors="pt", **kwargs)


def pad_runs(ids: list[int], pad: int) -> list[PlaceholderRange]:
    """Each maximal run of pad tokens, found independently of mmproc's own matching."""
    runs, i = [], 0
    while i < len(ids):
        if ids[i] == pad:
            j = i
            while j < len(ids) and ids[j] == pad:
                j += 1
            runs.append(PlaceholderRange(i, j - i))
            i = j
        else:
            i += 1
    return runs


def assert_matches_hf(processor, out, prompt: str, images: list[Image.Image]) -> None:
    ref = hf_reference(processor, prompt, images)
    assert out.prompt_token_ids == ref["input_ids"][0].tolist()
    pad = processor.hf_processor.image_token_id
    assert [f.placeholder for f in out.features] == pad_runs(out.prompt_token_ids, pad)
    assert [f.item_index for f in out.features] == list(range(len(images)))
    if images:
        pixels = torch.cat([f.data["pixel_values"] for f in out.features])
        grids = torch.stack([f.data["image_grid_thw"] for f in out.features])
        assert torch.equal(pixels, ref["pixel_values"])
        assert torch.equal(grids, ref["image_grid_thw"])


@pytest.mark.parametrize("seed", range(6))
def test_random_requests_match_calling_hf_directly(processor, seed: int) -> None:
    rng = random.Random(seed)
    pool = [image(100 + i, (rng.randint(20, 120), rng.randint(20, 120))) for i in range(4)]
    for _ in range(3):
        count = rng.randint(0, 3)
        # Repeats give cache hit rates from 0 to 100% across requests.
        images = [rng.choice(pool) for _ in range(count)]
        words = ["describe", "the", "picture", "and", "count", "cats"]
        parts = [IMAGE if i < count else "" for i in range(count)]
        prompt = "<|im_start|>user\n" + " ".join(rng.choice(words) for _ in range(3))
        prompt += "".join(parts) + "<|im_end|>"
        as_tokens = rng.random() < 0.5
        given: Any = prompt
        if as_tokens:
            given = processor.hf_processor.tokenizer(prompt)["input_ids"]
        out = processor.process(given, {"image": images} if images else None)
        assert_matches_hf(processor, out, prompt, images)


@pytest.mark.parametrize("cache_bytes", [0, None])
def test_hf_expansion_path_equals_the_cached_path(folder, registry, cache_bytes) -> None:
    images = [image(1), image(2, (120, 40)), image(1)]
    prompt = f"look {IMAGE} then {IMAGE} and {IMAGE} done"
    with (
        get_processor(
            folder, registry=registry, hf_prompt_expansion=True, cache_bytes=cache_bytes
        ) as hf_path,
        get_processor(folder, registry=registry, cache_bytes=cache_bytes) as cached_path,
    ):
        a = hf_path.process(prompt, {"image": images})
        b = cached_path.process(prompt, {"image": images})
        assert a.prompt_token_ids == b.prompt_token_ids
        assert [f.placeholder for f in a.features] == [f.placeholder for f in b.features]
        assert [f.hash for f in a.features] == [f.hash for f in b.features]
        for fa, fb in zip(a.features, b.features):
            assert fa.data.keys() == fb.data.keys()
            for key in fa.data:
                assert torch.equal(fa.data[key], fb.data[key])
        assert_matches_hf(hf_path, a, prompt, images)


def test_only_missing_items_reach_the_hf_processor_once_each(folder, registry) -> None:
    with get_processor(folder, registry=registry) as proc:
        model = model_of(proc)
        first = proc.process(f"{IMAGE}{IMAGE}", {"image": [image(7), image(7)]})
        # Two equal images in one request: processed once.
        assert model.calls == [1]
        assert first.features[0].hash == first.features[1].hash
        second = proc.process(f"{IMAGE}{IMAGE}", {"image": [image(7), image(8)]})
        assert model.calls == [1, 1]  # only the new image
        assert torch.equal(
            second.features[0].data["pixel_values"], first.features[0].data["pixel_values"]
        )
        proc.process(f"{IMAGE}", {"image": [image(8)]})
        assert model.calls == [1, 1]  # all hits: no HF call at all
        stats = proc.cache.stats()
        assert stats.hits >= 2


def test_cache_key_follows_hf_kwargs(processor) -> None:
    a = processor.process(IMAGE, {"image": [image(9)]})
    b = processor.process(IMAGE, {"image": [image(9)]}, hf_kwargs={"do_normalize": False})
    assert a.features[0].hash != b.features[0].hash
    assert not torch.equal(a.features[0].data["pixel_values"], b.features[0].data["pixel_values"])


def test_placeholder_count_must_match_the_items(processor) -> None:
    with pytest.raises(PromptUpdateError, match="image item 1") as too_few:
        processor.process(f"only one {IMAGE}", {"image": [image(1), image(2)]})
    assert too_few.value.modality == "image"
    with pytest.raises(PromptUpdateError, match="2 image placeholders but the request has 1 image"):
        processor.process(f"{IMAGE} and {IMAGE}", {"image": [image(1)]})


def test_a_bad_item_is_named_and_the_processor_keeps_serving(processor) -> None:
    with pytest.raises(MediaItemError, match="image item 1") as bad:
        processor.process(f"{IMAGE}{IMAGE}", {"image": [image(1), b"not an image at all"]})
    assert bad.value.index == 1
    out = processor.process(IMAGE, {"image": [image(3)]})
    assert_matches_hf(processor, out, IMAGE, [image(3)])


def test_a_failing_processor_call_names_plugin_and_model(processor) -> None:
    with pytest.raises(ProcessingError, match=r"TinyQwenForTest \(plugin 'tiny'"):
        # Settings every item fails with: the error is about the request, not an item.
        processor.process(
            IMAGE * 2, {"image": [image(4), image(5)]}, hf_kwargs={"patch_size": "fourteen"}
        )
    with pytest.raises(ConfigurationError, match="hf_kwargs cannot be part of a cache key"):
        processor.process(IMAGE, {"image": [image(4)]}, hf_kwargs={"odd": object()})


def test_process_async_gives_the_same_result(processor) -> None:
    prompt = f"async {IMAGE}"

    async def main():
        return await asyncio.gather(
            processor.process_async(prompt, {"image": [image(11)]}),
            processor.process_async(prompt, {"image": [image(12)]}),
        )

    first, second = asyncio.run(main())
    assert_matches_hf(processor, first, prompt, [image(11)])
    assert_matches_hf(processor, second, prompt, [image(12)])


def test_concurrent_requests_from_threads(processor) -> None:
    results: dict[int, Any] = {}
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            results[i] = processor.process(f"t{i} {IMAGE}", {"image": [image(200 + i)]})
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for i, out in results.items():
        assert_matches_hf(processor, out, f"t{i} {IMAGE}", [image(200 + i)])


@pytest.mark.parametrize("backend_kwargs", [{}, {"cache_bytes": 0}])
def test_device_normalisation_ships_uint8_that_normalises_to_the_float_path(
    folder, registry, backend_kwargs
) -> None:
    config = json.loads((folder / "config.json").read_text())
    norm_folder = folder.parent / "norm"
    if not norm_folder.exists():
        import shutil

        shutil.copytree(folder, norm_folder)
        config["architectures"] = ["NormTinyQwen"]
        (norm_folder / "config.json").write_text(json.dumps(config))
    prompt = f"{IMAGE} x {IMAGE}"
    images = [image(21, (64, 100)), image(22, (200, 30))]
    with get_processor(norm_folder, registry=registry, **backend_kwargs) as proc:
        for _ in range(2):  # miss, then hit
            out = proc.process(prompt, {"image": images})
            ref = hf_reference(proc, prompt, images)
            assert out.prompt_token_ids == ref["input_ids"][0].tolist()
            assert all(f.norm is not None for f in out.features)
            raw = torch.cat([f.data["pixel_values"] for f in out.features])
            assert raw.dtype == torch.uint8
            normalised = FusedInputNorm(out.features[0].norm, dtype=torch.float32)(raw)
            assert (normalised - ref["pixel_values"]).abs().max() < 1e-6
    with get_processor(norm_folder, registry=registry, device_normalize=False) as proc:
        out = proc.process(prompt, {"image": images})
        assert out.features[0].norm is None
        assert out.features[0].data["pixel_values"].dtype == torch.float32


def test_device_normalize_true_needs_a_plugin_that_supports_it(folder, registry) -> None:
    with pytest.raises(ConfigurationError, match="gives no device normalisation"):
        get_processor(folder, registry=registry, device_normalize=True)


def test_pixels_that_are_not_raw_fall_back_to_the_float_path_with_a_warning(
    folder, registry, caplog
) -> None:
    broken = folder.parent / "broken"
    if not broken.exists():
        import shutil

        shutil.copytree(folder, broken)
        config = json.loads((broken / "config.json").read_text())
        config["architectures"] = ["BrokenRawTinyQwen"]
        (broken / "config.json").write_text(json.dumps(config))
    with caplog.at_level(logging.WARNING, logger="mmproc.processor"):
        with get_processor(broken, registry=registry) as proc:
            out = proc.process(IMAGE, {"image": [image(31)]})
    assert "is not raw pixels" in caplog.text
    assert proc.norm_spec is None
    feature = out.features[0]
    assert feature.norm is None  # nothing left for the engine to do
    ref = hf_reference(proc, IMAGE, [image(31)])
    assert (feature.data["pixel_values"] - ref["pixel_values"]).abs().max() < 1e-6


def test_bad_prompt_is_a_clear_error(processor) -> None:
    with pytest.raises(PromptUpdateError, match="string or a sequence of non-negative token ids"):
        processor.process([1, -2, 3], None)


def test_load_hf_processor_default_needs_a_folder(registry) -> None:
    from mmproc.errors import ProcessorLoadError

    with pytest.raises(ProcessorLoadError, match="needs a local model folder"):
        get_processor(ARCH, registry=registry)


def test_an_item_the_processor_rejects_is_named_by_its_request_index(processor) -> None:
    good, too_wide = image(41), image(42, (10, 2010))  # 201:1, beyond Qwen's 200:1 limit
    processor.process(IMAGE, {"image": [good]})  # cached: the failing batch holds only new items
    with pytest.raises(MediaItemError, match=r"image item 2: .*rejects it.*aspect ratio") as err:
        processor.process(IMAGE * 3, {"image": [good, image(43), too_wide]})
    assert err.value.index == 2
    with pytest.raises(MediaItemError, match=r"^image item 0: .*aspect ratio"):
        processor.process(IMAGE, {"image": [too_wide]})
    calls = len(model_of(processor).calls)
    with pytest.raises(MediaItemError, match=r"^image item 5: "):
        processor.process(
            IMAGE * 8,
            {"image": [image(50 + i) for i in range(5)] + [too_wide, image(60), image(61)]},
        )
    # Finding the culprit costs a few halvings, not one call per item.
    assert len(model_of(processor).calls) - calls <= 6
    out = processor.process(IMAGE, {"image": [image(43)]})
    assert_matches_hf(processor, out, IMAGE, [image(43)])


def test_items_that_fail_only_together_are_processed_apart(folder_for, registry) -> None:
    small, large = image(71, (60, 90)), image(72, (120, 90))
    with get_processor(folder_for("UnbatchableTinyQwen"), registry=registry) as proc:
        together = proc.process(IMAGE * 2, {"image": [small, large]})
        calls = model_of(proc).calls
        assert calls[0] == 2 and calls[-2:] == [1, 1]  # the batch, its halves, then one by one
        proc.cache.clear()
        alone = [proc.process(IMAGE, {"image": [item]}) for item in (small, large)]
    assert [f.placeholder.length for f in together.features] == [
        a.features[0].placeholder.length for a in alone
    ]
    for feature, single in zip(together.features, alone):
        assert torch.equal(feature.data["pixel_values"], single.features[0].data["pixel_values"])
    assert_matches_hf(proc, alone[1], IMAGE, [large])


def test_a_prompt_over_the_prompt_limits_is_refused_before_tokenising(folder, registry) -> None:
    with get_processor(
        folder, registry=registry, max_prompt_chars=50, max_prompt_tokens=20
    ) as proc:
        with pytest.raises(PromptUpdateError, match=r"51 characters.*max_prompt_chars"):
            proc.process("x" * 51)
        with pytest.raises(PromptUpdateError, match=r"21 tokens.*max_prompt_tokens"):
            proc.process([1] * 21)
        with pytest.raises(PromptUpdateError, match=r"tokens.*max_prompt_tokens"):
            proc.process("1234567890" * 3)  # 30 characters, a token a digit
        assert proc.process("hello").prompt_token_ids
    with pytest.raises(ConfigurationError, match="max_prompt_chars"):
        get_processor(folder, registry=registry, max_prompt_chars=0)


def test_a_cached_request_is_answered_while_another_callers_long_prompt_is_tokenised(
    processor,
) -> None:
    cached = image(73)
    processor.process(IMAGE, {"image": [cached]})
    long_prompt = "hello world " * 200_000 + IMAGE  # 2.4M characters: about a second to tokenise
    long_request = threading.Thread(
        target=processor.process, args=(long_prompt, {"image": [cached]})
    )
    long_request.start()
    answered = 0
    while long_request.is_alive():
        processor.process(IMAGE, {"image": [cached]})
        answered += 1
    long_request.join()
    # One tokenizer behind a lock let at most the request that got there first through.
    assert answered >= 3


def test_warm_up_makes_the_clones_before_the_first_request(folder, registry) -> None:
    with get_processor(folder, registry=registry, warm_up=True, workers=2) as proc:
        # one clone per worker, and no probe copy: the warm-up is the probe
        assert proc.pool.clones_made == 2
    with get_processor(folder, registry=registry, warm_up="background", workers=2) as proc:
        proc.process(IMAGE, {"image": [image(70)]})
        proc.process(IMAGE, {"image": [image(71)]})
        assert proc.pool.clones_made == 2
    with get_processor(folder, registry=registry, warm_up=False, workers=2) as proc:
        assert proc.pool.clones_made == 1  # the probe only
    with pytest.raises(ConfigurationError, match="warm_up must be"):
        get_processor(folder, registry=registry, warm_up="later")


def png(seed: int) -> bytes:
    buffer = io.BytesIO()
    image(seed).save(buffer, format="PNG")
    return buffer.getvalue()


def test_many_async_requests_with_encoded_images_never_deadlock(folder, registry) -> None:
    # Each request decodes two images on the IO pool: preparing must not wait inside that pool.
    with get_processor(folder, registry=registry, io_workers=1) as proc:

        async def main():
            jobs = [
                proc.process_async(IMAGE * 2, {"image": [png(i), png(i + 1)]}) for i in range(6)
            ]
            return await asyncio.wait_for(asyncio.gather(*jobs), timeout=60)

        results = asyncio.run(main())
    assert [len(r.features) for r in results] == [2] * 6


def recording_decodes(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """What Pillow does to encoded images from here on, in order: ``"parse"`` for each header
    parsed, ``"decode WxH"`` for each image decoded."""
    from PIL import ImageFile

    events: list[str] = []
    parse, load = Image.open, ImageFile.ImageFile.load

    def parsing(*args: Any, **kwargs: Any) -> Any:
        events.append("parse")
        return parse(*args, **kwargs)

    def loading(opened: ImageFile.ImageFile) -> Any:
        if opened.tile:  # decoded now, not already
            events.append("decode {}x{}".format(*opened.size))
        return load(opened)

    monkeypatch.setattr(Image, "open", parsing)
    monkeypatch.setattr(ImageFile.ImageFile, "load", loading)
    return events


def test_a_hit_on_an_item_given_encoded_never_parses_it(folder, registry, monkeypatch) -> None:
    events = recording_decodes(monkeypatch)
    with get_processor(folder, registry=registry) as proc:
        first = proc.process(IMAGE, {"image": [png(140)]})
        again = proc.process(IMAGE, {"image": [png(140)]})
        assert model_of(proc).calls == [1]
    assert events == ["parse", "decode 90x60"]  # for the miss only
    assert again.features[0].hash == first.features[0].hash
    assert again.prompt_token_ids == first.prompt_token_ids
    assert torch.equal(
        again.features[0].data["pixel_values"], first.features[0].data["pixel_values"]
    )


def test_one_file_as_bytes_a_path_and_a_data_url_is_one_cache_entry(
    folder, registry, tmp_path: Path
) -> None:
    import base64

    data = png(141)
    path = tmp_path / "photo.png"
    path.write_bytes(data)
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    with get_processor(folder, registry=registry) as proc:
        outs = [proc.process(IMAGE, {"image": [form]}) for form in (data, str(path), url, path)]
        assert model_of(proc).calls == [1]
        assert proc.cache.stats().hits == 3
    assert len({out.features[0].hash for out in outs}) == 1


def test_an_encoded_item_is_another_entry_than_its_decoded_image_with_the_same_outputs(
    processor,
) -> None:
    data = png(142)
    encoded = processor.process(IMAGE, {"image": [data]})
    decoded = processor.process(IMAGE, {"image": [Image.open(io.BytesIO(data))]})
    assert encoded.features[0].hash != decoded.features[0].hash
    assert encoded.prompt_token_ids == decoded.prompt_token_ids
    assert torch.equal(
        encoded.features[0].data["pixel_values"], decoded.features[0].data["pixel_values"]
    )
    assert_matches_hf(processor, encoded, IMAGE, [image(142)])


def test_a_request_decodes_each_encoded_item_it_misses_once_and_none_it_hits(
    folder, registry, monkeypatch
) -> None:
    events = recording_decodes(monkeypatch)
    big = image(144, size=(70, 110))
    with get_processor(folder, registry=registry) as proc:
        proc.process(IMAGE, {"image": [png(143)]})
        buffer = io.BytesIO()
        big.save(buffer, format="PNG")
        out = proc.process(IMAGE * 3, {"image": [png(143), buffer.getvalue(), buffer.getvalue()]})
        assert model_of(proc).calls == [1, 1]
    assert events == ["parse", "decode 90x60", "parse", "decode 110x70"]
    assert out.features[1].hash == out.features[2].hash
    assert_matches_hf(proc, out, IMAGE * 3, [image(143), big, big])


def test_a_corrupt_encoded_item_is_named_on_every_request_and_the_processor_keeps_serving(
    processor,
) -> None:
    truncated = png(145)[:300]  # its header reads; its pixels do not
    for _ in range(2):
        with pytest.raises(MediaItemError, match="image item 1: corrupt or truncated PNG"):
            processor.process(IMAGE * 2, {"image": [image(145), truncated]})
    assert processor.process(IMAGE * 2, {"image": [image(145), png(145)]}).features


def test_an_encoded_item_the_cache_answers_adds_nothing_to_the_requests_decoded_size(
    folder, registry
) -> None:
    from mmproc.media import MediaLimits

    one = 90 * 60 * 3  # decoded bytes of each image
    limits = MediaLimits(max_request_decoded_bytes=2 * one)
    files = [png(150), png(151), png(152)]
    with get_processor(folder, registry=registry, media_limits=limits) as proc:
        with pytest.raises(MediaItemError, match=r"image item 2: .*max_request_decoded_bytes"):
            proc.process(IMAGE * 3, {"image": files})
        proc.process(IMAGE, {"image": [files[0]]})
        assert len(proc.process(IMAGE * 3, {"image": files}).features) == 3


def test_a_processors_media_options_are_fixed_for_its_life(processor) -> None:
    # Its cached encoded items are keyed by how they decode: other options would break the keys.
    from mmproc.media import MediaOptions

    with pytest.raises(AttributeError):
        processor.media = MediaOptions()


def test_a_request_setting_normalise_itself_takes_the_float_path_alone(
    folder_for, registry
) -> None:
    with get_processor(folder_for("NormTinyQwen"), registry=registry) as proc:
        out = proc.process(IMAGE, {"image": [image(80)]}, hf_kwargs={"do_normalize": True})
        assert out.features[0].norm is None
        assert out.features[0].data["pixel_values"].dtype == torch.float32
        assert_matches_hf(proc, out, IMAGE, [image(80)])
        assert proc.norm_spec is not None  # later requests still ship uint8
        later = proc.process(IMAGE, {"image": [image(80)]})
        assert later.features[0].data["pixel_values"].dtype == torch.uint8
        assert later.features[0].hash != out.features[0].hash


def test_placeholders_without_items_are_an_error(processor) -> None:
    for mm_data in (None, {"image": []}):
        with pytest.raises(
            PromptUpdateError, match="1 image placeholder but the request has no image"
        ):
            processor.process(f"hi {IMAGE} there", mm_data)


def test_unusual_item_forms_are_media_item_errors(processor) -> None:
    bf16 = torch.zeros(3, 8, 8, dtype=torch.bfloat16)
    with pytest.raises(MediaItemError, match="image item 1") as err:
        processor.process(IMAGE * 2, {"image": [image(1), bf16]})
    assert err.value.index == 1


def test_prompt_forms(processor) -> None:
    import numpy as np

    ids = processor.hf_processor.tokenizer(f"a {IMAGE}")["input_ids"]
    as_numpy = processor.process(list(np.array(ids)), {"image": [image(5)]})
    assert (
        as_numpy.prompt_token_ids
        == processor.process(f"a {IMAGE}", {"image": [image(5)]}).prompt_token_ids
    )
    with pytest.raises(PromptUpdateError, match="not bytes"):
        processor.process(b"hello", None)


def test_hf_kwargs_that_differ_only_deep_inside_hash_differently(processor) -> None:
    import numpy as np

    a = processor.process(IMAGE, {"image": [image(6)]}, hf_kwargs={"image_mean": list(np.zeros(3))})
    b = processor.process(IMAGE, {"image": [image(6)]}, hf_kwargs={"image_mean": [0.0, 0.0, 1e-9]})
    assert a.features[0].hash != b.features[0].hash


def test_an_incomplete_field_spec_names_the_plugin(folder_for, registry) -> None:
    from mmproc.errors import FieldSpecError

    with get_processor(folder_for("IncompleteFieldsTinyQwen"), registry=registry) as proc:
        with pytest.raises(
            FieldSpecError, match=r"IncompleteFieldsTinyQwen \(plugin 'tiny'\).*image_grid_thw"
        ):
            proc.process(IMAGE, {"image": [image(7)]})


def test_hf_expansion_with_a_placeholder_mismatch_is_a_prompt_error(folder, registry) -> None:
    with get_processor(folder, registry=registry, hf_prompt_expansion=True, cache_bytes=0) as proc:
        with pytest.raises(PromptUpdateError, match="2 image placeholders but the request has 1"):
            proc.process(IMAGE * 2, {"image": [image(8)]})


def test_a_mistyped_folder_is_named_as_a_missing_folder(registry, tmp_path) -> None:
    from mmproc.errors import ProcessorLoadError

    with pytest.raises(ProcessorLoadError, match=r"model folder .*/nope does not exist"):
        get_processor(str(tmp_path / "nope"), registry=registry)


def test_a_misspelled_option_is_an_error_naming_it(folder, registry) -> None:
    with pytest.raises(ConfigurationError) as caught:
        get_processor(folder, registry=registry, worker=2, cache_byte=0)
    message = str(caught.value)
    assert "'cache_byte' (did you mean 'cache_bytes'?)" in message
    assert "'worker' (did you mean 'workers'?)" in message
    assert ARCH in message and "'tiny'" in message
    # what the plugin does not name is refused too, standard names included
    with pytest.raises(ConfigurationError, match="'crop_margin'"):
        get_processor(folder, registry=registry, crop_margin=4)
    with pytest.raises(ConfigurationError, match="unknown processor option 'backend'"):
        get_processor(folder, registry=registry, backend="pil")  # this model has one backend


def test_a_plugin_names_its_own_options(folder_for, registry) -> None:
    with get_processor(
        folder_for("OptionTinyQwen"), registry=registry, crop_margin=4, workers=1
    ) as proc:
        assert proc.ctx.option("crop_margin") == 4
    with pytest.raises(ConfigurationError, match="'crop_marginn' \\(did you mean 'crop_margin'"):
        get_processor(folder_for("OptionTinyQwen"), registry=registry, crop_marginn=4)


def test_extra_options_must_be_names(folder_for, registry) -> None:
    with pytest.raises(PluginSpecError, match="hook 'extra_options': must return an iterable"):
        get_processor(folder_for("BadOptionsTinyQwen"), registry=registry)


def test_hash_algorithm_option(folder, registry, processor) -> None:
    default = processor.process(IMAGE, {"image": [image(90)]})
    assert processor.hash_algorithm == "blake3"
    with get_processor(folder, registry=registry, hash_algorithm="xxh3") as fast:
        assert fast.hash_algorithm == "xxh3"
        out = fast.process(IMAGE, {"image": [image(90)]})
        again = fast.process(IMAGE, {"image": [image(90)]})
    assert out.features[0].hash == again.features[0].hash
    assert (len(out.features[0].hash), len(default.features[0].hash)) == (32, 64)
    assert out.features[0].hash != default.features[0].hash
    pixels = default.features[0].data["pixel_values"]
    assert torch.equal(out.features[0].data["pixel_values"], pixels)
    with pytest.raises(ConfigurationError, match="hash_algorithm: unknown hash algorithm 'sha1'"):
        get_processor(folder, registry=registry, hash_algorithm="sha1")


def _wait_until(condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


@pytest.mark.parametrize("workers", [1, 2])
def test_concurrent_misses_of_one_item_compute_it_once(folder_for, registry, workers) -> None:
    picture = image(95)
    with get_processor(
        folder_for("GatedTinyQwen"), registry=registry, workers=workers, warm_up=True
    ) as proc:
        model = model_of(proc)
        with ThreadPoolExecutor(2) as callers:
            first = callers.submit(proc.process, IMAGE, {"image": [picture]})
            assert model.entered.wait(30)
            # The second request arrives while the first computes the item: it waits for that
            # result (in its caller's thread, not on a worker: with one worker that is the
            # difference between waiting and deadlock).
            second = callers.submit(proc.process, IMAGE + IMAGE, {"image": [picture, picture]})
            _wait_until(lambda: proc._in_flight.waiting == 1)
            assert not second.done()
            model.gate.set()
            one, two = first.result(30), second.result(30)
    assert model.calls == [1]  # computed once, for both requests
    assert [f.hash for f in two.features] == [one.features[0].hash] * 2
    for feature in two.features:
        assert torch.equal(feature.data["pixel_values"], one.features[0].data["pixel_values"])
    stats = proc.cache.stats()
    assert (stats.hits, stats.misses) == (2, 1)
    assert (len(proc._in_flight), proc._in_flight.waiting) == (0, 0)


def test_async_waiters_do_not_hold_up_other_requests(folder_for, registry) -> None:
    picture = image(98)
    with get_processor(
        folder_for("GatedTinyQwen"),
        registry=registry,
        workers=2,
        io_workers=1,  # one prepare thread: a waiter holding it would stall everything
        warm_up=True,
    ) as proc:
        model = model_of(proc)

        async def main() -> None:
            owner = asyncio.ensure_future(proc.process_async(IMAGE, {"image": [picture]}))
            await asyncio.get_running_loop().run_in_executor(None, model.entered.wait, 30)
            waiters = [
                asyncio.ensure_future(proc.process_async(IMAGE, {"image": [picture]}))
                for _ in range(3)
            ]
            while proc._in_flight.waiting < 3:
                await asyncio.sleep(0.005)
            # A text-only request goes through while the gate is still closed.
            text = await asyncio.wait_for(proc.process_async("hello there"), timeout=30)
            assert text.features == [] and not owner.done()
            model.gate.set()
            results = await asyncio.wait_for(asyncio.gather(owner, *waiters), timeout=30)
            assert len({r.features[0].hash for r in results}) == 1

        asyncio.run(main())
    assert model.calls == [1]


@pytest.mark.parametrize("given", ["decoded", "encoded"])
def test_a_waiter_computes_the_item_itself_when_the_owner_fails(
    folder_for, registry, monkeypatch, given
) -> None:
    events = recording_decodes(monkeypatch)
    picture = image(96) if given == "decoded" else png(96)
    decodes = [] if given == "decoded" else ["parse", "decode 90x60"]
    with get_processor(
        folder_for("GatedTinyQwen"), registry=registry, workers=2, warm_up=True
    ) as proc:
        model = model_of(proc)
        model.failing = True
        with ThreadPoolExecutor(2) as callers:
            first = callers.submit(proc.process, IMAGE, {"image": [picture]})
            assert model.entered.wait(30)
            second = callers.submit(proc.process, IMAGE, {"image": [picture]})
            _wait_until(lambda: proc._in_flight.waiting == 1)
            assert events == decodes  # a file the waiter waits for, it has not decoded
            model.gate.set()
            with pytest.raises(MediaItemError, match=r"told to fail \(call 1\)"):
                first.result(30)
            # not stuck, and not handed the owner's failure: its own, from a later call
            with pytest.raises(MediaItemError, match=r"told to fail \(call [2-9]\)"):
                second.result(30)
        assert events == decodes * 2  # the waiter decoded the file for its own call
        assert (len(proc._in_flight), proc._in_flight.waiting) == (0, 0)
        model.failing = False
        assert proc.process(IMAGE, {"image": [picture]}).features  # nothing left claimed


def test_requests_waiting_for_an_encoded_item_others_compute_do_not_decode_it(
    folder_for, registry, monkeypatch
) -> None:
    events = recording_decodes(monkeypatch)
    data = png(97)
    with get_processor(
        folder_for("GatedTinyQwen"), registry=registry, workers=2, warm_up=True
    ) as proc:
        model = model_of(proc)
        with ThreadPoolExecutor(3) as callers:
            owner = callers.submit(proc.process, IMAGE, {"image": [data]})
            assert model.entered.wait(30)
            waiters = [callers.submit(proc.process, IMAGE, {"image": [data]}) for _ in range(2)]
            _wait_until(lambda: proc._in_flight.waiting == 2)
            model.gate.set()
            results = [owner.result(30)] + [w.result(30) for w in waiters]
    assert model.calls == [1]
    assert events == ["parse", "decode 90x60"]  # the owner's: the waiters' are hits
    assert len({r.features[0].hash for r in results}) == 1


def test_an_item_left_undecoded_for_its_owner_is_decoded_when_the_owner_is_gone_before_the_wait(
    folder_for, registry, monkeypatch
) -> None:
    # The owner fails between the waiter's preparation (which saw the claim) and its wait
    # (which finds none): the waiter has nothing to wait for and must still decode the item.
    events = recording_decodes(monkeypatch)
    data = png(101)
    with get_processor(
        folder_for("GatedTinyQwen"), registry=registry, workers=2, warm_up=True
    ) as proc:
        model = model_of(proc)
        model.failing = True
        at_wait, go_on = threading.Event(), threading.Event()
        wait = proc._in_flight.wait

        def held_wait(keys: Any) -> bool:
            at_wait.set()
            assert go_on.wait(30)
            return wait(keys)

        with ThreadPoolExecutor(2) as callers:
            first = callers.submit(proc.process, IMAGE, {"image": [data]})
            assert model.entered.wait(30)
            monkeypatch.setattr(proc._in_flight, "wait", held_wait)
            second = callers.submit(proc.process, IMAGE + IMAGE, {"image": [image(101), data]})
            assert at_wait.wait(30)
            model.gate.set()
            with pytest.raises(MediaItemError, match=r"told to fail \(call 1\)"):
                first.result(30)
            model.failing = False
            go_on.set()
            out = second.result(30)
        assert (len(proc._in_flight), proc._in_flight.waiting) == (0, 0)
    assert events == ["parse", "decode 90x60"] * 2
    assert_matches_hf(proc, out, IMAGE + IMAGE, [image(101), image(101)])


def test_async_waiters_for_an_encoded_item_decode_it_once(
    folder_for, registry, monkeypatch
) -> None:
    events = recording_decodes(monkeypatch)
    data = png(100)
    with get_processor(
        folder_for("GatedTinyQwen"), registry=registry, workers=2, warm_up=True
    ) as proc:
        model = model_of(proc)

        async def main() -> list[Any]:
            owner = asyncio.ensure_future(proc.process_async(IMAGE, {"image": [data]}))
            await asyncio.get_running_loop().run_in_executor(None, model.entered.wait, 30)
            waiters = [
                asyncio.ensure_future(proc.process_async(IMAGE, {"image": [data]}))
                for _ in range(3)
            ]
            while proc._in_flight.waiting < 3:
                await asyncio.sleep(0.005)
            model.gate.set()
            return await asyncio.wait_for(asyncio.gather(owner, *waiters), timeout=30)

        results = asyncio.run(main())
    assert model.calls == [1]
    assert events == ["parse", "decode 90x60"]
    assert len({r.features[0].hash for r in results}) == 1


def test_an_uncacheable_result_is_computed_again_by_the_waiter(folder_for, registry) -> None:
    picture = image(97)
    with get_processor(
        folder_for("GatedTinyQwen"),
        registry=registry,
        workers=2,
        warm_up=True,
        cache_bytes=1,  # on, but too small to keep anything
    ) as proc:
        model = model_of(proc)
        with ThreadPoolExecutor(2) as callers:
            first = callers.submit(proc.process, IMAGE, {"image": [picture]})
            assert model.entered.wait(30)
            second = callers.submit(proc.process, IMAGE, {"image": [picture]})
            _wait_until(lambda: proc._in_flight.waiting == 1)  # it did wait...
            model.gate.set()
            one, two = first.result(30), second.result(30)
    assert model.calls == [1, 1]  # ...and then computed the item, which the cache could not keep
    assert one.features[0].hash == two.features[0].hash


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("given", ["decoded", "encoded"])
def test_a_request_made_from_inside_a_worker_does_not_wait_for_its_own_claim(
    folder_for, registry, workers, given
) -> None:
    # Given encoded, the inner request finds the file claimed (by its outer request) and leaves
    # it undecoded; not waiting, it must decode it all the same.
    picture = image(99) if given == "decoded" else png(99)
    with get_processor(
        folder_for("NestedTinyQwen"), registry=registry, workers=workers, warm_up=True
    ) as proc:
        NestedTinyQwen.processor, NestedTinyQwen.inner = proc, None
        NestedTinyQwen.given = None if given == "decoded" else picture
        try:
            with ThreadPoolExecutor(1) as caller:
                outer = caller.submit(proc.process, IMAGE, {"image": [picture]}).result(60)
        finally:
            NestedTinyQwen.given = None
        inner = NestedTinyQwen.inner
        assert outer.features[0].hash == inner.features[0].hash
        assert (len(proc._in_flight), proc._in_flight.waiting) == (0, 0)
        assert_matches_hf(proc, inner, IMAGE, [image(99)])


# --- cache hits without a worker ----------------------------------------------------------------


def test_a_request_whose_items_all_hit_is_answered_without_a_worker(folder_for, registry) -> None:
    pictures = [image(120), image(121, (40, 130))]
    prompt = f"two {IMAGE} pictures {IMAGE}"
    with get_processor(
        folder_for("GatedTinyQwen"), registry=registry, workers=1, warm_up=True
    ) as proc:
        model = model_of(proc)
        model.gate.set()
        first = proc.process(prompt, {"image": pictures})
        calls, update_calls = list(model.calls), list(model.update_calls)
        # The only worker is busy from here on: a request needing it could not finish.
        model.gate.clear()
        model.entered.clear()
        ids = proc.hf_processor.tokenizer(prompt)["input_ids"]
        with ThreadPoolExecutor(2) as callers:
            busy = callers.submit(proc.process, IMAGE, {"image": [image(122)]})
            try:
                assert model.entered.wait(30)
                again = callers.submit(proc.process, prompt, {"image": pictures}).result(30)
                as_ids = callers.submit(proc.process, ids, {"image": pictures[::-1]}).result(30)
                assert not busy.done()
            finally:
                model.gate.set()
            busy.result(30)
    assert model.calls == [*calls, 1] and model.update_calls == [*update_calls, 1]
    assert again.prompt_token_ids == first.prompt_token_ids
    assert [f.placeholder for f in again.features] == [f.placeholder for f in first.features]
    assert [f.hash for f in again.features] == [f.hash for f in first.features]
    for a, b in zip(again.features, first.features):
        assert torch.equal(a.data["pixel_values"], b.data["pixel_values"])
    # The cached resolved updates are per item: swapped items swap their expansions.
    lengths = [f.placeholder.length for f in as_ids.features]
    assert lengths == [f.placeholder.length for f in first.features][::-1]


def test_an_async_request_whose_items_all_hit_needs_no_worker_either(folder_for, registry) -> None:
    picture = image(123)
    with get_processor(
        folder_for("GatedTinyQwen"), registry=registry, workers=1, warm_up=True
    ) as proc:
        model = model_of(proc)
        model.gate.set()
        proc.process(IMAGE, {"image": [picture]})
        model.gate.clear()
        model.entered.clear()

        async def main() -> None:
            busy = asyncio.ensure_future(proc.process_async(IMAGE, {"image": [image(124)]}))
            try:
                await asyncio.get_running_loop().run_in_executor(None, model.entered.wait, 30)
                hit = await asyncio.wait_for(proc.process_async(IMAGE, {"image": [picture]}), 30)
                assert hit.features and not busy.done()
            finally:
                model.gate.set()
            await asyncio.wait_for(busy, 30)

        asyncio.run(main())


# --- caller-given item ids ----------------------------------------------------------------------


def test_an_item_given_an_id_is_keyed_by_it_and_carries_it_as_its_hash(processor) -> None:
    first = processor.process(IMAGE, {"image": [image(130)]}, mm_uuids={"image": ["photo-1"]})
    assert first.features[0].hash == "photo-1"
    # The id is the caller's promise that equal ids mean equal content: another picture under
    # the same id is served the first one's outputs (see mmproc.cache_keys on trusting ids).
    hits = processor.cache.stats().hits
    second = processor.process(IMAGE, {"image": [image(131)]}, mm_uuids={"image": "photo-1"})
    assert processor.cache.stats().hits == hits + 1
    assert torch.equal(
        second.features[0].data["pixel_values"], first.features[0].data["pixel_values"]
    )


def test_an_id_given_twice_is_computed_from_the_item_that_came_with_its_data(processor) -> None:
    out = processor.process(
        IMAGE + IMAGE, {"image": [None, image(137)]}, mm_uuids={"image": ["twice", "twice"]}
    )
    assert [f.hash for f in out.features] == ["twice", "twice"]
    alone = processor.process(IMAGE, {"image": [image(137)]})
    assert torch.equal(out.features[0].data["pixel_values"], alone.features[0].data["pixel_values"])


def test_items_without_an_id_are_hashed_by_content(processor) -> None:
    pictures = [image(132), image(133)]
    named = processor.process(
        IMAGE + IMAGE, {"image": pictures}, mm_uuids={"image": [None, "second"]}
    )
    plain = processor.process(IMAGE + IMAGE, {"image": pictures})
    assert named.features[0].hash == plain.features[0].hash
    assert named.features[1].hash == "second" != plain.features[1].hash
    assert len(plain.features[1].hash) == 64  # a content key, never an id


def test_an_id_under_other_hf_kwargs_is_another_entry_and_another_hash(processor) -> None:
    ids = {"image": ["photo-2"]}
    plain = processor.process(IMAGE, {"image": [image(134)]}, mm_uuids=ids)
    sized = processor.process(
        IMAGE,
        {"image": [image(134)]},
        {"size": {"shortest_edge": 3136, "longest_edge": 28 * 28 * 4}},
        mm_uuids=ids,
    )
    assert plain.features[0].hash == "photo-2"
    assert sized.features[0].hash != "photo-2"
    assert plain.features[0].placeholder.length > sized.features[0].placeholder.length


@pytest.mark.parametrize(
    ("mm_uuids", "message"),
    [
        ({"image": ["a", "b"]}, r"mm_uuids has 2 image ids for 1 image item"),
        ({"image": [7]}, r"image item 0: its id must be a non-empty string, got 7"),
        ({"image": [""]}, r"image item 0: its id must be a non-empty string"),
        ({"image": ["x" * 1025]}, r"image item 0: its id is 1025 characters long"),
        ({"video": ["v"]}, r"mm_uuids has 1 video id for 0 video items"),
        (["a"], r"mm_uuids must map modality to item ids, not list"),
        ({"image": ["a"], "imag": []}, r"unknown mm_uuids modality 'imag'.*did you mean 'image'"),
    ],
)
def test_bad_ids_name_the_item_and_the_processor_keeps_serving(
    processor, mm_uuids: Any, message: str
) -> None:
    with pytest.raises(MediaItemError, match=message):
        processor.process(IMAGE, {"image": [image(135)]}, mm_uuids=mm_uuids)
    assert processor.process(IMAGE, {"image": [image(135)]}).features


def test_bad_ids_and_modalities_are_refused_before_any_item_is_read(
    processor, tmp_path: Path
) -> None:
    missing = str(tmp_path / "never-read.png")  # reading it would be a "no such file" error
    with pytest.raises(MediaItemError, match=r"image item 0: its id must be a non-empty string"):
        processor.process(IMAGE, {"image": [missing]}, mm_uuids={"image": [7]})
    with pytest.raises(MediaItemError, match=r"takes no video items"):
        processor.process(IMAGE, {"image": [missing], "video": [missing]})


def test_an_image_and_a_video_named_alike_are_two_items(qwen_folder: Path) -> None:
    video_prompt = "<|vision_start|><|video_pad|><|vision_end|>"
    frames = np.random.default_rng(0).integers(0, 256, (4, 56, 56, 3), dtype=np.uint8)
    with get_processor(qwen_folder, device_normalize=False) as real:
        real.process(IMAGE, {"image": [image(136)]}, mm_uuids={"image": ["same-name"]})
        # A video given by its name alone is not served the image's outputs...
        with pytest.raises(MediaItemError, match=r"video item 0"):
            real.process(video_prompt, {"video": [None]}, mm_uuids={"video": ["same-name"]})
        # ...and a video given with its frames is computed as a video.
        [feature] = real.process(
            video_prompt, {"video": [frames]}, mm_uuids={"video": ["same-name"]}
        ).features
        assert feature.modality == "video" and "pixel_values_videos" in feature.data


def test_media_of_a_modality_the_model_does_not_take_is_named(processor) -> None:
    with pytest.raises(MediaItemError, match=r"takes no audio items; it takes image") as info:
        processor.process("hello", {"audio": [(np.zeros(1600, np.float32), 16000)]})
    assert info.value.modality == "audio"
    assert processor.modalities == ("image",)


def _storage_bytes_held_by(root: Any) -> int:
    """Bytes of the distinct storages of the torch tensors reachable from ``root``."""
    import gc

    storages: dict[int, int] = {}
    seen: set[int] = set()
    stack = [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, type):
            continue
        seen.add(id(obj))
        if issubclass(type(obj), torch.Tensor):
            storage = obj.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
            continue
        stack.extend(gc.get_referents(obj))
    return sum(storages.values())


def test_a_long_run_of_distinct_requests_keeps_no_more_tensor_memory_than_the_cache_bound(
    folder: Path, registry: Registry
) -> None:
    bound = 1 << 20
    with get_processor(folder, registry=registry, cache_bytes=bound, workers=2) as proc:
        with ThreadPoolExecutor(4) as callers:
            # Three images per request: a cached item that kept a view of its request's batch
            # would keep the other two items' rows alive too.
            list(
                callers.map(
                    lambda i: proc.process(
                        IMAGE * 3, {"image": [image(700 + 3 * i + k, (120, 90)) for k in range(3)]}
                    ),
                    range(40),
                )
            )
        assert 0 < proc.cache.nbytes <= bound
        held = _storage_bytes_held_by(proc.cache)
        assert held <= bound, f"the cache holds {held} bytes of tensors; its bound is {bound}"


def test_process_async_does_no_request_work_on_the_event_loop_thread(
    folder_for, registry, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The loop of a serving front end also runs HTTP and streaming: parsing, hashing, the cache,
    # the HF call and assembling the answer (of misses and of all-cached requests) stay off it.
    import mmproc.processor as pipeline

    parsed: set[int] = set()
    parse = pipeline.read_mm_data

    def recording_parse(*args: Any, **kwargs: Any) -> Any:
        parsed.add(threading.get_ident())
        return parse(*args, **kwargs)

    monkeypatch.setattr(pipeline, "read_mm_data", recording_parse)
    folder = folder_for("ThreadRecordingTinyQwen")
    with get_processor(folder, registry=registry, workers=2) as proc:

        async def main() -> int:
            images = [image(900 + i) for i in range(8)]
            for _ in range(2):  # misses, then all hits
                await asyncio.gather(*(proc.process_async(IMAGE, {"image": [im]}) for im in images))
            return threading.get_ident()

        loop_thread = asyncio.run(main())
    assert ThreadRecordingTinyQwen.threads and parsed
    assert loop_thread not in ThreadRecordingTinyQwen.threads | parsed


def test_recording_stages_gives_each_request_started_inside_a_clock_of_its_stages(
    folder: Path, registry: Registry
) -> None:
    from mmproc.stages import STAGES

    with get_processor(folder, registry=registry, workers=1) as proc:
        with proc.recording_stages() as log:
            start = time.perf_counter()
            proc.process(IMAGE, {"image": [image(950)]})
            elapsed = time.perf_counter() - start
            proc.process(IMAGE, {"image": [image(950)]})
            asyncio.run(proc.process_async(IMAGE, {"image": [image(951)]}))
            chat = [{"role": "user", "content": [{"type": "image", "image": image(953)}]}]
            proc.process_chat(chat)
        proc.process(IMAGE, {"image": [image(952)]})
    miss, hit, async_miss, chat_miss = log.clocks
    assert set(miss.seconds) == set(async_miss.seconds) == set(STAGES) - {"render"}
    assert set(chat_miss.seconds) == set(STAGES) - {"tokenize"}  # the template's ids are given
    assert set(hit.seconds) == {"hops", "parse", "hash", "lookup", "tokenize", "expand"} | {
        "prompt_outputs"
    }
    assert 0 < miss.total <= elapsed
    assert len(log) == 4  # the request after the block was not recorded


def test_a_stand_in_hit_holds_meta_tensors_and_once_dropped_the_item_is_computed_again(
    folder, registry
) -> None:
    from mmproc.wire import is_stand_in

    with get_processor(folder, registry=registry) as proc:
        first = proc.process(IMAGE, {"image": [image(7)]})
        (whole,) = first.features
        assert whole.cache_key and proc.keep_stand_ins(first.features) == 1
        assert proc.keep_stand_ins(first.features) == 0  # a stand-in already
        again = proc.process(IMAGE, {"image": [image(7)]})
        assert model_of(proc).calls == [1]  # a hit
        (stand_in,) = again.features
        pixels = stand_in.data["pixel_values"]
        assert pixels.is_meta and pixels.shape == whole.data["pixel_values"].shape
        assert again.prompt_token_ids == first.prompt_token_ids
        assert (stand_in.hash, stand_in.placeholder) == (whole.hash, whole.placeholder)
        # What goes to the engine can only go by reference.
        assert is_stand_in(again.to_engine_request("r").features[0])
        assert proc.drop_stand_ins(again.features) == 1
        third = proc.process(IMAGE, {"image": [image(7)]})
        assert model_of(proc).calls == [1, 1]
        assert torch.equal(third.features[0].data["pixel_values"], whole.data["pixel_values"])
        assert proc.cache.stats().stand_ins == 0
