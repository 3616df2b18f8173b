"""Small synthetic media files, encoded with PyAV and soundfile: for tests, benchmarks and plugin
authors who need a real mp4 or mp3 without shipping one.

Frames from :func:`numbered_frames` carry their own index as a flat grey level, so that after a
lossy round trip :func:`frame_number` still says which source frame a decoded frame is — what a
test of frame sampling needs.
"""

from __future__ import annotations

import io
import itertools
from collections.abc import Iterable, Sequence
from fractions import Fraction
from typing import cast

import av
import numpy as np
import soundfile

__all__ = [
    "encode_audio",
    "encode_video",
    "frame_number",
    "numbered_frames",
    "tone",
]

_LEVEL0, _LEVEL_STEP, _LEVELS = 16, 7, 32  # grey levels 16, 23, ..., 233: apart after lossy coding
_SOUNDFILE_FORMATS = {"wav": "WAV", "flac": "FLAC", "ogg": "OGG"}
_PYAV_AUDIO = {  # format -> (ffmpeg muxer, encoder)
    "mp3": ("mp3", "libmp3lame"),
    "m4a": ("ipod", "aac"),
    "aac": ("adts", "aac"),
    "webm": ("webm", "libopus"),
}


def numbered_frames(count: int, width: int = 64, height: int = 48) -> np.ndarray:
    """``count`` RGB frames ``(count, height, width, 3)``; frame ``i`` is flat grey level
    ``16 + 7 * (i % 32)``."""
    levels = _LEVEL0 + _LEVEL_STEP * (np.arange(count) % _LEVELS)
    frames = np.empty((count, height, width, 3), np.uint8)
    frames[:] = levels.astype(np.uint8)[:, None, None, None]
    return frames


def frame_number(frame: np.ndarray) -> int:
    """The index (modulo 32) of a decoded :func:`numbered_frames` frame."""
    return round((float(frame.mean()) - _LEVEL0) / _LEVEL_STEP) % _LEVELS


def tone(seconds: float, sample_rate: int, channels: int = 1, hz: float = 440.0) -> np.ndarray:
    """A float32 sine (amplitude 0.5), 1-D for one channel, else channels-first with each channel
    an octave above the one before."""
    t = np.arange(round(seconds * sample_rate)) / sample_rate
    waves = [0.5 * np.sin(2 * np.pi * hz * 2**c * t) for c in range(channels)]
    out = np.stack(waves).astype(np.float32)
    return out[0] if channels == 1 else out


def encode_video(
    frames: Iterable[np.ndarray],
    *,
    fps: int = 10,
    container: str = "mp4",
    codec: str = "libx264",
    timestamps_s: Sequence[float] | None = None,
    audio: tuple[np.ndarray, int] | None = None,
    options: dict[str, str] | None = None,
) -> bytes:
    """Encode RGB ``frames`` (each ``(H, W, 3)`` uint8) into a ``container`` with ``codec``.

    Args:
        frames: The frames (any iterable: a long clip need not be in memory at once); none
            makes a file whose video stream has no frames.
        fps: The frame rate (the stream's nominal rate when ``timestamps_s`` is given).
        container: An ffmpeg muxer name: ``"mp4"``, ``"webm"``, ``"matroska"``, ``"avi"``, ...
        codec: An ffmpeg encoder: ``"libx264"``, ``"libvpx-vp9"``, ``"mpeg4"``, ...
        timestamps_s: Each frame's presentation time in seconds (a variable frame rate);
            ``None``: ``i / fps``.
        audio: ``(waveform, sample_rate)`` to add as an AAC (Opus in WebM) audio track.
        options: Encoder options, e.g. ``{"g": "10"}`` for a keyframe every 10 frames.
    """
    frames = iter(frames)
    first = next(frames, None)
    height, width = first.shape[:2] if first is not None else (48, 64)
    buf = io.BytesIO()
    out = av.open(buf, "w", format=container)
    stream = cast(av.VideoStream, out.add_stream(codec, rate=fps))
    stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
    if options:
        stream.options = dict[str, object](options)
    if timestamps_s is not None:
        stream.codec_context.time_base = Fraction(1, 1000)
    audio_stream = None
    if audio is not None:
        encoder = "libopus" if container == "webm" else "aac"
        audio_stream = _add_audio_stream(out, encoder, audio[1], np.atleast_2d(audio[0]).shape[0])
    if first is None:
        out.start_encoding()  # the header, with its empty video stream
    for i, frame in enumerate(itertools.chain([first] if first is not None else [], frames)):
        video_frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(frame), format="rgb24")
        if timestamps_s is not None:
            video_frame.pts = round(timestamps_s[i] * 1000)
            video_frame.time_base = Fraction(1, 1000)
        out.mux(stream.encode(video_frame))
    out.mux(stream.encode(None))
    if audio_stream is not None and audio is not None:
        _encode_audio_stream(out, audio_stream, audio[0], audio[1])
    out.close()
    return buf.getvalue()


def _add_audio_stream(
    out: av.container.OutputContainer, encoder: str, rate: int, channels: int
) -> av.AudioStream:
    # Opus encodes at 48 kHz only; the others at the waveform's own rate.
    stream = cast(
        av.AudioStream, out.add_stream(encoder, rate=48000 if encoder == "libopus" else rate)
    )
    stream.layout = "mono" if channels == 1 else "stereo"
    return stream


def _encode_audio_stream(
    out: av.container.OutputContainer, stream: av.AudioStream, waveform: np.ndarray, rate: int
) -> None:
    planar = np.ascontiguousarray(np.atleast_2d(waveform), dtype=np.float32)
    layout = "mono" if planar.shape[0] == 1 else "stereo"
    frame = av.AudioFrame.from_ndarray(planar, format="fltp", layout=layout)
    frame.sample_rate = rate
    frame.pts = 0
    frame.time_base = Fraction(1, rate)
    resampler = av.AudioResampler(
        format=stream.codec_context.format or "fltp",
        layout=layout,
        rate=stream.codec_context.sample_rate,
        frame_size=stream.codec_context.frame_size or None,
    )
    for chunk in [*resampler.resample(frame), *resampler.resample(None)]:
        out.mux(stream.encode(chunk))
    out.mux(stream.encode(None))


def encode_audio(waveform: np.ndarray, sample_rate: int, format: str = "wav") -> bytes:
    """Encode a float32 waveform (1-D, or channels-first with up to 2 channels for the formats
    written with PyAV) as ``"wav"``, ``"flac"``, ``"ogg"`` (Vorbis; soundfile) or ``"mp3"``,
    ``"m4a"``, ``"aac"`` (ADTS), ``"webm"`` (Opus; PyAV)."""
    if format in _SOUNDFILE_FORMATS:
        buf = io.BytesIO()
        samples = waveform if waveform.ndim == 1 else waveform.T
        soundfile.write(buf, samples, sample_rate, format=_SOUNDFILE_FORMATS[format])
        return buf.getvalue()
    muxer, encoder = _PYAV_AUDIO[format]
    buf = io.BytesIO()
    out = av.open(buf, "w", format=muxer)
    stream = _add_audio_stream(out, encoder, sample_rate, np.atleast_2d(waveform).shape[0])
    _encode_audio_stream(out, stream, waveform, sample_rate)
    out.close()
    return buf.getvalue()
