"""Media items: parse, load and validate the ``mm_data`` of a request.

``parse_mm_data({"image": [...], "video": [...], "audio": [...]})`` turns whatever a caller passed
into one canonical, fully loaded form per modality, so that everything after it (hashing, the HF
processor, the cache) sees a single representation whatever the input form was:

``image``
    A loaded ``PIL.Image.Image`` in its own mode (RGB conversion is the HF processor's job).
    Accepted: a PIL image, a ``uint8`` numpy array ``(H, W)`` or ``(H, W, C)`` with ``C`` in
    1, 3, 4, a ``uint8`` torch tensor ``(C, H, W)`` / ``(H, W, C)`` / ``(H, W)``, encoded bytes
    (``bytes``/``bytearray``/``memoryview``), a file path (``str`` or ``os.PathLike``) or a base64
    ``data:image/...`` URL. Arrays become ``L`` (one channel), ``RGB`` or ``RGBA`` images. A 3-D
    tensor whose first dimension is 1, 3 or 4 is read as channels-first (torchvision's
    convention); numpy arrays are always channels-last.
``video``
    A C-contiguous ``uint8`` numpy array ``(T, H, W, C)`` with ``C`` in 1, 3, 4 — one buffer, so
    hashing needs no copy and every HF video processor accepts it. Accepted: such an array (or a
    torch tensor ``(T, H, W, C)`` / ``(T, C, H, W)``), or a list of frames, each frame any image
    form above. PIL frames in modes other than ``L``/``RGB``/``RGBA`` are converted to ``RGB``
    (``RGBA`` when they carry transparency), since an array has no palette. Video files are not
    decoded.
``audio``
    An :class:`AudioItem`: a C-contiguous ``float32`` waveform, 1-D (mono) or 2-D channels-first
    ``(channels, samples)``, and an integer sample rate. Accepted: ``(waveform, sample_rate)``, an
    ``AudioItem``, or a ``{"array": ..., "sampling_rate": ...}`` dict (the HF datasets layout).
    Integer PCM is rejected rather than rescaled by a guess.

A single item may stand where a list is expected (``{"image": img}``). For ``video`` a list is a
list of videos unless its first element is a frame (a PIL image or a 2-D/3-D array or tensor), in
which case it is one video; encoded frames (bytes, paths) must be nested: ``[[b0, b1, ...]]``.

Every bad item raises :class:`~mmproc.errors.MediaItemError` naming the modality, the index and the
cause: unknown modality (no index), unreadable, corrupt or truncated data, images over Pillow's
``Image.MAX_IMAGE_PIXELS`` (encoded *or* passed as arrays — the limit is about the memory and time
a request may cost, whatever its form), wrong dtypes or shapes, empty or non-finite audio, remote
URLs.

Decoding runs on ``io_pool`` when a request has two or more items that need reading or decoding;
otherwise inline. Only known raster formats are opened (:data:`IMAGE_FORMATS`): Pillow would
otherwise also try formats such as EPS, which hands data to Ghostscript.

Security note: file paths are read as given. A server that takes ``mm_data`` from untrusted clients
must filter paths before calling this (or not let paths through at all).
"""

from __future__ import annotations

import base64
import binascii
import difflib
import io
import os
import re
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from typing import Any, TypeAlias

import numpy as np
from PIL import Image, UnidentifiedImageError

from mmproc._torch import is_torch_tensor
from mmproc.errors import MediaItemError

__all__ = [
    "IMAGE_FORMATS",
    "MODALITIES",
    "AudioItem",
    "MediaItem",
    "ParsedMediaItems",
    "parse_mm_data",
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

_CHANNELS_TO_MODE = {1: "L", 3: "RGB", 4: "RGBA"}
_ARRAY_MODES = frozenset(_CHANNELS_TO_MODE.values())
# "scheme://..." — anything that looks like a URL rather than a local path.
_URL_RE = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


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


MediaItem: TypeAlias = Image.Image | np.ndarray | AudioItem
"""A parsed item: a PIL image (image), a uint8 ``(T, H, W, C)`` array (video), an AudioItem."""

ParsedMediaItems: TypeAlias = dict[str, list[Any]]
"""``parse_mm_data``'s result: modality -> its parsed items, for modalities with at least one."""


class _ItemProblem(Exception):
    """Raised inside loaders; turned into a MediaItemError once modality and index are known."""


# --- entry point ---------------------------------------------------------------------------------


def parse_mm_data(
    mm_data: Mapping[str, Any] | None,
    *,
    io_pool: Executor | None = None,
    image_formats: Sequence[str] | None = IMAGE_FORMATS,
) -> ParsedMediaItems:
    """Parse, load and validate a request's media items.

    Args:
        mm_data: ``{"image": ..., "video": ..., "audio": ...}``; each value one item or a list.
            ``None`` or a ``None`` value means no items.
        io_pool: Executor that reads and decodes when two or more items need it; ``None`` decodes
            inline.
        image_formats: Pillow format ids encoded images may be in; ``None`` allows every format
            Pillow knows (not advisable for untrusted input).

    Returns:
        Modality -> list of parsed items (see the module docstring for each modality's form), in
        the order of :data:`MODALITIES`; modalities without items are left out.

    Raises:
        MediaItemError: an unknown modality or a bad item (its modality and index). When
            several items are bad, the first in modality order and index is reported.
        TypeError: ``mm_data`` is not a mapping.
    """
    if mm_data is None:
        return {}
    if not isinstance(mm_data, Mapping):
        raise TypeError(f"mm_data must be a mapping of modality to items, not {type(mm_data)!r}")
    for key in mm_data:
        if key not in MODALITIES:
            hint = difflib.get_close_matches(str(key), MODALITIES, n=1)
            did_you_mean = f"; did you mean {hint[0]!r}?" if hint else ""
            raise MediaItemError(
                str(key),
                None,
                f"unknown modality {key!r}; expected one of {', '.join(MODALITIES)}{did_you_mean}",
            )

    formats = tuple(image_formats) if image_formats is not None else None
    # One task per item; "heavy" tasks read files or decode, and may go to the pool.
    tasks: list[tuple[str, int, Callable[[], Any], bool]] = []
    counts: dict[str, int] = {}
    for modality in MODALITIES:
        value = mm_data.get(modality)
        if value is None:
            continue
        items = _as_item_list(modality, value)
        counts[modality] = len(items)
        for index, raw in enumerate(items):
            loader, heavy = _make_loader(modality, raw, formats)
            tasks.append((modality, index, loader, heavy))

    results: list[Any] = [None] * len(tasks)
    n_heavy = sum(1 for *_, heavy in tasks if heavy)
    futures: dict[int, Future[Any]] = {}
    if io_pool is not None and n_heavy >= 2:
        futures = {
            i: io_pool.submit(loader) for i, (_, _, loader, heavy) in enumerate(tasks) if heavy
        }
    try:
        # Walk in order so the error reported is deterministic: the first bad item.
        for i, (modality, index, loader, _) in enumerate(tasks):
            try:
                results[i] = futures[i].result() if i in futures else loader()
            except _ItemProblem as exc:
                raise MediaItemError(modality, index, str(exc)) from exc.__cause__
            except MemoryError:
                raise
            except Exception as exc:
                # A form the checks above did not foresee: still an error about this item.
                raise MediaItemError(
                    modality, index, f"cannot load it: {type(exc).__name__}: {exc}"
                ) from exc
    except BaseException:
        for fut in futures.values():
            fut.cancel()
        raise

    out: ParsedMediaItems = {}
    pos = 0
    for modality, n in counts.items():
        if n:
            out[modality] = results[pos : pos + n]
        pos += n
    return out


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


# --- per-modality loaders ------------------------------------------------------------------------


def _make_loader(
    modality: str, raw: Any, formats: tuple[str, ...] | None
) -> tuple[Callable[[], Any], bool]:
    """Return a zero-argument loader for one item and whether it reads or decodes (is heavy)."""
    if modality == "image":
        return (lambda: _load_image(raw, formats)), _needs_decoding(raw)
    if modality == "video":
        heavy = isinstance(raw, list | tuple) and any(_needs_decoding(f) for f in raw)
        return (lambda: _load_video(raw, formats)), heavy or _needs_decoding(raw)
    return (lambda: _load_audio(raw)), False


def _needs_decoding(raw: Any) -> bool:
    return isinstance(raw, bytes | bytearray | memoryview | str | os.PathLike)


def _check_pixels(width: int, height: int) -> None:
    # Read the limit at call time: callers (and tests) may change it.
    limit = Image.MAX_IMAGE_PIXELS
    if limit is not None and width * height > limit:
        raise _ItemProblem(
            f"{width}x{height} = {width * height} pixels is over the limit of {limit} "
            "(PIL.Image.MAX_IMAGE_PIXELS); possible decompression bomb"
        )


def _load_image(raw: Any, formats: tuple[str, ...] | None) -> Image.Image:
    if isinstance(raw, Image.Image):
        _check_pixels(*raw.size)
        try:
            raw.load()  # a lazily opened image: read it now so truncation surfaces here
        except Exception as exc:
            raise _ItemProblem(f"cannot load the PIL image: {_describe(exc)}") from exc
        if raw.width == 0 or raw.height == 0:
            raise _ItemProblem(f"empty image ({raw.width}x{raw.height})")
        return raw
    if _is_array(raw):
        return _image_from_array(raw)
    if isinstance(raw, bytes | bytearray | memoryview):
        return _decode_image(bytes(raw) if isinstance(raw, memoryview) else raw, formats)
    if isinstance(raw, str):
        if raw.startswith("data:"):
            return _decode_image(_decode_data_url(raw), formats)
        if _URL_RE.match(raw):
            scheme = raw.split(":", 1)[0]
            raise _ItemProblem(
                f"{scheme}:// URLs are not supported; fetch the data and pass the bytes, "
                "a local path or a data: URL"
            )
        return _decode_image(_read_file(raw), formats)
    if isinstance(raw, os.PathLike):
        return _decode_image(_read_file(raw), formats)
    raise _ItemProblem(
        f"unsupported image type {type(raw).__name__}; expected a PIL image, a uint8 array or "
        "tensor, encoded bytes, a file path or a data: URL"
    )


def _image_from_array(raw: Any) -> Image.Image:
    arr = _to_numpy(raw)
    if arr.dtype != np.uint8:
        raise _ItemProblem(f"image arrays must be uint8, got {arr.dtype}")
    if is_torch_tensor(raw) and arr.ndim == 3 and arr.shape[0] in _CHANNELS_TO_MODE:
        arr = arr.transpose(1, 2, 0)  # torch convention: channels first (torchvision)
    if arr.ndim == 2:
        arr = arr[:, :, None]
    if arr.ndim != 3 or arr.shape[2] not in _CHANNELS_TO_MODE:
        hint = ""
        if arr.ndim == 3 and arr.shape[0] in _CHANNELS_TO_MODE:
            hint = "; numpy images are (H, W, C): transpose a channels-first array"
        raise _ItemProblem(
            f"image array shape {tuple(raw.shape)} is not (H, W), (H, W, C) or, for tensors, "
            f"(C, H, W) with C in 1, 3, 4{hint}"
        )
    height, width, channels = arr.shape
    if height == 0 or width == 0:
        raise _ItemProblem(f"empty image ({width}x{height})")
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


def _read_file(path: str | os.PathLike[str]) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError as exc:
        raise _ItemProblem(f"no such file: {os.fspath(path)!r}") from exc
    except IsADirectoryError as exc:
        raise _ItemProblem(f"is a directory, not a file: {os.fspath(path)!r}") from exc
    except OSError as exc:
        raise _ItemProblem(f"cannot read {os.fspath(path)!r}: {_describe(exc)}") from exc


def _decode_data_url(url: str) -> bytes:
    header, sep, payload = url.partition(",")
    if not sep:
        raise _ItemProblem("malformed data: URL (no ',' before the data)")
    params = header[len("data:") :].split(";")
    media_type = params[0].strip().lower()
    if not media_type.startswith("image/"):
        raise _ItemProblem(f"data: URL media type {media_type or '(none)'!r} is not image/*")
    if "base64" not in (p.strip().lower() for p in params[1:]):
        raise _ItemProblem("data: URLs must be base64-encoded (';base64,')")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise _ItemProblem(f"invalid base64 in data: URL: {exc}") from exc


def _decode_image(data: bytes | bytearray, formats: tuple[str, ...] | None) -> Image.Image:
    if not data:
        raise _ItemProblem("empty image data (0 bytes)")
    try:
        image = Image.open(io.BytesIO(data), formats=formats)
    except Image.DecompressionBombError as exc:
        raise _ItemProblem(f"possible decompression bomb: {exc}") from exc
    except Image.DecompressionBombWarning as exc:  # raised when warnings are errors
        raise _ItemProblem(f"possible decompression bomb: {exc}") from exc
    except UnidentifiedImageError as exc:
        allowed = f" (allowed formats: {', '.join(formats)})" if formats is not None else ""
        raise _ItemProblem(
            f"cannot identify image data ({len(data)} bytes, starts {bytes(data[:8])!r}){allowed}"
        ) from exc
    except Exception as exc:
        raise _ItemProblem(f"cannot open image: {_describe(exc)}") from exc
    # Between 1x and 2x the limit Pillow only warns while opening; enforce 1x, as for arrays.
    _check_pixels(*image.size)
    try:
        image.load()  # decode everything now: truncated or corrupt data fails here, not later
    except Exception as exc:
        fmt = image.format or "image"
        raise _ItemProblem(f"corrupt or truncated {fmt} data: {_describe(exc)}") from exc
    if image.width == 0 or image.height == 0:
        raise _ItemProblem(f"empty image ({image.width}x{image.height})")
    return image


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _load_video(raw: Any, formats: tuple[str, ...] | None) -> np.ndarray:
    if _is_array(raw):
        return _video_from_array(raw)
    if isinstance(raw, list | tuple):
        if not raw:
            raise _ItemProblem("empty video (no frames)")
        frames: list[np.ndarray] = []
        for t, frame in enumerate(raw):
            try:
                frames.append(_frame_to_array(_load_image(frame, formats)))
            except _ItemProblem as exc:
                raise _ItemProblem(f"frame {t}: {exc}") from exc.__cause__
            if frames[t].shape != frames[0].shape:
                raise _ItemProblem(
                    f"frame {t} has shape {frames[t].shape} (H, W, C), frame 0 has "
                    f"{frames[0].shape}; all frames must match"
                )
        return np.stack(frames)
    if isinstance(raw, bytes | bytearray | memoryview | str | os.PathLike):
        raise _ItemProblem(
            "encoded video files are not decoded here; pass the frames (a list of images, "
            "or a (T, H, W, C) uint8 array)"
        )
    raise _ItemProblem(
        f"unsupported video type {type(raw).__name__}; expected a list of frames or a "
        "(T, H, W, C) uint8 array"
    )


def _video_from_array(raw: Any) -> np.ndarray:
    arr = _to_numpy(raw)
    if arr.dtype != np.uint8:
        raise _ItemProblem(f"video arrays must be uint8, got {arr.dtype}")
    if arr.ndim != 4:
        raise _ItemProblem(f"video array shape {tuple(arr.shape)} is not (T, H, W, C)")
    if is_torch_tensor(raw) and arr.shape[1] in _CHANNELS_TO_MODE:
        arr = arr.transpose(0, 2, 3, 1)  # (T, C, H, W), torch's channels-first convention
    frames, height, width, channels = arr.shape
    if channels not in _CHANNELS_TO_MODE:
        raise _ItemProblem(
            f"video array shape {tuple(raw.shape)} is not (T, H, W, C) with C in 1, 3, 4"
        )
    if frames == 0 or height == 0 or width == 0:
        raise _ItemProblem(f"empty video (shape {tuple(arr.shape)})")
    _check_pixels(width, height)
    return np.ascontiguousarray(arr)  # no copy when it already is


def _frame_to_array(image: Image.Image) -> np.ndarray:
    if image.mode not in _ARRAY_MODES:
        image = image.convert("RGBA" if image.has_transparency_data else "RGB")
    arr = np.asarray(image)
    return arr[:, :, None] if arr.ndim == 2 else arr


def _load_audio(raw: Any) -> AudioItem:
    if isinstance(raw, AudioItem):
        waveform, rate = raw.waveform, raw.sample_rate
    elif isinstance(raw, Mapping):
        if "array" not in raw or "sampling_rate" not in raw:
            raise _ItemProblem(
                f"audio dicts need 'array' and 'sampling_rate' keys, got {sorted(map(str, raw))}"
            )
        waveform, rate = raw["array"], raw["sampling_rate"]
    elif isinstance(raw, tuple | list) and len(raw) == 2:
        waveform, rate = raw
    else:
        raise _ItemProblem(
            f"unsupported audio type {type(raw).__name__}; expected (waveform, sample_rate)"
        )
    return AudioItem(_validate_waveform(waveform), _validate_rate(rate))


def _validate_rate(rate: Any) -> int:
    if isinstance(rate, bool) or not isinstance(rate, int | float | np.integer | np.floating):
        raise _ItemProblem(f"sample rate must be a number, got {type(rate).__name__}")
    if not float(rate).is_integer() or rate <= 0:
        raise _ItemProblem(f"sample rate must be a positive integer, got {rate!r}")
    return int(rate)


def _validate_waveform(waveform: Any) -> np.ndarray:
    if _is_array(waveform):
        arr = _to_numpy(waveform)
    elif isinstance(waveform, list | tuple):
        arr = np.asarray(waveform)
        if arr.dtype.kind in "iu":  # a Python list of ints is plain numbers, not PCM
            arr = arr.astype(np.float32)
    else:
        raise _ItemProblem(
            f"waveform must be a numpy array or tensor, got {type(waveform).__name__}"
        )
    if arr.dtype.kind != "f":
        raise _ItemProblem(
            f"waveform must be floating point, got {arr.dtype}"
            + ("; integer PCM must be scaled to [-1, 1] first" if arr.dtype.kind in "iu" else "")
        )
    if arr.ndim not in (1, 2):
        raise _ItemProblem(f"waveform shape {arr.shape} is not (samples,) or (channels, samples)")
    if arr.size == 0:
        raise _ItemProblem(f"empty audio (waveform shape {arr.shape})")
    if arr.ndim == 2 and arr.shape[0] > arr.shape[1]:
        raise _ItemProblem(
            f"waveform shape {arr.shape} looks like (samples, channels); pass (channels, samples)"
        )
    arr = np.ascontiguousarray(arr, dtype=np.float32)  # copies only when needed
    if not np.isfinite(arr).all():
        raise _ItemProblem("waveform contains NaN or infinite values")
    return arr
