"""``mmproc which FOLDER --check``: load a model's processor and run one request through it.

Beyond the class checks done at lookup (hooks marked, named and declared as the specs say), the
check builds the processor from the folder and, for every modality the model takes, sends one
request of two demo items through the cached path, the HF-expansion path and the HF processor
called directly. The first difference is reported with the hook to look at; agreement is one
line per modality. ``assert_matches_hf`` raises its findings (never an ``assert`` statement), so
the check reports them under ``python -O`` too.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mmproc.errors import MmprocError
from mmproc.processor import ProcessedInputs, Processor

__all__ = ["MANAGED_OPTIONS", "check_model_folder"]


def _differences(a: ProcessedInputs, b: ProcessedInputs) -> str | None:
    if a.prompt_token_ids != b.prompt_token_ids:
        first = next(
            (i for i, (x, y) in enumerate(zip(a.prompt_token_ids, b.prompt_token_ids)) if x != y),
            min(len(a.prompt_token_ids), len(b.prompt_token_ids)),
        )
        return (
            f"prompt ids differ from position {first} (lengths {len(a.prompt_token_ids)} and "
            f"{len(b.prompt_token_ids)}): check get_prompt_updates and get_dummy_text"
        )
    ranges_a = [(f.modality, f.placeholder) for f in a.features]
    ranges_b = [(f.modality, f.placeholder) for f in b.features]
    if ranges_a != ranges_b:
        return "placeholder ranges differ: check get_prompt_updates"
    return None


def _first_problem(
    cached: Processor, expanding: Processor, prompt: str, mm_data: Mapping[str, list[Any]]
) -> str | None:
    """The first way a request differs between the cached path, the HF processor called
    directly and the HF-expansion path, or None."""
    import torch

    from mmproc.testing.conformance import assert_matches_hf, placeholder_token
    from mmproc.testing.media import call_hf_processor

    ((modality, _),) = mm_data.items()
    try:
        out = cached.process(prompt, mm_data)
    except MmprocError as exc:
        return f"the cached path fails: {exc}"
    reference = call_hf_processor(cached.hf_processor, prompt, mm_data)
    token = placeholder_token(out, modality)
    try:
        assert_matches_hf(
            out,
            {k: torch.as_tensor(v) for k, v in reference.items()},
            fields=cached.model.get_mm_fields(cached.ctx, reference),
            placeholder_token_ids={} if token is None else {modality: token},
            atol=1e-5,
        )
    except AssertionError as exc:
        return f"against the HF processor called directly: {exc}"
    try:
        expanded = expanding.process(prompt, mm_data)
    except MmprocError as exc:
        return f"the HF-expansion path fails: {exc}: check get_prompt_updates"
    problem = _differences(out, expanded)
    return None if problem is None else f"cached and HF-expansion paths: {problem}"


# Options the check decides itself, and why.
MANAGED_OPTIONS = {
    "workers": "one worker each",
    "warm_up": "no clones made ahead",
    "hf_prompt_expansion": "both paths are checked",
}


def check_model_folder(folder: Path, **options: Any) -> list[tuple[str, str | None]]:
    """``(modality, problem or None)`` for each modality the model in ``folder`` takes.

    ``options`` are ``get_processor`` options for both processors (``mmproc which --check
    --option KEY=VALUE``), less :data:`MANAGED_OPTIONS`, which the check sets itself.

    Raises:
        ConfigurationError: an option the check sets itself, or one ``get_processor`` refuses.
    """
    from mmproc.demo import demo_item
    from mmproc.errors import ConfigurationError
    from mmproc.factory import get_processor
    from mmproc.testing.media import timed_video

    for managed, how in MANAGED_OPTIONS.items():
        if managed in options:
            raise ConfigurationError(f"mmproc which --check sets {managed} itself ({how})")

    results: list[tuple[str, str | None]] = []
    with (
        get_processor(folder, warm_up=False, workers=1, **options) as cached,
        get_processor(
            folder, warm_up=False, workers=1, hf_prompt_expansion=True, **options
        ) as expanding,
    ):
        for modality in cached.modalities:
            items = [demo_item(modality, seed) for seed in (0, 1)]
            if modality == "video":
                # With their times, as a file's frames come: some models write them into
                # the prompt, and refuse frames without them.
                items = [timed_video(frames) for frames in items]
            placeholders = cached.model.get_dummy_text(cached.ctx, {modality: 2})
            prompt = f"Compare {placeholders} please."
            mm_data = {modality: items}
            results.append((modality, _first_problem(cached, expanding, prompt, mm_data)))
    return results
