"""Media files as users send them: reading, fetching, decoding, sampling, converting.

:func:`mmproc.inputs.parse_mm_data` is the entry point; this package holds its machinery, one
concern per module:

``policy``    the settings: :class:`VideoSampling`, :class:`AudioFormat`, :class:`MediaLimits`,
              :class:`RemoteMedia`, bundled as :class:`MediaOptions`; a model's needs as
              :class:`MediaFormat`
``sources``   an item's encoded bytes: bytes, ``data:`` URLs, confined regular files
``fetch``     ``http(s)://`` URLs with httpx: allow-list, public addresses only, limits
``video``     video files with PyAV: frame sampling, decoding only the frames needed
``audio``     audio files with soundfile / PyAV; downmixing and soxr resampling
``problem``   :class:`MediaProblem`, which ``parse_mm_data`` turns into ``MediaItemError``

Importing this package imports only the settings; PyAV, soundfile, soxr and httpx load when a
file or URL first needs them.
"""

from __future__ import annotations

from mmproc.media.policy import (
    ALLOWED_MEDIA_PATHS_ENV,
    DEFAULT_VIDEO_FPS,
    AudioFormat,
    MediaFormat,
    MediaLimits,
    MediaOptions,
    RemoteMedia,
    VideoSampling,
    allowed_media_paths_from_env,
)
from mmproc.media.problem import MediaProblem

__all__ = [
    "ALLOWED_MEDIA_PATHS_ENV",
    "DEFAULT_VIDEO_FPS",
    "AudioFormat",
    "MediaFormat",
    "MediaLimits",
    "MediaOptions",
    "MediaProblem",
    "RemoteMedia",
    "VideoSampling",
    "allowed_media_paths_from_env",
]
