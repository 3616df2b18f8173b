"""A real Qwen2-VL processor built from transformers classes, with no hub access.

The image and video processors are transformers' own Qwen2-VL classes with the real settings (patch
14, merge 2, temporal patch 2, min/max pixels, CLIP mean/std, bicubic). The tokenizer is made here
with the ``tokenizers`` library: a small word-level vocabulary for the tests, or a byte-level BPE of
Qwen2's size (151,643 regular tokens and as many merges) for measuring what a clone costs. Either
way it holds Qwen2-VL's real special tokens, and the big one gives them their real ids.

May be replaced later by the shared testing kit.
"""

from __future__ import annotations

from typing import Any, Literal

__all__ = [
    "QWEN2_VL_SPECIAL_TOKEN_IDS",
    "QWEN2_VOCAB_SIZE",
    "dummy_text",
    "make_image",
    "make_image_processor",
    "make_qwen2_vl_processor",
    "make_tokenizer",
]

# Qwen2's regular (non-added) vocabulary size; the special tokens come right after it.
QWEN2_VOCAB_SIZE = 151_643

# The ids Qwen2-VL's tokenizer gives its special tokens.
QWEN2_VL_SPECIAL_TOKEN_IDS: dict[str, int] = {
    "<|endoftext|>": 151_643,
    "<|im_start|>": 151_644,
    "<|im_end|>": 151_645,
    "<|vision_start|>": 151_652,
    "<|vision_end|>": 151_653,
    "<|image_pad|>": 151_655,
    "<|video_pad|>": 151_656,
}

# The real Qwen2-VL preprocessing settings (preprocessor_config.json of Qwen2-VL-7B-Instruct).
_IMAGE_SETTINGS: dict[str, Any] = {
    "patch_size": 14,
    "merge_size": 2,
    "temporal_patch_size": 2,
    "min_pixels": 3136,
    "max_pixels": 12_845_056,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
}

_WORDS = ("hello", "world", "describe", "the", "image", "video", "what", "is", "in", "this")

Backend = Literal["pil", "torchvision"]


def _special_tokens() -> list[Any]:
    from tokenizers import AddedToken

    return [AddedToken(t, special=True, normalized=False) for t in QWEN2_VL_SPECIAL_TOKEN_IDS]


def _small_backend() -> Any:
    """A word-level tokenizer: tiny, fast to build and to copy."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, **{w: i + 1 for i, w in enumerate(_WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(_special_tokens())
    return tok


def _qwen2_sized_backend() -> Any:
    """A byte-level BPE the size of Qwen2's: 151,643 tokens, 151,387 merges, real special ids.

    The merges join pairs of existing tokens (a deterministic walk), so the vocabulary and merge
    table have Qwen2's sizes and shape; what a clone costs depends on those, not on which strings
    they are.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    alphabet.sort()
    tokens: list[str] = list(alphabet)
    seen = set(tokens)
    merges: list[tuple[str, str]] = []
    i = 0
    while len(tokens) < QWEN2_VOCAB_SIZE:
        # Pair a recent token with an early one: strings grow slowly, like real merges.
        left = tokens[(i * 7919) % len(tokens)]
        right = tokens[i % len(alphabet)]
        i += 1
        merged = left + right
        if merged in seen or len(merged) > 16:
            continue
        seen.add(merged)
        tokens.append(merged)
        merges.append((left, right))
    vocab = {t: n for n, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # Added in id order, so each lands on its real id: fill the gaps with reserved tokens.
    from tokenizers import AddedToken

    specials = {i: t for t, i in QWEN2_VL_SPECIAL_TOKEN_IDS.items()}
    added = []
    for token_id in range(QWEN2_VOCAB_SIZE, max(specials) + 1):
        name = specials.get(token_id, f"<|reserved_{token_id}|>")
        added.append(AddedToken(name, special=True, normalized=False))
    tok.add_special_tokens(added)
    return tok


def make_tokenizer(*, qwen2_sized: bool = False) -> Any:
    """Return a ``PreTrainedTokenizerFast`` holding Qwen2-VL's special tokens.

    ``qwen2_sized=True`` builds the 151k-token byte-level BPE (a few seconds); the default is a
    ten-word vocabulary.
    """
    from transformers import PreTrainedTokenizerFast

    backend = _qwen2_sized_backend() if qwen2_sized else _small_backend()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=32_768,
    )


def make_image_processor(backend: Backend = "pil") -> Any:
    """Qwen2-VL's image processor with the real settings, on the PIL or torchvision backend."""
    from transformers.image_utils import PILImageResampling

    if backend == "pil":
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
            Qwen2VLImageProcessorPil as cls,
        )
    elif backend == "torchvision":
        from transformers.models.qwen2_vl.image_processing_qwen2_vl import (
            Qwen2VLImageProcessor as cls,
        )
    else:
        raise ValueError(f"unknown backend {backend!r}: 'pil' or 'torchvision'")
    return cls(resample=PILImageResampling.BICUBIC, **_IMAGE_SETTINGS)


def make_qwen2_vl_processor(backend: Backend = "pil", *, qwen2_sized: bool = False) -> Any:
    """A local ``Qwen2VLProcessor``: image processor on ``backend``, the real video processor."""
    from transformers import Qwen2VLProcessor
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    return Qwen2VLProcessor(
        image_processor=make_image_processor(backend),
        tokenizer=make_tokenizer(qwen2_sized=qwen2_sized),
        video_processor=Qwen2VLVideoProcessor(),
    )


def make_image(width: int = 1024, height: int = 768, seed: int = 0) -> Any:
    """A deterministic RGB noise image (PIL), ``width`` x ``height``."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB")


def dummy_text(n_images: int) -> str:
    """Text with one Qwen2-VL image placeholder per image, as the HF processor expects."""
    return "".join("<|vision_start|><|image_pad|><|vision_end|>" for _ in range(n_images))
