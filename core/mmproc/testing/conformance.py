"""Conformance checks for plugin authors: mmproc's output against transformers called directly.

The bar for a model plugin is identity with the model's own processor: the same prompt ids, the
same tensors per item, placeholder ranges exactly where the expanded placeholder tokens are.
:func:`assert_matches_hf` checks one processed request against the outputs of the HF processor
called on the same prompt and media (``processor(text=[prompt], images=..., return_tensors="pt")``).
Every check raises :class:`AssertionError` explicitly, so it holds under ``python -O``.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

import torch

from mmproc.fields import FieldSpec
from mmproc.fused_norm import FusedInputNorm
from mmproc.processor import ProcessedInputs

__all__ = [
    "TEXT_OUTPUT_KEYS",
    "assert_bf16_close",
    "assert_matches_hf",
    "describe_prompt_difference",
    "placeholder_token",
    "token_runs",
]

#: Outputs that belong to the prompt, not to a media item.
TEXT_OUTPUT_KEYS = frozenset({"input_ids", "attention_mask", "mm_token_type_ids", "token_type_ids"})


def token_runs(ids: Sequence[int], token_id: int) -> list[tuple[int, int]]:
    """``(offset, length)`` of each maximal run of ``token_id`` in ``ids``."""
    runs, i = [], 0
    while i < len(ids):
        if ids[i] != token_id:
            i += 1
            continue
        j = i
        while j < len(ids) and ids[j] == token_id:
            j += 1
        runs.append((i, j - i))
        i = j
    return runs


def placeholder_token(out: ProcessedInputs, modality: str) -> int | None:
    """The token a modality's items expand to in ``out``: the most common token at the embedding
    positions of their placeholder ranges (None without such items)."""
    counts: dict[int, int] = {}
    for feature in out.features:
        if feature.modality != modality:
            continue
        r = feature.placeholder
        for position, embeds in enumerate(r.embed_mask(), r.offset):
            if embeds:
                token = out.prompt_token_ids[position]
                counts[token] = counts.get(token, 0) + 1
    return max(counts, key=counts.__getitem__) if counts else None


def describe_prompt_difference(
    got: Sequence[int], want: Sequence[int], placeholder_token_ids: Mapping[str, int]
) -> str:
    """Say how mmproc's prompt ids differ from the HF processor's, and which hook to look at."""
    first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    parts = [
        f"prompt ids differ from the HF processor's at position {first} "
        f"(mmproc {got[first] if first < len(got) else 'ends'}, "
        f"HF {want[first] if first < len(want) else 'ends'}); "
        f"lengths: mmproc {len(got)}, HF {len(want)}"
    ]
    for modality, token_id in placeholder_token_ids.items():
        mine, theirs = list(got).count(token_id), list(want).count(token_id)
        if mine != theirs:
            parts.append(
                f"{modality} placeholder tokens ({token_id}): mmproc {mine}, HF {theirs}: fix "
                f"the get_prompt_updates hook (each {modality} item must expand to as many "
                "tokens as the HF processor gives it)"
            )
    if len(parts) == 1:
        parts.append(
            "placeholder counts agree: check get_prompt_updates' targets and contents, and "
            "get_dummy_text"
        )
    return "; ".join(parts)


def _require(condition: bool, message: str) -> None:
    """Raise :class:`AssertionError` with ``message`` unless ``condition``: a real raise, not an
    ``assert`` statement, so that the checks hold under ``python -O`` too."""
    if not condition:
        raise AssertionError(message)


def _join(spec: FieldSpec, key: str, values: Sequence[Any], where: str) -> Any:
    """The items' values of ``key`` joined by their field; one that cannot join (items of
    different shapes in a ``BatchedField``) is a failure naming the field."""
    try:
        return spec.join(key, values)
    except (RuntimeError, ValueError) as exc:
        raise AssertionError(
            f"{where}{key!r}: the items' values {[tuple(torch.as_tensor(v).shape) for v in values]}"
            f" do not join with get_mm_fields' {type(spec).__name__}: {exc}"
        ) from exc


def assert_bf16_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Every bf16 value equals the reference cast to bf16, or is one bf16 step from it."""
    _require(got.dtype == torch.bfloat16, f"bf16 output expected, got {got.dtype}")
    want = want.to(torch.bfloat16)
    up = torch.nextafter(want, torch.full_like(want, float("inf")))
    down = torch.nextafter(want, torch.full_like(want, float("-inf")))
    _require(bool(((got == want) | (got == up) | (got == down)).all()), "bf16 values differ")


def assert_matches_hf(
    out: ProcessedInputs,
    hf_outputs: Mapping[str, Any],
    *,
    fields: Mapping[str, FieldSpec],
    placeholder_token_ids: Mapping[str, int],
    normalised: bool | None = None,
    atol: float = 1e-6,
    check_bf16: bool = True,
    text_keys: Collection[str] = TEXT_OUTPUT_KEYS,
    context: str = "",
) -> None:
    """Assert that ``out`` is what the HF processor gave (``hf_outputs``) for the same request.

    The prompt ids, the placeholder ranges, each item's outputs, and each of
    ``out.prompt_outputs`` that HF also returned.

    Args:
        out: mmproc's result.
        hf_outputs: the HF processor's outputs for the same prompt and media (batch of one).
        fields: the model's field specs (``get_mm_fields``): how each output joins across items.
        placeholder_token_ids: modality -> the token its placeholder expands to; the
            embedding positions of the items' ranges must be exactly the positions of that token
            in the prompt.
        normalised: ``True``: every feature carries a norm spec (device normalisation);
            ``False``: none does; ``None``: not checked. Either way, outputs a feature's spec
            names must be uint8 whose ``FusedInputNorm`` is within ``atol`` of HF's floats (bf16
            output equal or one step away with ``check_bf16``); all others equal exactly.
        text_keys: outputs that belong to the prompt and are not compared per item.
        context: prefixed to failure messages (which request of a series failed).

    Raises:
        AssertionError: the first difference, said with the hook to look at. Raised by ``raise``,
            never by an ``assert`` statement, so the check holds under ``python -O`` (as
            ``mmproc which FOLDER --check`` relies on).
    """
    where = f"{context}: " if context else ""
    ids = torch.as_tensor(hf_outputs["input_ids"])[0].tolist()
    if out.prompt_token_ids != ids:
        raise AssertionError(
            where + describe_prompt_difference(out.prompt_token_ids, ids, placeholder_token_ids)
        )
    offsets = [f.placeholder.offset for f in out.features]
    _require(offsets == sorted(offsets), f"{where}features are not in prompt order")
    for modality in placeholder_token_ids:
        features = [f for f in out.features if f.modality == modality]
        _require(
            [f.item_index for f in features] == list(range(len(features))),
            f"{where}{modality} item indices are {[f.item_index for f in features]}",
        )
    # Each range's embedding positions hold the placeholder token, and together they are every
    # occurrence of it (a range may also hold non-embedding start / end tokens). Modalities may
    # share one token (an image and a video pad alike): their ranges together cover it.
    by_token: dict[int, list[str]] = {}
    for modality, token_id in placeholder_token_ids.items():
        by_token.setdefault(token_id, []).append(modality)
    for token_id, modalities in by_token.items():
        features = [f for f in out.features if f.modality in modalities]
        embedded = [
            offset
            for f in features
            for offset, embeds in enumerate(f.placeholder.embed_mask(), f.placeholder.offset)
            if embeds
        ]
        occurrences = [i for i, token in enumerate(ids) if token == token_id]
        _require(
            embedded == occurrences,
            f"{where}{' and '.join(modalities)} placeholder ranges "
            f"{[(f.placeholder.offset, f.placeholder.length) for f in features]} do not cover "
            f"exactly the {len(occurrences)} positions of token {token_id} in the prompt (runs "
            f"{token_runs(ids, token_id)}): check get_prompt_updates",
        )
    if normalised is not None:
        for feature in out.features:
            _require(
                (feature.norm is not None) is normalised,
                (
                    f"{where}{feature.modality} item {feature.item_index}: norm spec "
                    f"{'missing' if normalised else 'unexpected'}"
                ),
            )
    for key, value in out.prompt_outputs.items():
        # The plugin's per-token outputs of the final prompt: where HF gives one, equal to it.
        if key in hf_outputs:
            want = torch.as_tensor(hf_outputs[key])[0]
            _require(
                torch.as_tensor(value).tolist() == want.tolist(),
                f"{where}prompt output {key!r} differs from HF's: check get_prompt_outputs",
            )
    item_keys = [k for k in hf_outputs if k not in text_keys and k not in out.prompt_outputs]
    for key in item_keys:
        _require(
            key in fields,
            f"{where}HF output {key!r} has no field spec: add it to the get_mm_fields hook",
        )
    for feature in out.features:
        expected = {k for k in item_keys if fields[k].modality == feature.modality}
        _require(
            set(feature.data) == expected,
            (
                f"{where}{feature.modality} item {feature.item_index} has outputs "
                f"{sorted(feature.data)}, HF has {sorted(expected)}"
            ),
        )
    for key in item_keys:
        want = hf_outputs[key]
        spec = fields[key]
        modality = spec.modality
        features = [f for f in out.features if f.modality == modality]
        _require(all(key in f.data for f in features), f"{where}{key!r} missing from a feature")
        values = [torch.as_tensor(f.data[key]) for f in features]
        norms = [f.norm for f in features]
        is_pixels = [n is not None and key in n.pixel_keys for n in norms]
        _require(len(set(is_pixels)) <= 1, f"{where}{key!r} is raw in some items only")
        want = torch.as_tensor(want)
        if not any(is_pixels):
            got = torch.as_tensor(_join(spec, key, values, where))
            _require(got.dtype == want.dtype, f"{where}{key!r} dtype {got.dtype} != {want.dtype}")
            _require(
                got.shape == want.shape,
                f"{where}{key!r} shape {tuple(got.shape)}, HF's {tuple(want.shape)}",
            )
            _require(
                torch.equal(got, want),
                f"{where}{key!r} differs from HF's: check process_mm_data (and get_mm_fields)",
            )
            continue
        _require(all(v.dtype == torch.uint8 for v in values), f"{where}{key!r} is not uint8")
        specs = [n for n in norms if n is not None]
        got = torch.as_tensor(
            _join(
                spec,
                key,
                [FusedInputNorm(n, dtype=torch.float32)(v) for n, v in zip(specs, values)],
                where,
            )
        )
        _require(
            got.shape == want.shape,
            f"{where}{key!r} shape {tuple(got.shape)}, HF's {tuple(want.shape)}",
        )
        error = float((got - want).abs().max()) if got.numel() else 0.0
        _require(
            error <= atol,
            f"{where}{key!r} differs by {error:.3g} after FusedInputNorm: check process_mm_data "
            "(mode.raw_pixels) and device_norm_spec",
        )
        if check_bf16:
            got16 = torch.as_tensor(
                spec.join(key, [FusedInputNorm(n)(v) for n, v in zip(specs, values)])
            )
            assert_bf16_close(got16, want)
