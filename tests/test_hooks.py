"""One test per hook (``test_hook_<name>_...``): what the core asks of it and does with its answer.

The models are in-process test plugins on the tiny Qwen2-VL folder, each overriding the hook
under test; ``tests/test_public_api.py`` checks that every hook has its test here.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest
import torch
from _tiny_models import IMAGE, TinyQwenImageModel
from mmproc import hookimpl
from mmproc.context import ProcessingMode
from mmproc.errors import (
    ConfigurationError,
    FieldSpecError,
    MediaItemError,
    PluginLoadError,
    PluginSpecError,
    ProcessingError,
    ProcessorLoadError,
    UnknownArchitectureError,
)
from mmproc.factory import get_processor
from mmproc.fields import FlatField
from mmproc.media import AudioFormat, MediaFormat, VideoSampling
from mmproc.norm_spec import ChannelLayout, NormSpec
from mmproc.registry import PluginStatus, Registry
from PIL import Image


class Tiny(TinyQwenImageModel):
    """The hooks every test model needs; each test's model overrides the one under test."""

    seen: ClassVar[list[Any]] = []


def image(seed: int, size: tuple[int, int] = (60, 90)) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8))


@pytest.fixture
def build(folder_for, serving):
    """``build(ModelClass, **options)``: a processor whose model is ``ModelClass``."""
    opened = []

    def make(cls: type, **options: Any) -> Any:
        cls.seen = []
        name = cls.__name__
        processor = get_processor(folder_for(name), registry=serving({name: cls}), **options)
        opened.append(processor)
        return processor

    yield make
    for processor in opened:
        processor.close()


# --- load_hf_processor --------------------------------------------------------------------------


class Tagged(Tiny):
    @hookimpl
    def load_hf_processor(self, ctx):
        from transformers import AutoProcessor

        processor = AutoProcessor.from_pretrained(ctx.require_model_path(), local_files_only=True)
        processor.tagged_by = ctx.plugin
        return processor


class LoadsNothingReadable(Tiny):
    @hookimpl
    def load_hf_processor(self, ctx):
        raise OSError(f"no such file: {ctx.require_model_path() / 'special.json'}")


def test_hook_load_hf_processor_builds_the_processor_every_clone_comes_from(build) -> None:
    processor = build(Tagged, workers=2, warm_up=True)
    assert processor.hf_processor.tagged_by == "tiny"
    out = processor.process(IMAGE, {"image": [image(1)]})
    assert out.features[0].placeholder.length > 0
    with pytest.raises(ProcessorLoadError) as info:
        build(LoadsNothingReadable)
    message = str(info.value)
    assert "plugin 'tiny'" in message and "hook 'load_hf_processor'" in message
    assert "LoadsNothingReadable" in message and "OSError: no such file" in message


def test_read_json_object_gives_a_folders_settings_and_names_a_file_it_cannot_use(
    tmp_path: Path,
) -> None:
    from mmproc.context import ModelContext
    from mmproc.model_folder import read_json_object

    ctx = ModelContext("SomeArch", tmp_path, plugin="some")
    (tmp_path / "preprocessor_config.json").write_text('{"patch_size": 14}')
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "broken.json").write_text("{nope")
    assert read_json_object(ctx, "preprocessor_config.json") == {"patch_size": 14}
    assert read_json_object(ctx, "missing.json", required=False) is None
    with pytest.raises(ProcessorLoadError, match=r"SomeArch \(plugin 'some'\): .* has no missing"):
        read_json_object(ctx, "missing.json")
    with pytest.raises(ProcessorLoadError, match=r"list\.json must hold a JSON object"):
        read_json_object(ctx, "list.json")
    with pytest.raises(ProcessorLoadError, match=r"cannot read .*broken\.json"):
        read_json_object(ctx, "broken.json")


# --- process_mm_data ----------------------------------------------------------------------------


class ModeRecorder(Tiny):
    @hookimpl
    def process_mm_data(self, mode, prompt, hf_kwargs):
        ModeRecorder.seen.append((mode, prompt, dict(hf_kwargs)))
        return None  # the core's default runs the HF processor

    @hookimpl
    def device_norm_spec(self, processor):
        return NormSpec.from_image_processor(
            processor.image_processor, layout=ChannelLayout.flat_patches(14, 2)
        )


def test_hook_process_mm_data_is_told_how_it_is_called(build) -> None:
    processor = build(ModeRecorder, hf_prompt_expansion=True)
    processor.process(f"look {IMAGE}", {"image": [image(2)]})
    (mode, prompt, kwargs), *_ = ModeRecorder.seen
    assert mode == ProcessingMode(media_only=False, raw_pixels=True, device="cpu")
    assert prompt == f"look {IMAGE}"
    assert kwargs["do_rescale"] is False and kwargs["do_normalize"] is False

    ModeRecorder.seen.clear()
    ids = processor.hf_processor.tokenizer(f"look {IMAGE}")["input_ids"]
    processor.process(ids, {"image": [image(3)]}, hf_kwargs={"do_normalize": True})
    (mode, prompt, kwargs), *_ = ModeRecorder.seen
    # Token ids: media only, with the dummy text; the caller's own switch: not raw pixels.
    assert (mode.media_only, mode.raw_pixels) == (True, False)
    assert mode.user_kwargs == {"do_normalize": True}
    assert prompt == IMAGE and kwargs["do_normalize"] is True


def _recording_text(processor: Any, needs_text: bool) -> Any:
    """``processor`` as an instance of a subclass that records the text of each call (and, with
    ``needs_text``, refuses calls without any, as some processors do)."""
    cls = NeedsTextProcessor if needs_text else TextRecordingProcessor
    processor.__class__ = type(cls.__name__, (cls, type(processor)), {})
    return processor


class TextRecordingProcessor:
    texts: ClassVar[list[Any]] = []

    def __call__(self, *args: Any, text: Any = None, **kwargs: Any) -> Any:
        self.texts.append(text)
        return super().__call__(*args, text=text, **kwargs)  # type: ignore[misc]


class NeedsTextProcessor(TextRecordingProcessor):
    def __call__(self, *args: Any, text: Any = None, **kwargs: Any) -> Any:
        if text is None:
            self.texts.append(text)
            raise ValueError("this processor needs text")
        return super().__call__(*args, text=text, **kwargs)


class RecordsTexts(Tiny):
    needs_text: ClassVar[bool] = False

    @hookimpl
    def load_hf_processor(self, ctx):
        from transformers import AutoProcessor

        processor = AutoProcessor.from_pretrained(ctx.require_model_path(), local_files_only=True)
        return _recording_text(processor, self.needs_text)


class RecordsTextsNeeded(RecordsTexts):
    needs_text = True


def test_the_default_process_mm_data_runs_media_alone_unless_the_processor_needs_text(
    build,
) -> None:
    TextRecordingProcessor.texts.clear()
    processor = build(RecordsTexts, device_normalize=False)
    first = processor.process(f"a {IMAGE}", {"image": [image(60)]})
    assert TextRecordingProcessor.texts == [None]  # the dummy text's ids are never used
    processor.close()

    TextRecordingProcessor.texts.clear()
    needy = build(RecordsTextsNeeded, device_normalize=False)
    again = needy.process(f"a {IMAGE}", {"image": [image(60)]})
    needy.process(f"a {IMAGE}", {"image": [image(61)]})
    # Refused once, then the text every time: the class is remembered.
    assert TextRecordingProcessor.texts == [None, [IMAGE], [IMAGE]]
    assert again.prompt_token_ids == first.prompt_token_ids
    assert torch.equal(
        again.features[0].data["pixel_values"], first.features[0].data["pixel_values"]
    )


# --- get_mm_fields ------------------------------------------------------------------------------


class ForgetsTheGrid(Tiny):
    @hookimpl
    def get_mm_fields(self, outputs):
        return {"pixel_values": FlatField.from_grid("image", "image_grid_thw")}


def test_hook_get_mm_fields_splits_each_output_per_item(build) -> None:
    processor = build(Tiny)
    small, large = image(4, (28, 28)), image(5, (112, 84))
    out = processor.process(IMAGE + IMAGE, {"image": [small, large]})
    grids = [f.data["image_grid_thw"].tolist() for f in out.features]
    rows = [f.data["pixel_values"].shape[0] for f in out.features]
    assert rows == [int(np.prod(g)) for g in grids] and rows[0] < rows[1]
    with pytest.raises(FieldSpecError, match=r"plugin 'tiny'.*image_grid_thw"):
        build(ForgetsTheGrid).process(IMAGE, {"image": [small]})


# --- get_prompt_updates -------------------------------------------------------------------------


class CountsItems(Tiny):
    @hookimpl
    def get_prompt_updates(self, processor, mm_items, item_outputs):
        CountsItems.seen.append((len(mm_items["image"]), len(item_outputs["image"])))
        return Tiny.get_prompt_updates(self, processor, item_outputs)


class ForgetsToReturn(Tiny):
    @hookimpl
    def get_prompt_updates(self, processor, item_outputs):
        Tiny.get_prompt_updates(self, processor, item_outputs)  # the `return` left out


def test_hook_get_prompt_updates_sees_only_the_items_being_computed(build) -> None:
    processor = build(CountsItems)
    cached, new = image(6), image(7, (40, 120))
    first = processor.process(IMAGE, {"image": [cached]})
    both = processor.process(IMAGE + IMAGE, {"image": [cached, new]})
    processor.process(IMAGE + IMAGE, {"image": [new, cached]})  # both cached: not called
    assert CountsItems.seen == [(1, 1), (1, 1)]
    assert both.features[0].placeholder.length == first.features[0].placeholder.length
    with pytest.raises(PluginSpecError, match="hook 'get_prompt_updates' returned nothing"):
        build(ForgetsToReturn).process(IMAGE, {"image": [cached]})


# --- get_prompt_outputs -------------------------------------------------------------------------


class MarksImageTokens(Tiny):
    @hookimpl
    def get_prompt_outputs(self, processor, prompt_token_ids, placeholders):
        marks = np.zeros(len(prompt_token_ids), np.int64)
        for placeholder in placeholders.get("image", []):
            marks[placeholder.offset : placeholder.offset + placeholder.length] = 1
        MarksImageTokens.seen.append(processor)
        return {"image_marks": marks}


class MarksTooFew(Tiny):
    @hookimpl
    def get_prompt_outputs(self, prompt_token_ids):
        return {"image_marks": np.zeros(len(prompt_token_ids) - 1, np.int64)}


def test_hook_get_prompt_outputs_adds_per_token_outputs_of_the_final_prompt(build) -> None:
    processor = build(MarksImageTokens, workers=1)
    prompt = f"a {IMAGE} b {IMAGE}"
    computed = processor.process(prompt, {"image": [image(40), image(41, (90, 60))]})
    cached = processor.process(prompt, {"image": [image(40), image(41, (90, 60))]})
    for inputs in (computed, cached):
        marks = inputs.prompt_outputs["image_marks"]
        assert isinstance(marks, torch.Tensor) and marks.shape == (len(inputs.prompt_token_ids),)
        pad = processor.hf_processor.image_token_id
        assert marks.tolist() == [int(t == pad) for t in inputs.prompt_token_ids]
    # They travel to the engine with the request.
    from mmproc.wire import decode_request, encode_request

    received = decode_request(encode_request(cached.to_engine_request("r")))
    assert torch.equal(received.prompt_outputs["image_marks"], cached.prompt_outputs["image_marks"])
    # The cache answered the second request on this thread, reading the original processor.
    assert MarksImageTokens.seen[-1] is processor.hf_processor
    assert MarksImageTokens.seen[0] is not processor.hf_processor  # the worker's clone
    text_only = processor.process("text only")
    assert text_only.prompt_outputs["image_marks"].tolist() == [0] * len(text_only.prompt_token_ids)
    with pytest.raises(PluginSpecError, match=r"output 'image_marks' has shape \(\d+,\)"):
        build(MarksTooFew).process(prompt, {"image": [image(40), image(41)]})


# --- get_dummy_text -----------------------------------------------------------------------------


def test_hook_get_dummy_text_decides_which_modalities_the_model_takes(build) -> None:
    processor = build(Tiny)
    assert processor.modalities == ("image",)
    video = np.zeros((2, 28, 28, 3), np.uint8)
    with pytest.raises(MediaItemError, match="takes no video items; it takes image"):
        processor.process("hello", {"video": [video]})


# --- supports_concurrency -----------------------------------------------------------------------


class NoCopies(Tiny):
    @hookimpl
    def supports_concurrency(self):
        return False


def test_hook_supports_concurrency_false_gets_one_worker(
    build, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="mmproc"):
        processor = build(NoCopies, workers=4)
    assert processor.workers == 1
    assert "does not support concurrent preprocessing" in caplog.text
    assert processor.process(IMAGE, {"image": [image(8)]}).features


# --- worker_count_hint --------------------------------------------------------------------------


class HintsThree(Tiny):
    @hookimpl
    def worker_count_hint(self, path):
        HintsThree.seen.append(str(path))
        return 3


def test_hook_worker_count_hint_counts_on_the_cpu_path_and_yields_to_the_device_cap(
    build,
) -> None:
    assert build(HintsThree, warm_up=False).workers == 3
    assert HintsThree.seen == ["cpu"]
    assert build(HintsThree, warm_up=False, workers=2).workers == 2  # the caller's wins
    # A torchvision image processor running on a GPU: one worker, whatever the hint.
    assert build(HintsThree, warm_up=False, device="cuda").workers == 1
    assert HintsThree.seen == ["device"]


# --- device_norm_spec ---------------------------------------------------------------------------


class Normalised(Tiny):
    @hookimpl
    def device_norm_spec(self, processor):
        return NormSpec.from_image_processor(
            processor.image_processor, layout=ChannelLayout.flat_patches(14, 2)
        )


def test_hook_device_norm_spec_ships_raw_uint8_pixels_the_engine_normalises(build) -> None:
    from mmproc.fused_norm import FusedInputNorm

    raw = build(Normalised).process(IMAGE, {"image": [image(9)]}).features[0]
    floats = build(Normalised, device_normalize=False).process(IMAGE, {"image": [image(9)]})
    assert raw.data["pixel_values"].dtype == torch.uint8 and raw.norm is not None
    normalised = FusedInputNorm(raw.norm, dtype=torch.float32)(raw.data["pixel_values"])
    expected = floats.features[0].data["pixel_values"]
    assert floats.features[0].norm is None
    assert float((normalised - expected).abs().max()) < 1e-5
    with pytest.raises(ConfigurationError, match="gives no device normalisation"):
        build(Tiny, device_normalize=True)


# --- media_format -------------------------------------------------------------------------------


class WantsSixteenKilohertz(Tiny):
    @hookimpl
    def media_format(self, processor):
        return MediaFormat(
            video=VideoSampling(num_frames=4, frame_multiple=2),
            audio=AudioFormat(sample_rate=16000, mono=True),
        )


class ReturnsADict(Tiny):
    @hookimpl
    def media_format(self):
        return {"audio": 16000}


def test_hook_media_format_sets_how_the_models_media_are_loaded(build) -> None:
    media = build(WantsSixteenKilohertz).media
    assert media.audio == AudioFormat(sample_rate=16000, mono=True)
    assert media.video == VideoSampling(num_frames=4, frame_multiple=2)
    # The caller's sampling wins over the model's; without either, 2 fps.
    mine = VideoSampling(fps=1.0)
    assert build(WantsSixteenKilohertz, video_sampling=mine).media.video == mine
    assert build(Tiny).media.video == VideoSampling()
    with pytest.raises(PluginSpecError, match="hook 'media_format': returned dict"):
        build(ReturnsADict)


# --- extra_options ------------------------------------------------------------------------------


class ReadsCropMargin(Tiny):
    @hookimpl
    def extra_options(self, ctx):
        return ["crop_margin"]

    @hookimpl
    def process_mm_data(self, ctx):
        ReadsCropMargin.seen.append(ctx.option("crop_margin"))
        return None


def test_hook_extra_options_names_the_options_a_plugin_reads(build) -> None:
    processor = build(ReadsCropMargin, crop_margin=4)
    processor.process(IMAGE, {"image": [image(10)]})
    assert ReadsCropMargin.seen == [4]
    with pytest.raises(ConfigurationError, match=r"'crop_marginn' \(did you mean 'crop_margin'"):
        build(ReadsCropMargin, crop_marginn=4)
    with pytest.raises(ConfigurationError, match="'crop_margin'"):
        build(Tiny, crop_margin=4)  # a model that does not name it


# --- mmproc_register_models ---------------------------------------------------------------------


def write_tiny_demo(folder: Path) -> Path:
    """A demo model writer, as a plugin's would be."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text('{"architectures": ["TinyDemoArch"]}')
    return folder


class RegistersADemo:
    @hookimpl
    def mmproc_register_models(self, registry):
        registry.register("TinyDemoArch", f"{__name__}:Tiny")
        registry.register_demo("tiny-demo", f"{__name__}:write_tiny_demo", description="tiny")


class RegistersABadDemoName:
    @hookimpl
    def mmproc_register_models(self, registry):
        registry.register("OtherArch", f"{__name__}:Tiny")
        registry.register_demo("Tiny Demo!", f"{__name__}:write_tiny_demo")


def test_hook_mmproc_register_models_registers_architectures_and_demo_models(
    tmp_path: Path,
) -> None:
    registry = Registry(entry_points=False)
    info = registry.add_plugin(RegistersADemo(), name="demoing")
    assert (info.status, info.architectures, info.demo_models) == (
        PluginStatus.LOADED,
        ["TinyDemoArch"],
        ["tiny-demo"],
    )
    demo = registry.demo_model("tiny-demo")
    assert (demo.plugin, demo.description) == ("demoing", "tiny")
    folder = demo.write(tmp_path / "demo")
    assert registry.resolve_folder(folder).target == f"{__name__}:Tiny"
    with pytest.raises(PluginLoadError, match="demo model name 'Tiny Demo!'"):
        registry.add_plugin(RegistersABadDemoName(), name="bad")
    with pytest.raises(UnknownArchitectureError, match="no plugin serves architecture 'OtherArch'"):
        registry.resolve("OtherArch")  # rolled back with the rest of its registrations


# --- every hook: what the core does when a hook misbehaves --------------------------------------


class UpdatesFailOnce(Tiny):
    failures: ClassVar[list[str]] = ["boom"]

    @hookimpl
    def get_prompt_updates(self, processor, item_outputs):
        if UpdatesFailOnce.failures:
            raise KeyError(UpdatesFailOnce.failures.pop())
        return Tiny.get_prompt_updates(self, processor, item_outputs)


class AnswersBytes(Tiny):
    @hookimpl
    def get_dummy_text(self, mm_counts):
        return IMAGE.encode() * mm_counts.get("image", 0)


def test_a_hook_that_raises_fails_its_request_naming_the_plugin_and_hook_and_the_pool_serves_on(
    build,
) -> None:
    processor = build(UpdatesFailOnce)
    with pytest.raises(
        ProcessingError, match=r"plugin 'tiny'.*UpdatesFailOnce, hook 'get_prompt_updates'.*boom"
    ):
        processor.process(IMAGE, {"image": [image(30)]})
    assert len(processor.process(IMAGE, {"image": [image(30)]}).features) == 1


def test_a_hook_answer_of_the_wrong_type_is_refused_naming_the_hook(build) -> None:
    with pytest.raises(
        PluginSpecError, match="hook 'get_dummy_text': returned bytes; expected str"
    ):
        build(AnswersBytes).process(IMAGE, {"image": [image(31)]})
