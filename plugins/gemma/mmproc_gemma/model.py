"""The Gemma 3, Gemma 3n and Gemma 4 model hooks.

* **Gemma 3** (``Gemma3ForConditionalGeneration``): each ``<start_of_image>`` becomes
  ``"\\n\\n<start_of_image>"``, 256 ``<image_soft_token>``, ``"<end_of_image>\\n\\n"``; with
  pan-and-scan, the image and each of its crops so, with transformers' prose between them, as
  one item whose ``pixel_values`` are ``(1 + crops, 3, 896, 896)``.
* **Gemma 3n** (``Gemma3nForConditionalGeneration``): each ``<image_soft_token>`` becomes 256 of
  them, each ``<audio_soft_token>`` 188, wrapped as Gemma 3's.
* **Gemma 4** (``Gemma4ForConditionalGeneration``): each ``<|image|>`` becomes as many soft
  tokens as the image has (its patches over the pooling area, at most ``max_soft_tokens``) in
  ``<|image>`` ... ``<image|>``; each ``<|video|>`` one such block of 70 per frame, each after
  its ``mm:ss`` time, joined by spaces; each ``<|audio|>`` one token per 40 ms (at most 750, the
  30 s the feature extractor keeps) in ``<|audio>`` ... ``<audio|>``.

The newlines and timestamps at an item's edges merge with the prompt text around it when
transformers tokenizes the substituted prompt; the prompt updates say so
(:meth:`PromptUpdateDetails.with_merges`), and the core tokenizes those seams again, so the cached
path, token-id prompts and transformers' own expansion give the same ids.

Gemma 3's chat template writes ``<bos>`` and its tokenizer adds another to every encoding:
transformers' processor gives such a prompt two BOS tokens, and so does mmproc, which follows the
model's processor (chat requests, like transformers' ``apply_chat_template``, get one).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from mmproc.plugin import (
    AudioFormat,
    BatchedField,
    ChannelLayout,
    ConfigurationError,
    FieldSpec,
    FlatField,
    MediaFormat,
    ModelContext,
    NormSpec,
    ProcessingMode,
    PromptReplacement,
    PromptUpdate,
    PromptUpdateDetails,
    VideoSampling,
    hookimpl,
)

from mmproc_gemma.contents import expansion_content, soft_token_count
from mmproc_gemma.fields import concatenated, padded
from mmproc_gemma.loading import load_gemma_processor
from mmproc_gemma.processing import (
    VIDEO_FPS_OPTION,
    clips_alone,
    media_kwargs,
    split_crops,
    video_metadata,
)

__all__ = ["Gemma3Model", "Gemma3nModel", "Gemma4Model"]

_TOKEN_TYPES = (("image_token_ids", 1), ("video_token_ids", 2), ("audio_token_ids", 3))


class _GemmaModel:
    """The hooks the three families share; each family's class says what differs."""

    placeholders: ClassVar[Mapping[str, str]]
    """Modality -> the text standing for one item in a prompt (what the chat template writes)."""
    token_type_key: ClassVar[str] = "token_type_ids"
    """The name transformers' processor gives its per-token modality types."""
    options: ClassVar[tuple[str, ...]] = ("backend",)
    crops: ClassVar[bool] = False
    """Whether ``pixel_values`` hold each image's pan-and-scan crops after it (Gemma 3)."""
    fixed_kwargs: ClassVar[tuple[str, ...]] = ()
    """Processor keywords a request may not set."""

    @hookimpl
    def extra_options(self) -> tuple[str, ...]:
        """``backend``: ``"torchvision"`` (default) or ``"pil"`` image processor."""
        return self.options

    @hookimpl
    def load_hf_processor(self, ctx: ModelContext) -> Any:
        """transformers' processor with the chosen image backend (see
        :mod:`mmproc_gemma.loading`)."""
        return load_gemma_processor(ctx)

    @hookimpl
    def get_dummy_text(self, mm_counts: Mapping[str, int]) -> str:
        """One placeholder per item: images, then videos, then audio."""
        return "".join(
            text * mm_counts.get(modality, 0) for modality, text in self.placeholders.items()
        )

    @hookimpl
    def process_mm_data(
        self,
        ctx: ModelContext,
        mode: ProcessingMode,
        prompt: str,
        mm_items: Mapping[str, Sequence[Any]],
        processor: Any,
        hf_kwargs: Mapping[str, Any],
    ) -> Mapping[str, Any]:
        """transformers' processor on the items: images and videos in one call (on the prompt,
        or with ``mode.media_only`` the dummy text), each audio clip alone (see
        :mod:`mmproc_gemma.processing`)."""
        if fixed := [key for key in self.fixed_kwargs if key in hf_kwargs]:
            raise ConfigurationError(
                f"{ctx.architecture} (plugin {ctx.plugin!r}): {', '.join(fixed)} cannot change "
                "per request (an item's token count is read with the processor's own)"
            )
        call = {"return_tensors": "pt", **hf_kwargs}
        media = media_kwargs(mm_items, ctx.option(VIDEO_FPS_OPTION))
        clips = list(mm_items.get("audio", ()))
        outputs: dict[str, Any] = {}
        if not mode.media_only:
            audio = {"audio": [clip.waveform for clip in clips]} if clips else {}
            outputs.update(processor(text=[prompt], **media, **audio, **call))
        elif media:
            counts = {m: len(items) for m, items in mm_items.items() if m != "audio"}
            outputs.update(processor(text=[self.get_dummy_text(counts)], **media, **call))
        if clips:
            outputs.update(clips_alone(ctx, processor, clips, self.placeholders["audio"], call))
        if self.crops and "images" in media:
            outputs["pixel_values"] = split_crops(
                processor, media["images"], outputs["pixel_values"], hf_kwargs
            )
        return outputs

    @hookimpl
    def get_prompt_outputs(
        self, processor: Any, prompt_token_ids: Sequence[int]
    ) -> Mapping[str, Any]:
        """transformers' per-token modality types: 1 for image soft tokens, 2 for video, 3 for
        audio, 0 for the rest (Gemma 3 and 3n call them ``token_type_ids``)."""
        import numpy as np
        import torch

        ids = np.asarray(prompt_token_ids, dtype=np.int64)
        types = np.zeros(len(ids), dtype=np.int64)
        for attribute, value in _TOKEN_TYPES:
            tokens = [t for t in getattr(processor, attribute, None) or () if t is not None]
            types[np.isin(ids, tokens)] = value
        return {self.token_type_key: torch.from_numpy(types)}

    @hookimpl
    def device_norm_spec(self, processor: Any) -> NormSpec | None:
        """Images ``(..., 3, H, W)`` travel as uint8; the engine rescales and normalises them with
        the image processor's settings."""
        return NormSpec.from_image_processor(
            processor.image_processor, layout=ChannelLayout.channels_first()
        )


def _audio_format(processor: Any) -> AudioFormat:
    # The feature extractors never resample: every clip must come at their rate, in one channel.
    return AudioFormat(sample_rate=int(processor.feature_extractor.sampling_rate), mono=True)


class Gemma3Model(_GemmaModel):
    """Hooks for ``Gemma3ForConditionalGeneration``: images, with pan-and-scan crops as the
    folder (or the request's ``do_pan_and_scan``) asks."""

    placeholders: ClassVar[Mapping[str, str]] = {"image": "<start_of_image>"}
    crops: ClassVar[bool] = True

    @hookimpl
    def get_mm_fields(self) -> Mapping[str, FieldSpec]:
        """Each image's ``(1 + crops, 3, 896, 896)`` pixels, as ``process_mm_data`` splits them."""
        return {"pixel_values": concatenated("image")}

    @hookimpl
    def get_prompt_updates(
        self, processor: Any, item_outputs: Mapping[str, Sequence[Mapping[str, Any]]]
    ) -> Sequence[PromptUpdate]:
        """Each ``<start_of_image>`` becomes the image's (and its crops') soft tokens, in the
        text transformers' ``replace_image_token`` gives, its edge newlines merging."""
        images = item_outputs.get("image", [])
        tokenizer = processor.tokenizer

        def expand(index: int) -> PromptUpdateDetails:
            crops = int(images[index]["pixel_values"].shape[0]) - 1
            text = processor.replace_image_token({"num_crops": [crops]}, image_idx=0)
            return expansion_content(
                text, tokenizer.boi_token, tokenizer.eoi_token, tokenizer, tokenizer.image_token_id
            )

        return [PromptReplacement("image", [processor.image_token_id], expand)]


class Gemma3nModel(_GemmaModel):
    """Hooks for ``Gemma3nForConditionalGeneration``: images and audio, fixed token counts."""

    placeholders: ClassVar[Mapping[str, str]] = {
        "image": "<image_soft_token>",
        "audio": "<audio_soft_token>",
    }

    @hookimpl
    def get_mm_fields(self) -> Mapping[str, FieldSpec]:
        """One ``(3, 768, 768)`` image per row; each clip's own frames."""
        return {
            "pixel_values": BatchedField("image"),
            "input_features": padded("audio"),
            "input_features_mask": padded("audio"),
        }

    @hookimpl
    def get_prompt_updates(self, processor: Any) -> Sequence[PromptUpdate]:
        """Each soft-token placeholder becomes 256 (image) or 188 (audio) of them, wrapped as
        transformers wraps them, the edge newlines merging."""
        tokenizer = processor.tokenizer
        image = expansion_content(
            processor.full_image_sequence,
            tokenizer.boi_token,
            tokenizer.eoi_token,
            tokenizer,
            processor.image_token_id,
        )
        audio = expansion_content(
            processor.full_audio_sequence,
            tokenizer.boa_token,
            tokenizer.eoa_token,
            tokenizer,
            processor.audio_token_id,
        )
        return [
            PromptReplacement("image", [processor.image_token_id], image),
            PromptReplacement("audio", [processor.audio_token_id], audio),
        ]

    @hookimpl
    def media_format(self, processor: Any) -> MediaFormat:
        """Audio at the feature extractor's rate (16 kHz), mono."""
        return MediaFormat(audio=_audio_format(processor))


class Gemma4Model(_GemmaModel):
    """Hooks for ``Gemma4ForConditionalGeneration``: images (variable token counts), videos
    with their frames' times, audio whose token count follows its length."""

    placeholders: ClassVar[Mapping[str, str]] = {
        "image": "<|image|>",
        "video": "<|video|>",
        "audio": "<|audio|>",
    }
    token_type_key: ClassVar[str] = "mm_token_type_ids"
    options: ClassVar[tuple[str, ...]] = ("backend", VIDEO_FPS_OPTION)
    # The soft token counts are real patches over the pooling area: read with the processors'.
    fixed_kwargs: ClassVar[tuple[str, ...]] = ("patch_size", "pooling_kernel_size")

    @hookimpl
    def extra_options(self) -> tuple[str, ...]:
        """``backend`` (images), and ``video_fps``: the frame rate of videos given as frames
        without metadata (without it such a video is refused: its frames' times are unknown)."""
        return self.options

    @hookimpl
    def get_mm_fields(self, outputs: Mapping[str, Any]) -> Mapping[str, FieldSpec]:
        """Images padded to ``max_soft_tokens`` patches each; a video's frames; each clip's own
        frames."""

        def frames(batched: Mapping[str, Any]) -> list[int]:
            return [int(n) for n in batched["num_frames_per_video"]]

        return {
            "pixel_values": BatchedField("image"),
            "image_position_ids": BatchedField("image"),
            "pixel_values_videos": FlatField("video", sizes=frames),
            "video_position_ids": FlatField("video", sizes=frames),
            "num_frames_per_video": BatchedField("video"),
            "input_features": padded("audio"),
            "input_features_mask": padded("audio"),
        }

    @hookimpl
    def get_prompt_updates(
        self,
        ctx: ModelContext,
        processor: Any,
        mm_items: Mapping[str, Sequence[Any]],
        item_outputs: Mapping[str, Sequence[Mapping[str, Any]]],
    ) -> Sequence[PromptUpdate]:
        """Each placeholder becomes the text transformers' ``replace_*_token`` gives its item:
        the image's soft tokens, a video's stamped frames (the first time merging with the text
        before it), the clip's audio tokens."""
        tokenizer = processor.tokenizer
        images = item_outputs.get("image", [])
        videos = item_outputs.get("video", [])
        clips = item_outputs.get("audio", [])
        fps = ctx.option(VIDEO_FPS_OPTION)

        def image(index: int) -> PromptUpdateDetails:
            pooling = processor.image_processor.pooling_kernel_size
            count = soft_token_count(images[index]["image_position_ids"], pooling)
            text = processor.replace_image_token({"num_soft_tokens_per_image": [count]}, 0)
            return expansion_content(
                text, processor.boi_token, processor.eoi_token, tokenizer, processor.image_token_id
            )

        def video(index: int) -> PromptUpdateDetails:
            pooling = processor.video_processor.pooling_kernel_size
            count = soft_token_count(videos[index]["video_position_ids"][0], pooling)
            metadata = video_metadata(mm_items["video"][index], fps)
            inputs = {"num_soft_tokens_per_video": [count], "video_metadata": [metadata]}
            text = processor.replace_video_token(inputs, 0)
            return expansion_content(
                text, processor.boi_token, processor.eoi_token, tokenizer, processor.video_token_id
            )

        def audio(index: int) -> PromptUpdateDetails:
            mask = clips[index]["input_features_mask"]
            text = processor.replace_audio_token({"input_features_mask": [mask]}, 0)
            return expansion_content(
                text, processor.boa_token, processor.eoa_token, tokenizer, processor.audio_token_id
            )

        return [
            PromptReplacement("image", [processor.image_token_id], image),
            PromptReplacement("video", [processor.video_token_id], video),
            PromptReplacement("audio", [processor.audio_token_id], audio),
        ]

    @hookimpl
    def device_norm_spec(self, processor: Any) -> NormSpec | None:
        """Patches ``(patches, 16 * 16 * 3)``, channels innermost, travel as uint8, for images
        and video frames alike; ``None`` when the video processor normalises otherwise."""
        image_processor, video_processor = processor.image_processor, processor.video_processor
        patch = int(image_processor.patch_size)
        layout = ChannelLayout(axis=-1, tiles=patch * patch)
        keys = ("pixel_values", "pixel_values_videos")
        spec = NormSpec.from_image_processor(image_processor, layout=layout, pixel_keys=keys)
        videos = NormSpec.from_image_processor(video_processor, layout=layout, pixel_keys=keys)
        if spec != videos or int(video_processor.patch_size) != patch:
            return None  # one spec cannot undo two normalisations
        return spec

    @hookimpl
    def media_format(self, processor: Any) -> MediaFormat:
        """Video files sampled as the video processor would (32 frames), audio at the feature
        extractor's rate (16 kHz), mono."""
        video = processor.video_processor
        sampling = None
        if getattr(video, "do_sample_frames", False):
            if getattr(video, "fps", None):
                sampling = VideoSampling(fps=float(video.fps))
            elif getattr(video, "num_frames", None):
                sampling = VideoSampling(num_frames=int(video.num_frames))
        return MediaFormat(video=sampling, audio=_audio_format(processor))
