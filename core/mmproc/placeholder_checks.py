"""Checks that a request's prompt and its media items line up, before updates are applied.

Applying prompt updates already fails for an item that finds no placeholder. These checks catch
the other direction, which would otherwise pass silently and leave unexpanded placeholders in the
prompt: more placeholders than items, and placeholders of a modality the request has no item of.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from typing import Any

from mmproc.errors import PromptUpdateError
from mmproc.prompt_update import ResolvedUpdates

__all__ = [
    "check_placeholder_count",
    "check_prompt",
    "check_unused_placeholders",
    "count_occurrences",
]


def check_prompt(prompt: Any) -> str | list[int]:
    """The prompt as text or a list of token ids; anything else is a :class:`PromptUpdateError`."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, Sequence) and not isinstance(prompt, bytes | bytearray):
        try:
            # operator.index accepts numpy integers and refuses floats and strings
            ids = [operator.index(t) for t in prompt if not isinstance(t, bool)]
        except TypeError:
            ids = None
        if ids is not None and len(ids) == len(prompt) and all(t >= 0 for t in ids):
            return ids
    raise PromptUpdateError(
        f"the prompt must be a string or a sequence of non-negative token ids, "
        f"not {type(prompt).__name__}"
    )


def count_occurrences(ids: Sequence[int], target: Sequence[int]) -> int:
    """Non-overlapping occurrences of ``target`` in ``ids``."""
    target = tuple(target)
    if not target:
        return 0
    if len(target) == 1:
        return list(ids).count(target[0])
    found, i, n = 0, 0, len(target)
    ids = list(ids)
    first = target[0]
    while True:
        try:
            i = ids.index(first, i)
        except ValueError:
            return found
        if tuple(ids[i : i + n]) == target:
            found += 1
            i += n
        else:
            i += 1


def _target_ids(target: Any, tokenizer: Any) -> tuple[int, ...] | None:
    if isinstance(target, str):
        return tuple(tokenizer.encode(target, add_special_tokens=False))
    if isinstance(target, tuple) and all(isinstance(t, int) for t in target):
        return target
    return None  # zero-width index targets


def check_placeholder_count(ids: Sequence[int], resolved: ResolvedUpdates, tokenizer: Any) -> None:
    """More placeholders than items of a modality is an error naming the modality and counts.

    ``resolved`` holds each item's candidate updates. Only a modality whose replacements share
    one target can be counted; with alternative targets the apply step still checks that each
    item finds one.
    """
    for modality, items in resolved.items():
        targets = {
            _target_ids(update.target, tokenizer)
            for candidates in items
            for update in candidates
            if update.kind == "replace"
        }
        targets.discard(None)
        if len(targets) != 1:
            continue
        (target,) = targets
        assert target is not None
        found = count_occurrences(ids, target)
        count = len(items)
        if found > count:
            raise PromptUpdateError(
                f"the prompt has {found} {modality} placeholders but the request has "
                f"{count} {modality} item{'s' if count != 1 else ''}",
                modality=modality,
            )


def check_unused_placeholders(
    ids: Sequence[int], placeholder_ids: Mapping[str, Sequence[int]], counts: Mapping[str, int]
) -> None:
    """A placeholder of a modality the request has no item of is an error.

    ``placeholder_ids`` maps modality to the token ids of the model's placeholder for one item
    (its dummy text for one item, tokenised).
    """
    for modality, placeholder in placeholder_ids.items():
        if counts.get(modality, 0) == 0 and placeholder:
            found = count_occurrences(ids, placeholder)
            if found:
                raise PromptUpdateError(
                    f"the prompt has {found} {modality} placeholder{'s' if found != 1 else ''} "
                    f"but the request has no {modality} items",
                    modality=modality,
                )
