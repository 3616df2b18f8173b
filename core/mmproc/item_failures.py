"""Which request item made the HF processor fail, when it failed on a batch of them.

The processor runs on every missing item of a request at once, so its exception says little about
which item is at fault. :func:`locate_failing_item` finds out by halving the batch: about the work
of one more batch. When some items pass, the settings are fine and the first failing item is the
culprit (a :class:`~mmproc.errors.MediaItemError` with its index in the request); when every part
fails, the settings are at fault and the original error stands.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from mmproc.errors import MediaItemError, MmprocError

__all__ = ["ItemRef", "locate_failing_item"]

ItemRef = tuple[str, int, Any]
"""``(modality, index in the request, item)`` of one item sent to the processor."""

RunPart = Callable[[Sequence[ItemRef]], BaseException | None]
"""Runs the processor on some of the items; the cause of its failure, or None when it passed."""


def locate_failing_item(
    error: MmprocError, items: Sequence[ItemRef], run: RunPart, *, processor_name: str
) -> MmprocError:
    """The error to report for a processor failure on ``items``.

    ``error`` is the failure on all of them; ``run`` retries a part; ``processor_name`` names the
    processor in the message (e.g. ``"the Qwen2VLForConditionalGeneration processor (plugin
    'qwen_vl')"``). A lone item is named as it is.
    """
    part: Sequence[ItemRef] = items
    cause: BaseException = error.__cause__ or error
    saw_pass = False
    while len(part) > 1:
        half = part[: len(part) // 2]
        failure = run(half)
        if failure is None:
            saw_pass, part = True, part[len(part) // 2 :]
        else:
            cause, part = failure, half
    culprit = part[0]
    if len(items) > 1:
        confirmed = run([culprit])
        if confirmed is None:
            return error  # no single item fails alone: the items only fail together
        cause = confirmed
        if not saw_pass:
            saw_pass = run([ref for ref in items if ref is not culprit]) is None
            if not saw_pass:
                return error  # every part fails: the settings, not an item
    modality, index, _ = culprit
    return MediaItemError(
        modality, index, f"{processor_name} rejects it: {type(cause).__name__}: {cause}"
    )
