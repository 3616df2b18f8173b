"""Media items: parse, load and validate the ``mm_data`` of a request.

``parse_mm_data({"image": [...], "video": [...], "audio": [...]})`` turns whatever a caller passed
into one canonical, fully loaded form per modality, so that everything after it (hashing, the HF
processor, the cache) sees a single representation whatever the input form was:

``image``
    A loaded ``PIL.Image.Image`` in its own mode (RGB conversion is the HF processor's job).
    Accepted: a PIL image, a ``uint8`` numpy array ``(H, W)`` or ``(H, W, C)`` with ``C`` in
    1, 3, 4, a ``uint8`` torch tensor ``(C, H, W)`` / ``(H, W, C)`` / ``(H, W)``, or an *encoded*
    image (below) in one of :data:`IMAGE_FORMATS`. Arrays become ``L`` (one channel), ``RGB`` or
    ``RGBA`` images. A 3-D tensor whose first dimension is 1, 3 or 4 is read as channels-first
    (torchvision's convention); numpy arrays are always channels-last.
``video``
    A :class:`VideoItem`: ``frames``, a C-contiguous ``uint8`` array ``(T, H, W, C)`` with ``C``
    in 1, 3, 4 — one buffer, so hashing needs no copy and every HF video processor accepts it —
    and ``metadata``, a :class:`VideoMetadata` (source fps, duration, frame count, the sampled
    frames' indices and timestamps) for a decoded video file, ``None`` for frames given as such.
    Accepted:

    * an *encoded* video file (below: mp4, webm, mkv, avi, ... in any container of
      ``media.video.VIDEO_CONTAINERS``, recognised by content, never by file name): decoded
      with PyAV and sampled by ``MediaOptions.video`` (a :class:`~mmproc.media.VideoSampling`:
      2 fps by default), RGB frames;
    * frames already decoded, kept as given (not resampled): such an array, a torch tensor
      ``(T, H, W, C)`` / ``(T, C, H, W)``, or a list of frames, each any image form above. PIL
      frames in modes other than ``L``/``RGB``/``RGBA`` are converted to ``RGB`` (``RGBA`` when
      they carry transparency), since an array has no palette;
    * a ``VideoItem`` (its metadata, if any, must describe as many frames as it has).
``audio``
    An :class:`AudioItem`: a C-contiguous ``float32`` waveform, 1-D (mono) or 2-D channels-first
    ``(channels, samples)``, and an integer sample rate. Accepted: ``(waveform, sample_rate)``, an
    ``AudioItem``, a ``{"array": ..., "sampling_rate": ...}`` dict (the HF datasets layout), or an
    *encoded* audio file (below): WAV, FLAC, Ogg (soundfile), MP3, AAC / M4A, Opus, or the audio
    track of a video file (PyAV); decoded files are 1-D when mono. Integer PCM waveforms are
    rejected rather than rescaled by a guess. Every item, decoded or given, is then converted to
    ``MediaOptions.audio`` (an :class:`~mmproc.media.AudioFormat`: resampled with soxr, downmixed
    by the channel mean; by default kept as it is): what the model receives, and what a
    waveform's hash is of (a file's hash covers its bytes and this format).

*Encoded* items arrive as bytes (``bytes``/``bytearray``/``memoryview``), a local file path
(``str`` or ``os.PathLike``), a base64 ``data:`` URL (``data:image/...``; ``data:video/...``;
``data:audio/...`` or ``data:video/...`` for audio) or, only when ``MediaOptions.remote`` is set,
an ``http://`` / ``https://`` URL (the OpenAI-style ``image_url`` / ``video_url`` /
``audio_url`` parts). Paths must name regular files inside ``MediaOptions.allowed_paths`` (by
default anywhere); URLs are fetched under :class:`~mmproc.media.RemoteMedia`'s policy (allowed
domains, public addresses only, bounded redirects, bytes and time): see
:mod:`mmproc.media.sources` and :mod:`mmproc.media.fetch`.

A single item may stand where a list is expected (``{"image": img}``). For ``video`` a list is a
list of videos unless its first element is a frame (a PIL image or a 2-D/3-D array or tensor), in
which case it is one video; so encoded *files* are listed plainly (``[b"...mp4", "b.webm"]``) and
encoded *frames* (bytes, paths) must be nested: ``[[png0, png1, ...]]``.

Every bad item raises :class:`~mmproc.errors.MediaItemError` naming the modality, the index and
the cause — whatever the input, nothing else escapes (a form nobody foresaw is still a
``MediaItemError``): ``mm_data`` that is not a mapping or has an unknown modality (no index),
unreadable, refused, corrupt or truncated data, images and video frames over Pillow's
``Image.MAX_IMAGE_PIXELS`` (encoded *or* given as arrays — the limit is about the memory and time
a request may cost, whatever its form), wrong dtypes or shapes, empty or non-finite audio, and
every limit of :class:`~mmproc.media.MediaLimits`: bytes per item, read time, video duration and
frames, audio duration, decoded bytes per request. The message names the limit
(``"video item 0: 3,600.5 s is over the limit of 600 s (MediaLimits.max_video_seconds)"``).

Loading runs in steps over all items, so that a request's decoded size is known before anything
big is allocated: first each item is read (an encoded item's bytes: a file, a URL, base64) or
checked (an item given decoded, such as the frames of a video given as frames); then the encoded
items' headers are parsed (image size, the video's sampled frames, the audio's length) and the
sizes added up in item order against ``MediaLimits.max_request_decoded_bytes``; then everything
is decoded. :func:`read_mm_data` stops after the first step and lets the caller decode only some
items (:class:`ReadMediaItems`): the processor keys an encoded item by its bytes and decodes it
only when its cache misses it, so an item the cache answers is never parsed and adds nothing to
the request's decoded size. Each step runs on ``io_pool`` when a request has two or more items
that need IO or decoding; otherwise inline. When several items are bad, ``parse_mm_data`` reports
the first in modality order and index among those failing at the earliest step (reading, then
headers, then the request's size, then decoding), whatever the pool does. Only known raster
formats are opened (:data:`IMAGE_FORMATS`): Pillow would otherwise also try formats such as EPS,
which hands data to Ghostscript.

Security note: the defaults are for library use — any local path is read. A server that takes
``mm_data`` from untrusted clients should pass ``MediaOptions(allowed_paths=...)`` (``()`` to
refuse every path) and keep URL fetching off or allow-listed.
"""

from __future__ import annotations

import difflib
import io
import os
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor, Future, wait
from dataclasses import asdict, dataclass, field
from typing import Any, TypeAlias

import numpy as np
from PIL import Image, UnidentifiedImageError

from mmproc._torch import is_torch_tensor
from mmproc.errors import ConfigurationError, MediaItemError
from mmproc.media.policy import MediaOptions
from mmproc.media.problem import MediaProblem
from mmproc.media.sources import read_media_bytes

__all__ = [
    "DECODING_VERSION",
    "IMAGE_FORMATS",
    "MODALITIES",
    "AudioItem",
    "MediaItem",
    "ParsedMediaItems",
    "ReadMediaItems",
    "VideoItem",
    "VideoMetadata",
    "decoding_recipe",
    "parse_mm_data",
    "read_mm_data",
]

MODALITIES: tuple[str, ...] = ("image", "video", "audio")
"""The modality keys ``mm_data`` may have, in the order items are loaded and errors reported."""

IMAGE_FORMATS: tuple[str, ...] = (
    "AVIF",
    "BMP",
    "GIF",
    "JPEG",
    "JPEG2000",
    "PNG",
    "PPM",
    "TIFF",
    "WEBP",
)
"""Pillow format ids that encoded images may be in (``None`` as ``image_formats`` allows all)."""

DECODING_VERSION = 1
"""Bumped whenever mmproc's own decoding changes what an encoded item decodes to (the frame
sampling rule, a conversion): part of :func:`decoding_recipe`, so of every encoded item's key."""

_CHANNELS_TO_MODE = {1: "L", 3: "RGB", 4: "RGBA"}
_ARRAY_MODES = frozenset(_CHANNELS_TO_MODE.values())
_ENCODED = (bytes, bytearray, memoryview, str, os.PathLike)
_DEFAULT_MEDIA = MediaOptions()


# --- item types ----------------------------------------------------------------------------------


# eq=False: a generated __eq__ would compare arrays elementwise (an ambiguous truth value), and
# __hash__ would hash the array; compare items by content with mmproc.hashing.hash_item instead.
@dataclass(frozen=True, slots=True, eq=False)
class AudioItem:
    """One audio clip: ``waveform`` (float32, 1-D or channels-first 2-D) at ``sample_rate`` Hz.

    The waveform is shared with whoever holds it (cache, processor); treat it as read-only.
    """

    waveform: np.ndarray
    sample_rate: int

    @property
    def num_samples(self) -> int:
        """Samples per channel."""
        return int(self.waveform.shape[-1])

    @property
    def duration_s(self) -> float:
        """Length in seconds."""
        return self.num_samples / self.sample_rate


@dataclass(frozen=True, slots=True)
class VideoMetadata:
    """Where the frames of a decoded video file came from: what processors that take video
    metadata (Qwen2.5-VL's ``second_per_grid_ts``, transformers' ``VideoMetadata``) need.

    Frame indices count the source's frames in presentation order from 0; timestamps are in
    seconds from the first frame (for a variable frame rate they are the frames' own times, not
    ``index / fps``).
    """

    fps: float
    """The source's frame rate: its frame count over its duration."""
    duration_s: float
    """The source's length: from its first frame's timestamp to the end of its last frame."""
    total_frames: int
    """Frames in the source."""
    frame_indices: tuple[int, ...]
    """The source index of each sampled frame (a frame may be sampled twice, see
    ``VideoSampling``)."""
    timestamps_s: tuple[float, ...]
    """The timestamp of each sampled frame, in seconds."""
    width: int
    """Frame width in pixels."""
    height: int
    """Frame height in pixels."""

    @property
    def sampled_fps(self) -> float:
        """Sampled frames per second of video (``len(timestamps_s) / duration_s``)."""
        return len(self.timestamps_s) / self.duration_s if self.duration_s > 0 else self.fps

    def to_transformers(self) -> Any:
        """This metadata as ``transformers.video_utils.VideoMetadata``, for HF video processors
        that take ``video_metadata`` (imports transformers)."""
        from transformers.video_utils import VideoMetadata as HFVideoMetadata

        return HFVideoMetadata(
            total_num_frames=self.total_frames,
            fps=self.fps,
            width=self.width,
            height=self.height,
            duration=self.duration_s,
            video_backend="pyav",
            frames_indices=list(self.frame_indices),
        )


@dataclass(frozen=True, slots=True, eq=False)  # eq=False: as AudioItem
class VideoItem:
    """One video: ``frames``, C-contiguous ``uint8`` ``(T, H, W, C)``, and where they came from
    (``metadata``; ``None`` when the caller gave frames rather than a file).

    The frames are shared with whoever holds them; treat them as read-only.
    """

    frames: np.ndarray
    metadata: VideoMetadata | None = None

    @property
    def num_frames(self) -> int:
        """Frames in the item (``T``)."""
        return int(self.frames.shape[0])


MediaItem: TypeAlias = Image.Image | VideoItem | AudioItem
"""A parsed item: a PIL image (image), a VideoItem (video), an AudioItem (audio)."""

ParsedMediaItems: TypeAlias = dict[str, list[Any]]
"""``parse_mm_data``'s result: modality -> its parsed items, for modalities with at least one."""


# --- entry point ---------------------------------------------------------------------------------


@dataclass(slots=True)
class _Task:
    modality: str
    index: int
    raw: Any


@dataclass(slots=True)
class _Pending:
    """An item whose decoded size is known and whose decoding (``finish``) is still to do."""

    decoded_bytes: int
    finish: Callable[[], Any]
    heavy: bool = False
    discard: Callable[[], None] = field(default=lambda: None)


@dataclass(frozen=True, slots=True)
class _Encoded:
    """An item given encoded, read: its header is parsed only if it is to be decoded."""

    data: bytes


@dataclass(frozen=True, slots=True)
class _Settings:
    formats: tuple[str, ...] | None
    media: MediaOptions


_NOT_DECODED: Any = object()


class ReadMediaItems:
    """A request's media items read and checked, with their decoding still to do: what
    :func:`read_mm_data` returns.

    Every item given decoded (an image, array, waveform, frames) has been checked and sized; every
    item given encoded (bytes, a file, a ``data:`` URL, a URL) has been read, and nothing more:
    :meth:`sources` has its bytes. :meth:`decode` then decodes all items, or only some: the
    processor keys an encoded item by its bytes and decodes it only when its cache misses it, so
    a hit never parses the file. Use it as a context manager (or call :meth:`close`): what was
    opened and not decoded is released on exit.
    """

    def __init__(
        self,
        tasks: list[_Task],
        states: list[_Pending | _Encoded],
        counts: dict[str, int],
        settings: _Settings,
        io_pool: Executor | None,
    ) -> None:
        self._tasks = tasks
        self._states = states
        self._sources = [state.data if isinstance(state, _Encoded) else None for state in states]
        self._counts = counts
        self._settings = settings
        self._io_pool = io_pool
        self._results: list[Any] = [_NOT_DECODED] * len(tasks)
        self._closed = False

    @property
    def counts(self) -> dict[str, int]:
        """Modality -> its number of items, in the order of :data:`MODALITIES`."""
        return dict(self._counts)

    def sources(self) -> dict[str, list[bytes | None]]:
        """Modality -> per item, the encoded bytes it decodes from (bytes, a file, a URL, a
        ``data:`` URL, as read), or ``None`` for an item given decoded."""
        return self._by_modality(self._sources)

    def decode(self, wanted: Callable[[str, int], bool] | None = None) -> dict[str, list[Any]]:
        """Decode the items ``wanted(modality, index)`` selects (every item by default; each is
        decoded once, however often it is asked for) and return modality -> items, each parsed
        item in its canonical form (see :func:`parse_mm_data`), ``None`` for those not decoded
        yet.

        The request's decoded size (``MediaLimits.max_request_decoded_bytes``) counts the items
        given decoded and those decoded, not the encoded ones left undecoded.

        Raises:
            MediaItemError: an item to decode is bad: the first in order among those failing at
                the earliest step (an encoded item's header, then the request's decoded size,
                then decoding; compressed audio's length is an estimate until decoded).
        """
        if self._closed:
            raise RuntimeError("these media items were closed; read them again")
        todo = [
            i
            for i, task in enumerate(self._tasks)
            if self._results[i] is _NOT_DECODED
            and (wanted is None or wanted(task.modality, task.index))
        ]
        try:
            unopened = [i for i in todo if isinstance(self._states[i], _Encoded)]
            opened: list[_Pending] = _run_in_order(
                [self._tasks[i] for i in unopened],
                lambda j: _open(
                    self._tasks[unopened[j]], self._encoded(unopened[j]), self._settings
                ),
                [True] * len(unopened),
                self._io_pool,
                discard=lambda p: p.discard(),
            )
            for i, pending in zip(unopened, opened):
                self._states[i] = pending
            self._check_size()
            decoded = _run_in_order(
                [self._tasks[i] for i in todo],
                lambda j: self._pending(todo[j]).finish(),
                [self._pending(i).heavy for i in todo],
                self._io_pool,
            )
            for i, item in zip(todo, decoded):
                self._results[i] = item
                self._pending(i).discard()
            self._check_size()
        except BaseException:
            self.close()
            raise
        return self._by_modality([None if item is _NOT_DECODED else item for item in self._results])

    def close(self) -> None:
        """Release what was opened for the items not decoded (idempotent)."""
        if not self._closed:
            self._closed = True
            for state in self._states:
                if isinstance(state, _Pending):
                    state.discard()

    def __enter__(self) -> ReadMediaItems:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _encoded(self, i: int) -> bytes:
        state = self._states[i]
        assert isinstance(state, _Encoded)
        return state.data

    def _pending(self, i: int) -> _Pending:
        state = self._states[i]
        assert isinstance(state, _Pending)
        return state

    def _check_size(self) -> None:
        sizes = [
            0
            if isinstance(state, _Encoded)
            else state.decoded_bytes
            if item is _NOT_DECODED
            else _decoded_size(item)
            for state, item in zip(self._states, self._results)
        ]
        limit = self._settings.media.limits.max_request_decoded_bytes
        _check_request_size(self._tasks, sizes, limit)

    def _by_modality(self, values: list[Any]) -> dict[str, list[Any]]:
        out: dict[str, list[Any]] = {}
        pos = 0
        for modality, n in self._counts.items():
            if n:
                out[modality] = values[pos : pos + n]
            pos += n
        return out


def parse_mm_data(
    mm_data: Mapping[str, Any] | None,
    *,
    io_pool: Executor | None = None,
    image_formats: Sequence[str] | None = IMAGE_FORMATS,
    media: MediaOptions | None = None,
) -> ParsedMediaItems:
    """Parse, load and validate a request's media items.

    Args:
        mm_data: ``{"image": ..., "video": ..., "audio": ...}``; each value one item or a list.
            ``None`` or a ``None`` value means no items.
        io_pool: Executor that reads and decodes when two or more items need it; ``None`` decodes
            inline.
        image_formats: Pillow format ids encoded images may be in; ``None`` allows every format
            Pillow knows (not advisable for untrusted input).
        media: How files and URLs are read, decoded, sampled and limited; ``None``:
            ``MediaOptions()`` (any path, no URL fetching, the default limits, audio as it is,
            video at 2 fps).

    Returns:
        Modality -> list of parsed items (see the module docstring for each modality's form), in
        the order of :data:`MODALITIES`; modalities without items are left out.

    Raises:
        MediaItemError: ``mm_data`` is not a mapping, has an unknown modality, or a bad item (its
            modality and index). When several items are bad, the one reported is the first in
            modality order and index among those that fail at the earliest step (reading, then
            headers, then the request's decoded size, then decoding) — whatever the pool does.
        ConfigurationError: ``media`` is not a ``MediaOptions``.
    """
    with read_mm_data(mm_data, io_pool=io_pool, image_formats=image_formats, media=media) as read:
        return read.decode()


def read_mm_data(
    mm_data: Mapping[str, Any] | None,
    *,
    io_pool: Executor | None = None,
    image_formats: Sequence[str] | None = IMAGE_FORMATS,
    media: MediaOptions | None = None,
) -> ReadMediaItems:
    """The first step of :func:`parse_mm_data`: read the bytes of every item given encoded
    and check every item given decoded, parsing and decoding nothing; :meth:`ReadMediaItems.decode`
    does the rest. Arguments as for ``parse_mm_data``; raises its errors of reading and checking
    (the headers, the request's decoded size and decoding are ``decode``'s)."""
    if mm_data is None:
        mm_data = {}
    if not isinstance(mm_data, Mapping):
        raise MediaItemError(
            "mm_data",
            None,
            "mm_data must be a mapping of modality to items, such as {'image': [...]}, not "
            f"{type(mm_data).__name__}",
        )
    for key in mm_data:
        if key not in MODALITIES:
            hint = difflib.get_close_matches(str(key), MODALITIES, n=1)
            did_you_mean = f"; did you mean {hint[0]!r}?" if hint else ""
            raise MediaItemError(
                str(key),
                None,
                f"unknown modality {key!r}; expected one of {', '.join(MODALITIES)}{did_you_mean}",
            )

    if media is not None and not isinstance(media, MediaOptions):
        raise ConfigurationError(
            f"media must be a MediaOptions or None, not {type(media).__name__}"
        )
    settings = _Settings(
        tuple(image_formats) if image_formats is not None else None,
        media if media is not None else _DEFAULT_MEDIA,
    )
    tasks: list[_Task] = []
    counts: dict[str, int] = {}
    for modality in MODALITIES:
        value = mm_data.get(modality)
        if value is None:
            continue
        items = _as_item_list(modality, value)
        counts[modality] = len(items)
        tasks.extend(_Task(modality, index, raw) for index, raw in enumerate(items))

    # Read the encoded items' bytes and check the others; nothing is parsed or decoded yet.
    states: list[_Pending | _Encoded] = _run_in_order(
        tasks,
        lambda i: _read(tasks[i], settings),
        [_reads(task.raw) for task in tasks],
        io_pool,
        discard=lambda state: state.discard() if isinstance(state, _Pending) else None,
    )
    return ReadMediaItems(tasks, states, counts, settings, io_pool)


def _run_in_order(
    tasks: list[_Task],
    step: Callable[[int], Any],
    heavy: list[bool],
    io_pool: Executor | None,
    discard: Callable[[Any], None] | None = None,
) -> list[Any]:
    """``step(i)`` for every ``tasks[i]`` — the heavy ones on ``io_pool`` when there are two or
    more — in order. The first failure in order is raised as a MediaItemError, once the steps
    still running have ended; ``discard`` gets every result that will not be used."""
    futures: dict[int, Future[Any]] = {}
    if io_pool is not None and sum(heavy) >= 2:
        futures = {i: io_pool.submit(step, i) for i in range(len(tasks)) if heavy[i]}
    results: list[Any] = []
    try:
        for i, task in enumerate(tasks):
            try:
                results.append(futures[i].result() if i in futures else step(i))
            except Exception as exc:
                raise _item_error(task, exc) from _cause(exc)
    except BaseException:
        for fut in futures.values():
            fut.cancel()
        wait(futures.values())  # what runs on the pool must not outlive its request
        if discard is not None:
            unused = results + [
                fut.result()
                for i, fut in futures.items()
                if i >= len(results) and not fut.cancelled() and fut.exception() is None
            ]
            for result in unused:
                discard(result)
        raise
    return results


def _cause(exc: Exception) -> BaseException | None:
    return exc.__cause__ if isinstance(exc, MediaProblem) else exc


def _item_error(task: _Task, exc: Exception) -> MediaItemError:
    if isinstance(exc, MediaProblem):
        return MediaItemError(task.modality, task.index, str(exc))
    if isinstance(exc, MemoryError):
        # The allocation failed and was freed: this item is too big, the process is fine.
        return MediaItemError(task.modality, task.index, "ran out of memory while loading it")
    # A form the checks did not foresee: still an error about this item.
    return MediaItemError(task.modality, task.index, f"cannot load it: {type(exc).__name__}: {exc}")


def _check_request_size(tasks: list[_Task], sizes: list[int], limit: int | None) -> None:
    if limit is None:
        return
    total = 0
    for task, size in zip(tasks, sizes):
        total += size
        if total > limit:
            raise MediaItemError(
                task.modality,
                task.index,
                f"its {size:,} decoded bytes bring the request to {total:,}, over the limit of "
                f"{limit:,} (MediaLimits.max_request_decoded_bytes)",
            )


def _decoded_size(item: Any) -> int:
    if isinstance(item, VideoItem):
        return int(item.frames.nbytes)
    if isinstance(item, AudioItem):
        return int(item.waveform.nbytes)
    return _image_bytes(item.mode, item.width, item.height)


def decoding_recipe(modality: str, media: MediaOptions) -> dict[str, Any]:
    """Everything besides its bytes that decides what an encoded item of ``modality`` decodes
    to: mmproc's own decoding (:data:`DECODING_VERSION`), the libraries that decode it as loaded
    (the codec libraries too, not only their Python packages, which may be built against system
    ones), and the sampling (video) or format (audio) it is converted to. Limits, allowed formats
    and paths only refuse items, so they are not part of it. The processor keys encoded items by
    their bytes and this."""
    recipe: dict[str, Any] = {"mmproc": DECODING_VERSION}
    if modality == "image":
        from PIL import __version__ as pillow
        from PIL import features

        codecs = {c: features.version_codec(c) for c in ("jpg", "jpg_2000", "zlib", "libtiff")}
        modules = {m: features.version_module(m) for m in ("webp", "avif")}
        recipe["pillow"] = {"version": pillow, **codecs, **modules}
    if modality in ("video", "audio"):
        import av

        recipe["av"] = {"version": av.__version__, **av.library_versions}
    if modality == "video":
        recipe["sampling"] = asdict(media.video)
    if modality == "audio":
        import soundfile
        import soxr

        recipe["soundfile"] = [soundfile.__version__, soundfile.__libsndfile_version__]
        recipe["soxr"] = [soxr.__version__, soxr.__libsoxr_version__]
        recipe["format"] = asdict(media.audio)
    return recipe


# --- list / single item --------------------------------------------------------------------------


def _is_array(obj: Any) -> bool:
    return isinstance(obj, np.ndarray) or is_torch_tensor(obj)


def _is_frame(obj: Any) -> bool:
    return isinstance(obj, Image.Image) or (_is_array(obj) and obj.ndim in (2, 3))


def _is_single_audio(obj: Any) -> bool:
    if isinstance(obj, AudioItem | Mapping):
        return True
    return (
        isinstance(obj, tuple | list)
        and len(obj) == 2
        and isinstance(obj[1], int | float | np.integer | np.floating)
        and not isinstance(obj[1], bool)
    )


def _as_item_list(modality: str, value: Any) -> list[Any]:
    if modality == "audio":
        if _is_single_audio(value):
            return [value]
    elif modality == "video":
        if isinstance(value, list | tuple) and value and _is_frame(value[0]):
            return [value]  # one video given as a list of frames
    if isinstance(value, list | tuple):
        return list(value)
    return [value]


def _reads(raw: Any) -> bool:
    """Whether reading ``raw`` means IO or decoding (a file, a URL, base64, encoded frames)."""
    if isinstance(raw, bytes | bytearray | memoryview):
        return False
    if isinstance(raw, _ENCODED):
        return True
    return isinstance(raw, list | tuple) and any(isinstance(f, _ENCODED) for f in raw)


_DATA_URL_TYPES = {"image": ("image/",), "video": ("video/",), "audio": ("audio/", "video/")}


def _read(task: _Task, settings: _Settings) -> _Pending | _Encoded:
    if isinstance(task.raw, _ENCODED):
        data_url_types = _DATA_URL_TYPES[task.modality]
        return _Encoded(
            read_media_bytes(task.raw, data_url_types=data_url_types, options=settings.media)
        )
    if task.modality == "image":
        return _prepare_image(task.raw, settings)
    if task.modality == "video":
        return _prepare_video(task.raw, settings)
    return _prepare_audio(task.raw, settings)


def _open(task: _Task, data: bytes, settings: _Settings) -> _Pending:
    """Parse the header of an item given encoded, check it, and say how to decode it."""
    if task.modality == "image":
        return _open_image_file(data, settings)
    if task.modality == "video":
        return _open_video_file(data, settings)
    return _open_audio_file(data, settings)


def _done(item: Any, decoded_bytes: int) -> _Pending:
    return _Pending(decoded_bytes, lambda: item)


# --- images --------------------------------------------------------------------------------------


def _check_pixels(width: int, height: int) -> None:
    # Read the limit at call time: callers (and tests) may change it.
    limit = Image.MAX_IMAGE_PIXELS
    if limit is not None and width * height > limit:
        raise MediaProblem(
            f"{width}x{height} = {width * height} pixels is over the limit of {limit} "
            "(PIL.Image.MAX_IMAGE_PIXELS); possible decompression bomb"
        )


def _image_bytes(mode: str, width: int, height: int) -> int:
    """The decoded size of an image: its bands times their width (4 bytes for 32-bit modes)."""
    try:
        bands = Image.getmodebands(mode)
    except (KeyError, ValueError):
        bands = 4
    per_band = 4 if mode in ("I", "F") else 2 if mode.startswith("I;16") else 1
    return width * height * bands * per_band


def _prepare_image(raw: Any, settings: _Settings) -> _Pending:
    if isinstance(raw, Image.Image):
        _check_pixels(*raw.size)
        return _Pending(_image_bytes(raw.mode, *raw.size), lambda: _load_pil(raw))
    if _is_array(raw):
        image = _image_from_array(raw)
        return _done(image, _image_bytes(image.mode, *image.size))
    if isinstance(raw, _ENCODED):  # a frame of a video given as frames
        data = read_media_bytes(
            raw, data_url_types=_DATA_URL_TYPES["image"], options=settings.media
        )
        return _open_image_file(data, settings)
    raise MediaProblem(
        f"unsupported image type {type(raw).__name__}; expected a PIL image, a uint8 array or "
        "tensor, encoded bytes, a file path, a data: URL or an http(s):// URL"
    )


def _open_image_file(data: bytes, settings: _Settings) -> _Pending:
    opened = _open_image(data, settings.formats)
    return _Pending(
        _image_bytes(opened.mode, *opened.size),
        lambda: _load_opened(opened),
        heavy=True,
    )


def _load_pil(image: Image.Image) -> Image.Image:
    try:
        image.load()  # a lazily opened image: read it now so truncation surfaces here
    except Exception as exc:
        raise MediaProblem(f"cannot load the PIL image: {_describe(exc)}") from exc
    if image.width == 0 or image.height == 0:
        raise MediaProblem(f"empty image ({image.width}x{image.height})")
    return image


def _image_from_array(raw: Any) -> Image.Image:
    arr = _to_numpy(raw)
    if arr.dtype != np.uint8:
        raise MediaProblem(f"image arrays must be uint8, got {arr.dtype}")
    if is_torch_tensor(raw) and arr.ndim == 3 and arr.shape[0] in _CHANNELS_TO_MODE:
        arr = arr.transpose(1, 2, 0)  # torch convention: channels first (torchvision)
    if arr.ndim == 2:
        arr = arr[:, :, None]
    if arr.ndim != 3 or arr.shape[2] not in _CHANNELS_TO_MODE:
        hint = ""
        if arr.ndim == 3 and arr.shape[0] in _CHANNELS_TO_MODE:
            hint = "; numpy images are (H, W, C): transpose a channels-first array"
        raise MediaProblem(
            f"image array shape {tuple(raw.shape)} is not (H, W), (H, W, C) or, for tensors, "
            f"(C, H, W) with C in 1, 3, 4{hint}"
        )
    height, width, channels = arr.shape
    if height == 0 or width == 0:
        raise MediaProblem(f"empty image ({width}x{height})")
    _check_pixels(width, height)
    if channels == 1:
        arr = arr[:, :, 0]
    return Image.fromarray(np.ascontiguousarray(arr))


def _to_numpy(raw: Any) -> np.ndarray:
    if isinstance(raw, np.ndarray):
        return raw
    tensor = raw.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    return tensor.numpy()  # shares memory with a CPU tensor


def _open_image(data: bytes, formats: tuple[str, ...] | None) -> Image.Image:
    """Open (parse the header of) encoded image data; the pixels are decoded by
    ``_load_opened``."""
    if not data:
        raise MediaProblem("empty image data (0 bytes)")
    try:
        image = Image.open(io.BytesIO(data), formats=formats)
    except Image.DecompressionBombError as exc:
        raise MediaProblem(f"possible decompression bomb: {exc}") from exc
    except Image.DecompressionBombWarning as exc:  # raised when warnings are errors
        raise MediaProblem(f"possible decompression bomb: {exc}") from exc
    except UnidentifiedImageError as exc:
        allowed = f" (allowed formats: {', '.join(formats)})" if formats is not None else ""
        raise MediaProblem(
            f"cannot identify image data ({len(data)} bytes, starts {bytes(data[:8])!r}){allowed}"
        ) from exc
    except Exception as exc:
        raise MediaProblem(f"cannot open image: {_describe(exc)}") from exc
    # Between 1x and 2x the limit Pillow only warns while opening; enforce 1x, as for arrays.
    _check_pixels(*image.size)
    return image


def _load_opened(image: Image.Image) -> Image.Image:
    try:
        image.load()  # decode everything now: truncated or corrupt data fails here, not later
    except Exception as exc:
        fmt = image.format or "image"
        raise MediaProblem(f"corrupt or truncated {fmt} data: {_describe(exc)}") from exc
    if image.width == 0 or image.height == 0:
        raise MediaProblem(f"empty image ({image.width}x{image.height})")
    return image


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


# --- video ---------------------------------------------------------------------------------------


def _check_frame_count(count: int, settings: _Settings) -> None:
    limit = settings.media.limits.max_video_frames
    if limit is not None and count > limit:
        raise MediaProblem(
            f"{count:,} frames is over the limit of {limit:,} (MediaLimits.max_video_frames)"
        )


def _prepare_video(raw: Any, settings: _Settings) -> _Pending:
    if isinstance(raw, VideoItem):
        return _prepare_video_item(raw, settings)
    if _is_array(raw):
        frames = _video_from_array(raw)
        _check_frame_count(frames.shape[0], settings)
        return _done(VideoItem(frames), frames.nbytes)
    if isinstance(raw, list | tuple):
        return _prepare_frame_list(raw, settings)
    raise MediaProblem(
        f"unsupported video type {type(raw).__name__}; expected a video file (bytes, a path, a "
        "data: URL or an http(s):// URL), a list of frames or a (T, H, W, C) uint8 array"
    )


def _open_video_file(data: bytes, settings: _Settings) -> _Pending:
    from mmproc.media.video import plan_video  # PyAV loads when a video file first needs it

    plan = plan_video(data, settings.media.video, settings.media.limits)
    try:
        _check_pixels(plan.width, plan.height)
    except MediaProblem:
        plan.close()
        raise
    return _Pending(plan.decoded_bytes, plan.decode, heavy=True, discard=plan.close)


def _prepare_video_item(item: VideoItem, settings: _Settings) -> _Pending:
    frames = _video_from_array(item.frames)
    _check_frame_count(frames.shape[0], settings)
    metadata = item.metadata
    if metadata is not None:
        if not isinstance(metadata, VideoMetadata):
            raise MediaProblem(
                f"VideoItem.metadata must be a VideoMetadata or None, got {type(metadata).__name__}"
            )
        described = {len(metadata.frame_indices), len(metadata.timestamps_s)}
        if described != {frames.shape[0]}:
            raise MediaProblem(
                f"its metadata describes {sorted(described)} frames, its array has "
                f"{frames.shape[0]}"
            )
    same = frames is item.frames
    return _done(item if same else VideoItem(frames, metadata), frames.nbytes)


def _prepare_frame_list(raw: list[Any] | tuple[Any, ...], settings: _Settings) -> _Pending:
    if not raw:
        raise MediaProblem("empty video (no frames)")
    _check_frame_count(len(raw), settings)
    frames: list[_Pending] = []
    for t, frame in enumerate(raw):
        try:
            frames.append(_prepare_image(frame, settings))
        except MediaProblem as exc:
            raise MediaProblem(f"frame {t}: {exc}") from exc.__cause__

    def finish() -> VideoItem:
        arrays: list[np.ndarray] = []
        for t, pending in enumerate(frames):
            try:
                arrays.append(_frame_to_array(pending.finish()))
            except MediaProblem as exc:
                raise MediaProblem(f"frame {t}: {exc}") from exc.__cause__
            if arrays[t].shape != arrays[0].shape:
                raise MediaProblem(
                    f"frame {t} has shape {arrays[t].shape} (H, W, C), frame 0 has "
                    f"{arrays[0].shape}; all frames must match"
                )
        return VideoItem(np.stack(arrays))

    heavy = any(p.heavy for p in frames)
    return _Pending(sum(p.decoded_bytes for p in frames), finish, heavy=heavy)


def _video_from_array(raw: Any) -> np.ndarray:
    if not _is_array(raw):
        raise MediaProblem(f"video frames must be a uint8 array, got {type(raw).__name__}")
    arr = _to_numpy(raw)
    if arr.dtype != np.uint8:
        raise MediaProblem(f"video arrays must be uint8, got {arr.dtype}")
    if arr.ndim != 4:
        raise MediaProblem(f"video array shape {tuple(arr.shape)} is not (T, H, W, C)")
    if is_torch_tensor(raw) and arr.shape[1] in _CHANNELS_TO_MODE:
        arr = arr.transpose(0, 2, 3, 1)  # (T, C, H, W), torch's channels-first convention
    frames, height, width, channels = arr.shape
    if channels not in _CHANNELS_TO_MODE:
        raise MediaProblem(
            f"video array shape {tuple(raw.shape)} is not (T, H, W, C) with C in 1, 3, 4"
        )
    if frames == 0 or height == 0 or width == 0:
        raise MediaProblem(f"empty video (shape {tuple(arr.shape)})")
    _check_pixels(width, height)
    return np.ascontiguousarray(arr)  # no copy when it already is


def _frame_to_array(image: Image.Image) -> np.ndarray:
    if image.mode not in _ARRAY_MODES:
        image = image.convert("RGBA" if image.has_transparency_data else "RGB")
    arr = np.asarray(image)
    return arr[:, :, None] if arr.ndim == 2 else arr


# --- audio ---------------------------------------------------------------------------------------


def _prepare_audio(raw: Any, settings: _Settings) -> _Pending:
    fmt = settings.media.audio
    limits = settings.media.limits
    # Loaded when audio first needs it (soundfile, soxr and PyAV take a while to import).
    from mmproc.media.audio import convert_audio, converted_bytes

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

    return _Pending(size, convert, heavy=resamples)


def _open_audio_file(data: bytes, settings: _Settings) -> _Pending:
    # Loaded when audio first needs it (soundfile, soxr and PyAV take a while to import).
    from mmproc.media.audio import convert_audio, converted_bytes, plan_audio

    fmt = settings.media.audio
    plan = plan_audio(data, settings.media.limits)
    size = converted_bytes(plan.frames, plan.channels, plan.sample_rate, fmt)

    def finish() -> AudioItem:
        waveform, rate = convert_audio(plan.decode(), plan.sample_rate, fmt)
        return AudioItem(waveform, rate)

    return _Pending(size, finish, heavy=True, discard=plan.close)


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
    if _is_array(waveform):
        arr = _to_numpy(waveform)
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
