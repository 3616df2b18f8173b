"""Shared fixtures and helpers of the gemma plugin's tests: one folder of each family, written once
per session, transformers' processors built on them without the plugin (the references), and the
comparison of mmproc's result with theirs.

The test modules get the helpers through the ``gemma`` fixture (pytest imports test modules by
path here, so they cannot import this module), and the backend matrix through ``backend`` and
``combo_key``."""

from __future__ import annotations

import base64
import io
from collections.abc import Mapping, Sequence
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


@pytest.fixture(scope="session")
def gemma3_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The ``gemma3`` demo model (pan-and-scan ``null`` in its settings, as released)."""
    return write_gemma3_folder(tmp_path_factory.mktemp("gemma3") / "hub")


@pytest.fixture(scope="session")
def gemma3_pan_and_scan_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The ``gemma3-pan-and-scan`` demo model: the folder switches pan-and-scan on."""
    return write_gemma3_folder(tmp_path_factory.mktemp("gemma3") / "pas", pan_and_scan=True)


@pytest.fixture(scope="session")
def gemma3n_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The ``gemma3n`` demo model."""
    return write_gemma3n_folder(tmp_path_factory.mktemp("gemma3n") / "hub")


@pytest.fixture(scope="session")
def gemma4_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The ``gemma4`` demo model."""
    return write_gemma4_folder(tmp_path_factory.mktemp("gemma4") / "hub")


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
