"""Audio files to float32 waveforms (soundfile, PyAV), and waveforms to the model's format (soxr).

Decoding, in two steps like video (the size is known before anything big is allocated):

* WAV, FLAC and Ogg files (recognised by their first bytes, never by a file name) are read with
  soundfile (libsndfile); anything else — MP3, AAC / M4A, Opus or Vorbis in WebM / Matroska, the
  audio track of a video file — with PyAV, through the demuxers in :data:`AUDIO_CONTAINERS` only.
  An Ogg file libsndfile cannot read goes to PyAV too.
* :func:`plan_audio` reads the header: rate, channels, length. Over
  ``MediaLimits.max_audio_seconds`` is refused before decoding; decoding stops at the limit too,
  since a compressed stream's length in its header is an estimate (or a lie).
* :meth:`AudioPlan.decode` returns ``float32`` samples, 1-D for a mono file, channels-first
  ``(channels, samples)`` otherwise.

:func:`convert_audio` then makes any waveform what the model needs (:class:`AudioFormat`):
downmixed to mono by the mean of its channels, resampled with soxr.

A waveform given decoded (``(waveform, sample_rate)``, an :class:`AudioItem`, or the HF datasets'
``{"array", "sampling_rate"}`` dict) must be floating point, 1-D or channels-first 2-D, non-empty
and finite; integer PCM is refused rather than rescaled by a guess. A decoded file's samples are
checked the same way. A file's decoded size, for the request's budget
(``MediaLimits.max_request_decoded_bytes``), is its samples as decoded, at its own rate and
channel count, plus the converted waveform when the conversion makes a new one: a small file of
many channels at a high rate costs what it decodes to, not what it becomes. A compressed file's
length in its header is an estimate, so decoding stops, refused, once it gives more than half as
much again as the header declared (and 2 s).

Part of the decoding recipe (:func:`recipe`): PyAV, FFmpeg's libraries, libsndfile and libsoxr as
loaded, and the format the audio is converted to.
"""

from __future__ import annotations

import abc
import io
import math
from collections.abc import Mapping
from dataclasses import asdict
from typing import Any

import numpy as np

from mmproc.media.arrays import is_array, to_numpy
from mmproc.media.items import AudioItem, DecodePlan, DecodeSettings
from mmproc.media.policy import AudioFormat, MediaLimits, MediaOptions
from mmproc.media.problem import MediaProblem

# soundfile, soxr and PyAV are imported where first needed: a waveform that needs no resampling
# should not cost their imports.

__all__ = [
    "AUDIO_CONTAINERS",
    "DATA_URL_TYPES",
    "AudioPlan",
    "convert_audio",
    "converted_bytes",
    "open_audio_file",
    "plan_audio",
    "prepare_audio",
    "recipe",
]

DATA_URL_TYPES: tuple[str, ...] = ("audio/", "video/")
"""Media types a ``data:`` URL of an audio item may have (a video's audio track is audio)."""

AUDIO_CONTAINERS: tuple[str, ...] = (
    "wav",
    "flac",
    "mp3",
    "aac",
    "ogg",
    # the audio track of a video file (m4a is mp4's demuxer): media.video.VIDEO_CONTAINERS
    "mov",
    "mp4",
    "matroska",
    "webm",
    "avi",
    "mpegts",
)
"""ffmpeg demuxers audio files read with PyAV may be in."""


def _describe(exc: BaseException) -> str:
    # libsndfile's own words, without soundfile's "Error opening <BytesIO at 0x...>:" prefix.
    detail = getattr(exc, "error_string", None) or exc
    return f"{type(exc).__name__}: {detail}"


def _is_soundfile_format(data: bytes) -> bool:
    return (data[:4] == b"RIFF" and data[8:12] == b"WAVE") or data[:4] in (b"fLaC", b"OggS")


def _check_seconds(seconds: float, limits: MediaLimits) -> None:
    limit = limits.max_audio_seconds
    if limit is not None and seconds > limit:
        raise MediaProblem(
            f"{seconds:,.1f} s is over the limit of {limit:g} s (MediaLimits.max_audio_seconds)"
        )


class AudioPlan(abc.ABC):
    """An opened audio file: ``sample_rate``, ``channels`` and ``frames`` (samples per channel;
    for PyAV an estimate from the header) are known; :meth:`decode` decodes."""

    def __init__(self, sample_rate: int, channels: int, frames: int) -> None:
        self.sample_rate = sample_rate
        self.channels = channels
        self.frames = frames

    @abc.abstractmethod
    def decode(self) -> np.ndarray:
        """The samples: float32, 1-D (mono) or ``(channels, samples)``."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the file (``decode`` does it itself)."""


class _SoundfilePlan(AudioPlan):
    def __init__(self, file: Any, limits: MediaLimits) -> None:  # a soundfile.SoundFile
        super().__init__(file.samplerate, file.channels, file.frames)
        # libsndfile reads a WAV whose data chunk runs past the end of the file as a shorter
        # one, noting "data : <size> (should be <less>)" in its log of the header.
        if any(
            line.startswith("data") and "should be" in line for line in file.extra_info.splitlines()
        ):
            file.close()
            raise MediaProblem("truncated: the data chunk runs past the end of the file")
        self._file = file
        limit = limits.max_audio_seconds
        # Read one frame past the limit at most: the header's length cannot make us read more.
        self._max_frames = None if limit is None else math.floor(limit * file.samplerate) + 1
        self._limits = limits

    def decode(self) -> np.ndarray:
        try:
            frames = self.frames if self._max_frames is None else min(self.frames, self._max_frames)
            samples = self._file.read(frames, dtype="float32", always_2d=True)
        except Exception as exc:
            raise MediaProblem(f"cannot decode the audio: {_describe(exc)}") from exc
        finally:
            self.close()
        _check_seconds(samples.shape[0] / self.sample_rate, self._limits)
        if samples.shape[0] == 0:
            raise MediaProblem("the audio file has no samples")
        if samples.shape[0] < frames:
            raise MediaProblem(
                f"truncated: the header promises {frames:,} samples, the file holds "
                f"{samples.shape[0]:,}"
            )
        return _channels_first(samples.T)

    def close(self) -> None:
        self._file.close()


class _PyAVPlan(AudioPlan):
    def __init__(self, container: Any, stream: Any, limits: MediaLimits) -> None:
        rate = stream.codec_context.sample_rate
        seconds = None
        if stream.duration is not None and stream.time_base:
            seconds = float(stream.duration * stream.time_base)
        elif container.duration is not None:
            seconds = container.duration / 1_000_000
        super().__init__(rate, stream.codec_context.channels, round((seconds or 0) * rate))
        self._container = container
        self._stream = stream
        self._limits = limits

    def decode(self) -> np.ndarray:
        limit = self._limits.max_audio_seconds
        max_frames = None if limit is None else math.floor(limit * self.sample_rate) + 1
        # The request's budget counted the header's length: a header that lies short must not
        # let the decoder allocate far past it.
        declared_max = math.ceil(self.frames * 1.5) + 2 * self.sample_rate
        chunks: list[np.ndarray] = []
        total = 0
        try:
            import av

            # Only the sample format changes here (to planar float); soxr does the resampling.
            resampler = av.AudioResampler(format="fltp")
            for frame in self._container.decode(self._stream):
                for out in resampler.resample(frame):
                    chunk = out.to_ndarray()
                    chunks.append(chunk)
                    total += chunk.shape[1]
                if max_frames is not None and total > max_frames:
                    raise MediaProblem(
                        f"it decodes to more than the limit of {limit:g} s "
                        "(MediaLimits.max_audio_seconds)"
                    )
                if total > declared_max:
                    raise MediaProblem(
                        f"it decodes to more than its header declares "
                        f"({self.frames / self.sample_rate:,.1f} s)"
                    )
            for out in resampler.resample(None):
                chunks.append(out.to_ndarray())
        except MediaProblem:
            raise
        except Exception as exc:
            raise MediaProblem(f"cannot decode the audio: {_describe(exc)}") from exc
        finally:
            self.close()
        if not chunks or not sum(c.shape[1] for c in chunks):
            raise MediaProblem("the audio stream has no samples")
        samples = np.concatenate(chunks, axis=1) if len(chunks) > 1 else chunks[0]
        _check_seconds(samples.shape[1] / self.sample_rate, self._limits)
        return _channels_first(samples)

    def close(self) -> None:
        self._container.close()


def _channels_first(samples: np.ndarray) -> np.ndarray:
    samples = samples[0] if samples.shape[0] == 1 else samples
    return np.ascontiguousarray(samples, dtype=np.float32)


def plan_audio(data: bytes, limits: MediaLimits) -> AudioPlan:
    """Open an audio (or video) file and read its header; decode nothing yet.

    Raises:
        MediaProblem: not audio, no audio stream, corrupt, or over
            ``MediaLimits.max_audio_seconds``.
    """
    if not data:
        raise MediaProblem("empty file (0 bytes)")
    plan: AudioPlan
    soundfile_error = ""
    if _is_soundfile_format(data):
        import soundfile

        try:
            plan = _SoundfilePlan(soundfile.SoundFile(io.BytesIO(data)), limits)
        except MediaProblem:
            raise
        except Exception as exc:
            soundfile_error = f"soundfile: {_describe(exc)}"
            if data[:4] != b"OggS":  # Ogg may hold what only ffmpeg decodes (Theora + Vorbis)
                raise MediaProblem(f"cannot open the audio: {soundfile_error}") from exc
        else:
            _check_plan(plan, limits)
            return plan
    from mmproc.media.container import open_container

    try:
        container = open_container(data, AUDIO_CONTAINERS)
    except MediaProblem as exc:
        if soundfile_error:
            raise MediaProblem(f"cannot open the audio: {soundfile_error}; PyAV: {exc}") from exc
        raise
    try:
        streams = container.streams.audio
        if not streams:
            kinds = sorted({s.type for s in container.streams}) or ["none"]
            raise MediaProblem(f"no audio stream in the file (streams: {', '.join(kinds)})")
        if streams[0].codec_context is None:
            raise MediaProblem(f"no decoder for the audio codec {streams[0].codec.name!r}")
        plan = _PyAVPlan(container, streams[0], limits)
        _check_plan(plan, limits)
    except BaseException:
        container.close()
        raise
    return plan


def _check_plan(plan: AudioPlan, limits: MediaLimits) -> None:
    if plan.sample_rate <= 0 or plan.channels <= 0:
        plan.close()
        raise MediaProblem(
            f"the audio has no sample rate or channels ({plan.sample_rate} Hz, "
            f"{plan.channels} channels)"
        )
    try:
        _check_seconds(plan.frames / plan.sample_rate, limits)
    except MediaProblem:
        plan.close()
        raise


def converted_bytes(frames: int, channels: int, sample_rate: int, fmt: AudioFormat) -> int:
    """The size of ``frames`` samples per channel once converted to ``fmt`` (float32)."""
    if fmt.sample_rate is not None and fmt.sample_rate != sample_rate:
        frames = math.ceil(frames * fmt.sample_rate / sample_rate)
    return frames * (1 if fmt.mono else channels) * 4


def convert_audio(
    waveform: np.ndarray, sample_rate: int, fmt: AudioFormat
) -> tuple[np.ndarray, int]:
    """``waveform`` (float32, 1-D or channels-first) at ``sample_rate``, converted to ``fmt``:
    downmixed to 1-D by the channel mean if ``fmt.mono``, resampled with soxr ("HQ") if
    ``fmt.sample_rate`` differs. Returns the waveform itself when nothing changes."""
    if fmt.mono and waveform.ndim == 2:
        waveform = waveform.mean(axis=0, dtype=np.float32)
    rate = sample_rate
    if fmt.sample_rate is not None and fmt.sample_rate != sample_rate:
        import soxr

        rate = fmt.sample_rate
        # soxr takes (samples, channels); ours are channels-first.
        resampled = soxr.resample(waveform.T, sample_rate, rate, quality="HQ")
        waveform = np.ascontiguousarray(resampled.T, dtype=np.float32)
    return np.ascontiguousarray(waveform, dtype=np.float32), rate


# --- the entry points of the decoding contract ------------------------------------------------


def open_audio_file(data: bytes, settings: DecodeSettings) -> DecodePlan:
    """Read an audio file's header (rate, channels, length); decoding and converting it to the
    model's format is the plan's."""
    fmt = settings.media.audio
    plan = plan_audio(data, settings.media.limits)
    decoded = plan.frames * plan.channels * 4  # float32 samples as the file decodes
    converts = (plan.channels > 1 and fmt.mono) or fmt.sample_rate not in (None, plan.sample_rate)
    size = decoded + (
        converted_bytes(plan.frames, plan.channels, plan.sample_rate, fmt) if converts else 0
    )

    def finish() -> AudioItem:
        samples = plan.decode()
        if not np.isfinite(samples).all():
            raise MediaProblem("the audio file decodes to NaN or infinite samples")
        waveform, rate = convert_audio(samples, plan.sample_rate, fmt)
        return AudioItem(waveform, rate)

    return DecodePlan(size, finish, heavy=True, discard=plan.close)


def prepare_audio(raw: Any, settings: DecodeSettings) -> DecodePlan:
    """Check a waveform given decoded; converting it to the model's format is the plan's."""
    fmt = settings.media.audio
    limits = settings.media.limits
    waveform, rate = _validated_audio(raw)
    seconds = waveform.shape[-1] / rate
    if limits.max_audio_seconds is not None and seconds > limits.max_audio_seconds:
        raise MediaProblem(
            f"{seconds:,.1f} s is over the limit of {limits.max_audio_seconds:g} s "
            "(MediaLimits.max_audio_seconds)"
        )
    channels = waveform.shape[0] if waveform.ndim == 2 else 1
    size = converted_bytes(waveform.shape[-1], channels, rate, fmt)
    resamples = fmt.sample_rate is not None and fmt.sample_rate != rate

    def convert() -> AudioItem:
        converted, new_rate = convert_audio(waveform, rate, fmt)
        if isinstance(raw, AudioItem) and converted is raw.waveform and new_rate == rate:
            return raw
        return AudioItem(converted, new_rate)

    return DecodePlan(size, convert, heavy=resamples)


def recipe(media: MediaOptions) -> dict[str, Any]:
    """What decides what an audio file decodes to: the decoding libraries as loaded, and the
    format the audio is converted to."""
    import av
    import soundfile
    import soxr

    return {
        "av": {"version": av.__version__, **av.library_versions},
        "soundfile": [soundfile.__version__, soundfile.__libsndfile_version__],
        "soxr": [soxr.__version__, soxr.__libsoxr_version__],
        "format": asdict(media.audio),
    }


def is_single_audio(obj: Any) -> bool:
    """Whether ``obj`` is one audio item given decoded (not a list of items)."""
    if isinstance(obj, AudioItem | Mapping):
        return True
    return (
        isinstance(obj, tuple | list)
        and len(obj) == 2
        and isinstance(obj[1], int | float | np.integer | np.floating)
        and not isinstance(obj[1], bool)
    )


def _validated_audio(raw: Any) -> tuple[np.ndarray, int]:
    if isinstance(raw, AudioItem):
        waveform, rate = raw.waveform, raw.sample_rate
    elif isinstance(raw, Mapping):
        if "array" not in raw or "sampling_rate" not in raw:
            raise MediaProblem(
                f"audio dicts need 'array' and 'sampling_rate' keys, got {sorted(map(str, raw))}"
            )
        waveform, rate = raw["array"], raw["sampling_rate"]
    elif isinstance(raw, tuple | list) and len(raw) == 2:
        waveform, rate = raw
    else:
        raise MediaProblem(
            f"unsupported audio type {type(raw).__name__}; expected (waveform, sample_rate) or "
            "an audio file (bytes, a path, a data: URL or an http(s):// URL)"
        )
    return _validate_waveform(waveform), _validate_rate(rate)


def _validate_rate(rate: Any) -> int:
    if isinstance(rate, bool) or not isinstance(rate, int | float | np.integer | np.floating):
        raise MediaProblem(f"sample rate must be a number, got {type(rate).__name__}")
    if not float(rate).is_integer() or rate <= 0:
        raise MediaProblem(f"sample rate must be a positive integer, got {rate!r}")
    return int(rate)


def _validate_waveform(waveform: Any) -> np.ndarray:
    if is_array(waveform):
        arr = to_numpy(waveform)
    elif isinstance(waveform, list | tuple):
        arr = np.asarray(waveform)
        if arr.dtype.kind in "iu":  # a Python list of ints is plain numbers, not PCM
            arr = arr.astype(np.float32)
    else:
        raise MediaProblem(
            f"waveform must be a numpy array or tensor, got {type(waveform).__name__}"
        )
    if arr.dtype.kind != "f":
        raise MediaProblem(
            f"waveform must be floating point, got {arr.dtype}"
            + ("; integer PCM must be scaled to [-1, 1] first" if arr.dtype.kind in "iu" else "")
        )
    if arr.ndim not in (1, 2):
        raise MediaProblem(f"waveform shape {arr.shape} is not (samples,) or (channels, samples)")
    if arr.size == 0:
        raise MediaProblem(f"empty audio (waveform shape {arr.shape})")
    if arr.ndim == 2 and arr.shape[0] > arr.shape[1]:
        raise MediaProblem(
            f"waveform shape {arr.shape} looks like (samples, channels); pass (channels, samples)"
        )
    arr = np.ascontiguousarray(arr, dtype=np.float32)  # copies only when needed
    if not np.isfinite(arr).all():
        raise MediaProblem("waveform contains NaN or infinite values")
    return arr
