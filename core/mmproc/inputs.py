"""Reading a request's ``mm_data``: every item read or checked, then decoded on demand.

``parse_mm_data({"image": [...], "video": [...], "audio": [...]})`` turns whatever a caller passed
into one canonical, fully loaded form per modality, so that everything after it (hashing, the HF
processor, the cache) sees a single representation whatever the input form was. The forms, and
what each becomes, are the decoders' (one module per modality, each with its part of the
decoding recipe):

``image`` (:mod:`mmproc.media.image`)
    A loaded ``PIL.Image.Image``. Accepted: a PIL image, a ``uint8`` numpy array ``(H, W)`` or
    ``(H, W, C)`` with ``C`` in 1, 3, 4, a ``uint8`` torch tensor ``(C, H, W)`` / ``(H, W, C)`` /
    ``(H, W)``, or an *encoded* image (below) in one of :data:`IMAGE_FORMATS`.
``video`` (:mod:`mmproc.media.video`)
    A :class:`~mmproc.media.items.VideoItem` (``uint8`` ``(T, H, W, C)`` frames, and
    :class:`~mmproc.media.items.VideoMetadata` when they came from a file). Accepted: an
    *encoded* video file (mp4, webm, mkv, avi, ... recognised by content, never by file name),
    decoded with PyAV and sampled by ``MediaOptions.video`` (2 fps by default); or frames
    already decoded, kept as given: an array or tensor, a list of frames (each any image form),
    or a ``VideoItem``.
``audio`` (:mod:`mmproc.media.audio`)
    An :class:`~mmproc.media.items.AudioItem` (a ``float32`` waveform, 1-D or channels-first, and
    its rate). Accepted: ``(waveform, sample_rate)``, an ``AudioItem``, a ``{"array": ...,
    "sampling_rate": ...}`` dict, or an *encoded* audio file: WAV, FLAC, Ogg (soundfile), MP3,
    AAC / M4A, Opus, or a video file's audio track (PyAV). Every item is then converted to
    ``MediaOptions.audio`` (resampled with soxr, downmixed by the channel mean; by default kept
    as it is).

*Encoded* items arrive as bytes (``bytes``/``bytearray``/``memoryview``), a local file path
(``str`` or ``os.PathLike``), a base64 ``data:`` URL (``data:image/...``; ``data:video/...``;
``data:audio/...`` or ``data:video/...`` for audio) or, only when ``MediaOptions.remote`` is set,
an ``http://`` / ``https://`` URL (the OpenAI-style ``image_url`` / ``video_url`` /
``audio_url`` parts). Paths must name regular files inside ``MediaOptions.allowed_paths`` (by
default anywhere); URLs are fetched under :class:`~mmproc.media.RemoteMedia`'s policy (allowed
domains, public addresses only, bounded redirects, bytes and time): see
:mod:`mmproc.media.sources` and :mod:`mmproc.media.fetch`.

An item given as ``None`` in a list is sent by its id alone (``mm_uuids``), for a cache to
answer; decoding it is an error. A single item may stand where a list is expected
(``{"image": img}``). For ``video`` a list is a
list of videos unless its first element is a frame (a PIL image or a 2-D/3-D array or tensor), in
which case it is one video; so encoded *files* are listed plainly (``[b"...mp4", "b.webm"]``) and
encoded *frames* (bytes, paths) must be nested: ``[[png0, png1, ...]]``.

Every bad item raises :class:`~mmproc.errors.MediaItemError` naming the modality, the index and
the cause — whatever the input, nothing else escapes (a form nobody foresaw is still a
``MediaItemError``): ``mm_data`` that is not a mapping or has an unknown modality (no index),
unreadable, refused, corrupt or truncated data, images and video frames over Pillow's
``Image.MAX_IMAGE_PIXELS``, wrong dtypes or shapes, empty or non-finite audio, and every limit
of :class:`~mmproc.media.MediaLimits`: bytes per item, read time, video duration and frames,
audio duration, decoded bytes per request. The message names the limit (``"video item 0:
3,600.5 s is over the limit of 600 s (MediaLimits.max_video_seconds)"``) and never quotes an
item's bytes.

Reading runs in steps over all items, so that a request's decoded size is known before anything
big is allocated: :func:`read_mm_data` reads each item given encoded (its bytes: a file, a URL,
base64) and checks each item given decoded (sizing it), and returns a :class:`ReadMediaItems`;
its :meth:`~ReadMediaItems.decode` then parses the headers of the encoded items asked for (image
size, the video's sampled frames, the audio's length), adds up the sizes in item order against
``MediaLimits.max_request_decoded_bytes``, and decodes. The processor keys an encoded item by its
bytes and decodes it only when its cache misses it, so an item the cache answers is never
parsed and adds nothing to the request's decoded size. Each step runs on ``io_pool`` when two or
more items need IO or decoding; otherwise inline. When several items are bad, ``parse_mm_data``
reports the first in modality order and index among those failing at the earliest step
(reading, then headers, then the request's size, then decoding), whatever the pool does.

Security note: the defaults are for library use — any local path is read. A server that takes
``mm_data`` from untrusted clients should pass ``MediaOptions(allowed_paths=...)`` (``()`` to
refuse every path) and keep URL fetching off or allow-listed.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from concurrent.futures import Executor, Future, wait
from dataclasses import dataclass
from typing import Any, TypeAlias

from mmproc.errors import ConfigurationError, MediaItemError
from mmproc.media import audio, image, video
from mmproc.media.image import IMAGE_FORMATS
from mmproc.media.items import (
    ENCODED_FORMS,
    MODALITIES,
    AudioItem,
    DecodePlan,
    DecodeSettings,
    VideoItem,
)
from mmproc.media.policy import MediaOptions
from mmproc.media.problem import MediaProblem
from mmproc.media.sources import read_media_bytes

__all__ = [
    "DECODING_VERSION",
    "IMAGE_FORMATS",
    "MODALITIES",
    "ItemRef",
    "ParsedMediaItems",
    "ReadMediaItems",
    "decoding_recipe",
    "parse_mm_data",
    "read_mm_data",
]

DECODING_VERSION = 2
"""Bumped whenever mmproc's own decoding changes what an encoded item decodes to (the frame
sampling rule, a conversion; 2: images get their EXIF orientation): part of
:func:`decoding_recipe`, so of every encoded item's key."""

ParsedMediaItems: TypeAlias = dict[str, list[Any]]
"""``parse_mm_data``'s result: modality -> its parsed items, for modalities with at least one."""

ItemRef: TypeAlias = tuple[str, int]
"""An item of a request: its modality and its index among that modality's items."""

_DEFAULT_MEDIA = MediaOptions()


@dataclass(frozen=True, slots=True)
class _Decoder:
    """One modality's decoder module, by the decoding contract (:mod:`mmproc.media.items`)."""

    prepare: Callable[[Any, DecodeSettings], DecodePlan]  # an item given decoded
    open_file: Callable[[bytes, DecodeSettings], DecodePlan]  # an item given encoded
    recipe: Callable[[MediaOptions], dict[str, Any]]  # its part of the decoding recipe
    data_url_types: tuple[str, ...]


_DECODERS: dict[str, _Decoder] = {
    "image": _Decoder(
        image.prepare_image, image.open_image_file, image.recipe, image.DATA_URL_TYPES
    ),
    "video": _Decoder(
        video.prepare_video, video.open_video_file, video.recipe, video.DATA_URL_TYPES
    ),
    "audio": _Decoder(
        audio.prepare_audio, audio.open_audio_file, audio.recipe, audio.DATA_URL_TYPES
    ),
}


@dataclass(slots=True)
class _Task:
    modality: str
    index: int
    raw: Any


@dataclass(frozen=True, slots=True)
class _Encoded:
    """An item given encoded, read: its header is parsed only if it is to be decoded."""

    data: bytes


@dataclass(frozen=True, slots=True)
class _Absent:
    """An item given as ``None``: the caller names it by an id the cache is to hold."""


_ABSENT = _Absent()


_NOT_DECODED: Any = object()


class ReadMediaItems:
    """A request's media items read and checked, with their decoding still to do: what
    :func:`read_mm_data` returns.

    Every item given decoded (an image, array, waveform, frames) has been checked and sized; every
    item given encoded (bytes, a file, a ``data:`` URL, a URL) has been read, and nothing more:
    :meth:`sources` has its bytes. :meth:`decode` then decodes the items asked for: the processor
    keys an encoded item by its bytes and decodes it only when its cache misses it, so a hit
    never parses the file. Use it as a context manager (or call :meth:`close`): what was opened
    and not decoded is released on exit.
    """

    def __init__(
        self,
        tasks: list[_Task],
        states: list[DecodePlan | _Encoded | _Absent],
        counts: dict[str, int],
        settings: DecodeSettings,
        io_pool: Executor | None,
    ) -> None:
        self._tasks = tasks
        self._states = states
        self._position = {(task.modality, task.index): i for i, task in enumerate(tasks)}
        self._counts = counts
        self._settings = settings
        self._io_pool = io_pool
        self._results: list[Any] = [_NOT_DECODED] * len(tasks)
        self._closed = False

    @property
    def counts(self) -> dict[str, int]:
        """Modality -> its number of items, in the order of :data:`MODALITIES`."""
        return dict(self._counts)

    def refs(self) -> list[ItemRef]:
        """Every item, as ``(modality, index)``, in the order of :data:`MODALITIES` and index."""
        return [(task.modality, task.index) for task in self._tasks]

    def given(self, ref: ItemRef) -> bool:
        """Whether item ``ref`` came with its data (``None`` stands for an item sent by its id
        alone, for the cache to answer)."""
        return not isinstance(self._states[self._position[ref]], _Absent)

    def source(self, ref: ItemRef) -> bytes | None:
        """The encoded bytes item ``ref`` decodes from (bytes, a file, a URL, a ``data:`` URL, as
        read), or ``None`` for an item given decoded."""
        state = self._states[self._position[ref]]
        return state.data if isinstance(state, _Encoded) else None

    def decode(self, refs: Iterable[ItemRef]) -> dict[ItemRef, Any]:
        """Decode the items ``refs`` names (each once, however often it is asked for) and return
        them, each in its canonical form (see :func:`parse_mm_data`).

        The request's decoded size (``MediaLimits.max_request_decoded_bytes``) counts the items
        given decoded and those decoded so far, not the encoded ones left undecoded.

        Raises:
            MediaItemError: an item to decode is bad: the first in order among those failing at
                the earliest step (an encoded item's header, then the request's decoded size,
                then decoding; compressed audio's length is an estimate until decoded).
        """
        if self._closed:
            raise RuntimeError("these media items were closed; read them again")
        wanted = {self._position[ref] for ref in refs}
        todo = [i for i in sorted(wanted) if self._results[i] is _NOT_DECODED]
        for i in todo:
            if isinstance(self._states[i], _Absent):
                task = self._tasks[i]
                raise MediaItemError(
                    task.modality,
                    task.index,
                    "no data was sent for it, only its id, and the cache does not hold it: "
                    "send the item itself",
                )
        try:
            unopened = [i for i in todo if isinstance(self._states[i], _Encoded)]
            opened: list[DecodePlan] = _run_in_order(
                [self._tasks[i] for i in unopened],
                lambda j: self._open(unopened[j]),
                [True] * len(unopened),
                self._io_pool,
                discard=lambda plan: plan.discard(),
            )
            for i, plan in zip(unopened, opened):
                self._states[i] = plan
            self._check_size()
            decoded = _run_in_order(
                [self._tasks[i] for i in todo],
                lambda j: self._plan(todo[j]).decode(),
                [self._plan(i).heavy for i in todo],
                self._io_pool,
            )
            for i, item in zip(todo, decoded):
                self._results[i] = item
                self._plan(i).discard()
            self._check_size()
        except BaseException:
            self.close()
            raise
        return {(self._tasks[i].modality, self._tasks[i].index): self._results[i] for i in wanted}

    def decode_all(self) -> ParsedMediaItems:
        """Decode every item: modality -> its items (see :func:`parse_mm_data`)."""
        decoded = self.decode(self.refs())
        out: ParsedMediaItems = {}
        for ref in self.refs():
            out.setdefault(ref[0], []).append(decoded[ref])
        return out

    def close(self) -> None:
        """Release what was opened for the items not decoded (idempotent)."""
        if not self._closed:
            self._closed = True
            for state in self._states:
                if isinstance(state, DecodePlan):
                    state.discard()

    def __enter__(self) -> ReadMediaItems:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _open(self, i: int) -> DecodePlan:
        state = self._states[i]
        assert isinstance(state, _Encoded)  # only unopened states are opened
        return _DECODERS[self._tasks[i].modality].open_file(state.data, self._settings)

    def _plan(self, i: int) -> DecodePlan:
        state = self._states[i]
        assert isinstance(state, DecodePlan)  # decode() opens every state it decodes first
        return state

    def _check_size(self) -> None:
        sizes = [
            0
            if isinstance(state, _Encoded | _Absent)
            else state.decoded_bytes
            if item is _NOT_DECODED
            else _decoded_size(item)
            for state, item in zip(self._states, self._results)
        ]
        limit = self._settings.media.limits.max_request_decoded_bytes
        _check_request_size(self._tasks, sizes, limit)


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
        return read.decode_all()


def read_mm_data(
    mm_data: Mapping[str, Any] | None,
    *,
    io_pool: Executor | None = None,
    image_formats: Sequence[str] | None = IMAGE_FORMATS,
    media: MediaOptions | None = None,
    max_items: Mapping[str, int] | None = None,
    check_counts: Callable[[Mapping[str, int]], None] | None = None,
) -> ReadMediaItems:
    """The first step of :func:`parse_mm_data`: read the bytes of every item given encoded
    and check every item given decoded, parsing and decoding nothing; :meth:`ReadMediaItems.decode`
    does the rest. Arguments as for ``parse_mm_data``, and ``max_items``: the most items of a
    modality; ``check_counts``: the caller's own checks of the items per modality. Both refuse
    before any file is opened or URL fetched. Raises ``parse_mm_data``'s errors of reading and
    checking (the headers, the request's decoded size and decoding are ``decode``'s)."""
    if mm_data is None:
        mm_data = {}
    if not isinstance(mm_data, Mapping):
        raise MediaItemError(
            "mm_data",
            None,
            "mm_data must be a mapping of modality to items, such as {'image': [...]}, not "
            f"{type(mm_data).__name__}",
        )
    check_modalities(mm_data)
    if media is not None and not isinstance(media, MediaOptions):
        raise ConfigurationError(
            f"media must be a MediaOptions or None, not {type(media).__name__}"
        )
    settings = DecodeSettings(
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
        limit = (max_items or {}).get(modality)
        if limit is not None and len(items) > limit:
            raise MediaItemError(
                modality,
                limit,
                f"more than {limit} {modality} items in one request "
                "(the max_items_per_request option)",
            )
        counts[modality] = len(items)
        tasks.extend(_Task(modality, index, raw) for index, raw in enumerate(items))
    if check_counts is not None:
        check_counts(counts)

    # Read the encoded items' bytes and check the others; nothing is parsed or decoded yet.
    states: list[DecodePlan | _Encoded | _Absent] = _run_in_order(
        tasks,
        lambda i: _read(tasks[i], settings),
        [_reads(task.raw) for task in tasks],
        io_pool,
        discard=lambda state: state.discard() if isinstance(state, DecodePlan) else None,
    )
    return ReadMediaItems(tasks, states, counts, settings, io_pool)


def check_modalities(keys: Collection[Any], what: str = "modality") -> None:
    """Refuse a key of ``mm_data`` (or of ``mm_uuids``: ``what``) that is not a modality, with
    the closest modality as a hint."""
    for key in keys:
        if key not in MODALITIES:
            hint = difflib.get_close_matches(str(key), MODALITIES, n=1)
            did_you_mean = f"; did you mean {hint[0]!r}?" if hint else ""
            raise MediaItemError(
                str(key)[:64],
                None,
                f"unknown {what} {str(key)[:64]!r}; expected one of {', '.join(MODALITIES)}"
                f"{did_you_mean}",
            )


def decoding_recipe(modality: str, media: MediaOptions) -> dict[str, Any]:
    """Everything besides its bytes that decides what an encoded item of ``modality`` decodes
    to: mmproc's own decoding (:data:`DECODING_VERSION`) and the decoder module's part (the
    libraries that decode it as loaded, the sampling or format it is converted to). Limits,
    allowed formats and paths only refuse items, so they are not part of it. The processor keys
    encoded items by their bytes and this."""
    return {"mmproc": DECODING_VERSION, **_DECODERS[modality].recipe(media)}


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
    return image.image_bytes(item)


# --- one item or a list --------------------------------------------------------------------------


def _as_item_list(modality: str, value: Any) -> list[Any]:
    if modality == "audio":
        if audio.is_single_audio(value):
            return [value]
    elif modality == "video":
        if isinstance(value, list | tuple) and value and video.is_frame(value[0]):
            return [value]  # one video given as a list of frames
    if isinstance(value, list | tuple):
        return list(value)
    return [value]


def _reads(raw: Any) -> bool:
    """Whether reading ``raw`` means IO or decoding (a file, a URL, base64, encoded frames)."""
    if isinstance(raw, bytes | bytearray | memoryview):
        return False
    if isinstance(raw, ENCODED_FORMS):
        return True
    return isinstance(raw, list | tuple) and any(isinstance(f, ENCODED_FORMS) for f in raw)


def _read(task: _Task, settings: DecodeSettings) -> DecodePlan | _Encoded | _Absent:
    if task.raw is None:
        return _ABSENT
    decoder = _DECODERS[task.modality]
    if isinstance(task.raw, ENCODED_FORMS):
        return _Encoded(
            read_media_bytes(
                task.raw, data_url_types=decoder.data_url_types, options=settings.media
            )
        )
    return decoder.prepare(task.raw, settings)
