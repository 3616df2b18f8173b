"""Opening media containers with PyAV, only with the demuxers a caller names."""

from __future__ import annotations

import io
from typing import Any

import av

from mmproc.media.problem import MediaProblem, describe

__all__ = ["open_container"]


def open_container(data: bytes, formats: tuple[str, ...]) -> Any:
    """Open ``data`` with PyAV, allowing only the demuxers named in ``formats``: probing every
    format ffmpeg knows would let playlists such as HLS open other files and URLs."""
    if not data:
        raise MediaProblem("empty file (0 bytes)")
    # Never quote the data in a refusal: a path may name any readable file.
    try:
        return av.open(
            io.BytesIO(data),
            container_options={"format_whitelist": ",".join(formats), "fflags": "+genpts"},
        )
    except av.error.ArgumentError as exc:
        raise MediaProblem(f"not a supported container (allowed: {', '.join(formats)})") from exc
    except Exception as exc:
        raise MediaProblem(f"cannot open it: {describe(exc)}") from exc
