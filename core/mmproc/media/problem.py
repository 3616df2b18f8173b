"""The one exception the media machinery raises on purpose."""

from __future__ import annotations

__all__ = ["MediaProblem", "describe"]


class MediaProblem(Exception):
    """Something is wrong with one media item; the message says what (and which limit).

    Raised by the functions of :mod:`mmproc.media`, which do not know the item's modality and
    index; ``parse_mm_data`` turns it into a :class:`~mmproc.errors.MediaItemError` that does.
    """


def describe(exc: BaseException) -> str:
    """An exception from a decoding library as ``"Type: message"``, for a MediaProblem's text."""
    return f"{type(exc).__name__}: {exc}"
