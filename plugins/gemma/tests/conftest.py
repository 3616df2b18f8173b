"""Shared fixtures and helpers of the gemma plugin's tests: one folder of each family, written once
per session, transformers' processors built on them without the plugin (the references), and the
comparison of mmproc's result with theirs.

The test modules get the helpers through the ``gemma`` fixture (pytest imports test modules by
path here, so they cannot import this module), the backend matrix through ``backend``,
``combo_key`` and ``combo``, and their family's folder, references and processors through
``folder``, ``references`` and ``processors`` (a module names its family in ``FAMILY``)."""

from __future__ import annotations

import base64
import io
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import mmproc
import numpy as np
import pytest
from mmproc.plugin import BatchedField, FieldSpec, FlatField, PaddedField
from mmproc.testing import assert_matches_hf, call_hf_processor
from mmproc.testing.samples import encode_audio
from mmproc_gemma.demo import write_gemma3_folder, write_gemma3n_folder, write_gemma4_folder

BACKENDS = ("torchvision", "pil")

# (backend, device_normalize): the four processors a family's identity tests run on.
COMBOS = [(backend, norm) for backend in BACKENDS for norm in (True, False)]
COMBO_IDS = [f"{backend}-{'uint8' if norm else 'float'}" for backend, norm in COMBOS]

# The image processor class of each family and backend, as transformers names them.
IMAGE_CLASSES = {
    "gemma3": {
        "torchvision": "gemma3.image_processing_gemma3:Gemma3ImageProcessor",
        "pil": "gemma3.image_processing_pil_gemma3:Gemma3ImageProcessorPil",
    },
    "gemma3n": {
        "torchvision": "siglip.image_processing_siglip:SiglipImageProcessor",
        "pil": "siglip.image_processing_pil_siglip:SiglipImageProcessorPil",
    },
    "gemma4": {
        "torchvision": "gemma4.image_processing_gemma4:Gemma4ImageProcessor",
        "pil": "gemma4.image_processing_pil_gemma4:Gemma4ImageProcessorPil",
    },
}

_PADDED = PaddedField("audio", lengths=(), dim=1)
# How each output joins across items, as the tests state it (not read from the plugin).
JOINS: dict[str, dict[str, FieldSpec]] = {
    "gemma3": {"pixel_values": FlatField("image", sizes=())},
    "gemma3n": {
        "pixel_values": BatchedField("image"),
        "input_features": _PADDED,
        "input_features_mask": _PADDED,
    },
    "gemma4": {
        "pixel_values": BatchedField("image"),
        "image_position_ids": BatchedField("image"),
        "pixel_values_videos": FlatField("video", sizes=()),
        "video_position_ids": FlatField("video", sizes=()),
        "num_frames_per_video": BatchedField("video"),
        "input_features": _PADDED,
        "input_features_mask": _PADDED,
    },
}

# The token each modality's items expand to: the soft tokens, which alone get embeddings.
SOFT_TOKENS = {
    "gemma3": {"image": "<image_soft_token>"},
    "gemma3n": {"image": "<image_soft_token>", "audio": "<audio_soft_token>"},
    "gemma4": {"image": "<|image|>", "video": "<|video|>", "audio": "<|audio|>"},
}

AUDIO_KEYS = ("input_features", "input_features_mask")


class Helpers:
    """The helpers the ``gemma`` fixture gives the tests."""

    BACKENDS = BACKENDS
    JOINS = JOINS
    AUDIO_KEYS = AUDIO_KEYS

    @staticmethod
    def image_class(family: str, backend: str) -> Any:
        """transformers' image processor class of ``family`` for ``backend``."""
        import importlib

        module, _, name = IMAGE_CLASSES[family][backend].partition(":")
        return getattr(importlib.import_module(f"transformers.models.{module}"), name)

    @staticmethod
    def build_reference(folder: Path, family: str, backend: str) -> Any:
        """transformers' processor for ``folder``, built without the plugin: ``AutoProcessor`` with
        the backend's image processor, as a user would build it."""
        from transformers import AutoProcessor

        images = Helpers.image_class(family, backend).from_pretrained(folder, local_files_only=True)
        return AutoProcessor.from_pretrained(folder, local_files_only=True, image_processor=images)

    @staticmethod
    def assert_like_hf(
        out: mmproc.ProcessedInputs,
        hf: Mapping[str, Any],
        family: str,
        tokenizer: Any,
        *,
        normalised: bool | None = None,
        context: str = "",
    ) -> None:
        """``out`` is transformers' ``hf``: prompt ids, per-item tensors, ranges whose embedding
        positions are exactly the soft tokens, per-token types (uint8 pixels within 1e-6 after
        ``FusedInputNorm``)."""
        present = {feature.modality for feature in out.features}
        tokens = {
            modality: tokenizer.convert_tokens_to_ids(token)
            for modality, token in SOFT_TOKENS[family].items()
            if modality in present
        }
        assert_matches_hf(
            out,
            hf,
            fields=JOINS[family],
            placeholder_token_ids=tokens,
            normalised=normalised,
            context=context,
        )

    @staticmethod
    def process_like_hf(
        processor: Any,
        reference: Any,
        family: str,
        prompt: str,
        mm_data: Mapping[str, Sequence[Any]],
        *,
        normalised: bool | None = None,
        **hf_kwargs: Any,
    ) -> mmproc.ProcessedInputs:
        """mmproc's result for a request (with ``hf_kwargs``), checked against transformers' for
        the same request."""
        out = processor.process(prompt, mm_data, hf_kwargs=hf_kwargs or None)
        hf = call_hf_processor(reference, prompt, mm_data, **hf_kwargs)
        Helpers.assert_like_hf(out, hf, family, reference.tokenizer, normalised=normalised)
        return out

    @staticmethod
    def one_clip(
        processors: Any, references: Any, family: str, prompt: str, seconds: float, seed: int
    ) -> mmproc.ProcessedInputs:
        """A request of one 16 kHz clip of ``seconds`` (torchvision, uint8 pixels), checked
        against transformers."""
        mm_data = {"audio": [(Helpers.tone(seconds, seed=seed), 16000)]}
        processor, reference = processors[("torchvision", True)], references["torchvision"]
        return Helpers.process_like_hf(processor, reference, family, prompt, mm_data)

    @staticmethod
    def chat_like_hf(
        processor: Any, family: str, messages: list[dict[str, Any]]
    ) -> mmproc.ProcessedInputs:
        """``process_chat`` of OpenAI-style ``messages`` (image_url, audio_url, input_audio
        parts), checked against transformers: its template rendered on the messages with each
        media part as ``{"type": ...}``, its processor on the parts' media as mmproc decodes
        them, tokenized as ``apply_chat_template`` tokenizes (the template writes the BOS)."""
        from mmproc.inputs import parse_mm_data

        out = processor.process_chat(messages)
        sources: dict[str, list[Any]] = {"image": [], "audio": []}
        theirs = []
        for message in messages:
            content = message["content"]
            if isinstance(content, list):
                content = [Helpers._as_hf_part(part, sources) for part in content]
            theirs.append({**message, "content": content})
        hf_processor = processor.hf_processor
        text = hf_processor.apply_chat_template(theirs, add_generation_prompt=True, tokenize=False)
        decoded = parse_mm_data({m: v for m, v in sources.items() if v}, media=processor.media)
        media: dict[str, Any] = {}
        if decoded.get("image"):
            media["images"] = decoded["image"]
        if decoded.get("audio"):
            media["audio"] = [clip.waveform for clip in decoded["audio"]]
        hf = hf_processor(text=[text], **media, return_tensors="pt", add_special_tokens=False)
        Helpers.assert_like_hf(out, hf, family, hf_processor.tokenizer)
        return out

    @staticmethod
    def _as_hf_part(part: dict[str, Any], sources: dict[str, list[Any]]) -> dict[str, Any]:
        """A media part as transformers' templates take it; its source noted in ``sources``."""
        kind = part["type"]
        if kind in ("image_url", "audio_url"):
            modality = kind.removesuffix("_url")
            sources[modality].append(part[kind]["url"])
            return {"type": modality}
        if kind == "input_audio":
            audio = part["input_audio"]
            sources["audio"].append(f"data:audio/{audio['format']};base64,{audio['data']}")
            return {"type": "audio"}
        return part

    @staticmethod
    def long_clip(
        processor: Any, reference: Any, family: str, prompt: str, seconds: float, caplog: Any
    ) -> mmproc.ProcessedInputs:
        """A request of one clip over 30 s, checked against transformers (which keeps its first
        30 s); the log must say that the rest is dropped."""
        clip = (Helpers.tone(seconds, seed=3), 16000)
        with caplog.at_level(logging.WARNING, logger="mmproc_gemma"):
            out = Helpers.process_like_hf(processor, reference, family, prompt, {"audio": [clip]})
        said = f"an audio clip of {seconds:.2f} s; the feature extractor keeps its first 30.00 s"
        assert said in caplog.text
        return out

    @staticmethod
    def hf_with_clips_alone(
        reference: Any, prompt: str, mm_data: Mapping[str, Sequence[Any]], **kwargs: Any
    ) -> dict[str, Any]:
        """transformers' outputs for a request, each audio clip's features as transformers gives
        them for that clip alone (what mmproc gives every clip, whatever its batch)."""
        outputs = dict(call_hf_processor(reference, prompt, mm_data, **kwargs))
        clips = list(mm_data.get("audio") or ())
        if clips:
            alone = [
                call_hf_processor(reference, reference.audio_token, {"audio": [clip]}, **kwargs)
                for clip in clips
            ]
            for key in AUDIO_KEYS:
                outputs[key] = JOINS["gemma4"][key].join(key, [one[key][0] for one in alone])
        return outputs

    @staticmethod
    def tone(seconds: float, rate: int = 16000, hz: float = 330.0, seed: int = 0) -> np.ndarray:
        """A float32 tone with a little noise (every mel bin shows), ``seconds`` long."""
        t = np.arange(round(seconds * rate)) / rate
        noise = np.random.default_rng(seed).normal(0, 0.01, t.shape)
        return (0.4 * np.sin(2 * np.pi * hz * t) + noise).astype(np.float32)

    @staticmethod
    def wav_url(waveform: np.ndarray, rate: int) -> str:
        """A ``data:`` URL of a WAV file."""
        return "data:audio/wav;base64," + base64.b64encode(encode_audio(waveform, rate)).decode()

    @staticmethod
    def png_url(image: Any) -> str:
        """A ``data:`` URL of a PNG file."""
        buffer = io.BytesIO()
        image.save(buffer, "PNG")
        return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


_WRITERS: dict[str, Callable[[Path], Path]] = {
    "gemma3": write_gemma3_folder,
    "gemma3-pan-and-scan": lambda path: write_gemma3_folder(path, pan_and_scan=True),
    "gemma3n": write_gemma3n_folder,
    "gemma4": write_gemma4_folder,
}


@pytest.fixture(scope="session")
def folders(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """``folders(name)``: the demo model ``name`` (``"gemma3"``, ``"gemma3-pan-and-scan"``,
    ``"gemma3n"``, ``"gemma4"``), written once per session."""
    written: dict[str, Path] = {}

    def folder(name: str) -> Path:
        if name not in written:
            written[name] = _WRITERS[name](tmp_path_factory.mktemp(name) / "hub")
        return written[name]

    return folder


@pytest.fixture(scope="module")
def folder(request: pytest.FixtureRequest, folders: Callable[[str], Path]) -> Path:
    """The folder of the test module's ``FAMILY``."""
    return folders(request.module.FAMILY)


@pytest.fixture(scope="module")
def references(request: pytest.FixtureRequest, folder: Path) -> dict[str, Any]:
    """Backend -> transformers' processor of the module's ``FAMILY``, built without the plugin."""
    family = request.module.FAMILY
    return {backend: Helpers.build_reference(folder, family, backend) for backend in BACKENDS}


@pytest.fixture(scope="module")
def processors(folder: Path) -> Iterator[dict[tuple[str, bool], mmproc.Processor]]:
    """(backend, device_normalize) -> mmproc's processor of the module's folder."""
    with ExitStack() as stack:
        yield {
            key: stack.enter_context(
                mmproc.get_processor(folder, backend=key[0], device_normalize=key[1])
            )
            for key in COMBOS
        }


@pytest.fixture
def combo(combo_key: tuple[str, bool], processors: Any, references: Any) -> Any:
    """(mmproc's processor, transformers' processor, device_normalize) for one pair."""
    return processors[combo_key], references[combo_key[0]], combo_key[1]


@pytest.fixture(scope="session")
def gemma() -> type[Helpers]:
    """The shared helpers (:class:`Helpers`)."""
    return Helpers


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    """Each image backend in turn."""
    return str(request.param)


@pytest.fixture(params=COMBOS, ids=COMBO_IDS)
def combo_key(request: pytest.FixtureRequest) -> tuple[str, bool]:
    """Each (backend, device_normalize) pair in turn."""
    return tuple(request.param)  # type: ignore[return-value]
