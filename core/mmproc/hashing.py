"""Content hashes of media items and of the processing context.

An item given decoded (a PIL image, an array, a waveform, frames) is hashed over its *parsed*
form (:mod:`mmproc.inputs`), i.e. over pixels and samples (:func:`hash_item`): the same picture as
a PIL image or as a numpy array is one cache entry. An item given *encoded* (bytes, a file, a
``data:`` URL or an http URL) is hashed over its bytes and its *recipe*, everything besides the
bytes that decides what decoding gives: the decoder versions, the video sampling, the audio
format (:func:`hash_encoded`). Both stand for exactly what the model receives; hashing the bytes
lets a cache hit skip decoding altogether, which for a photo costs more than the rest of the hit
(vLLM keys media by their original bytes likewise). One file sent as bytes, as a path, as a
``data:`` URL and as a URL is one entry; the same picture encoded and decoded is two.

The hashed bytes are *framed* so that no two different items can produce the same byte stream:
a format tag, the modality, a type tag, then every variable-length field with a little-endian
``u64`` length prefix — mode and size, palette and transparency for PIL images; dtype, ndim and
shape for arrays; the sample rate for audio — and finally the data. The data is fed to the hasher
in place (array buffers) or streamed in small chunks (PIL images), never copied whole.

A decoded video item (:class:`~mmproc.inputs.VideoItem`) is hashed as what the model receives:
its frames and, for a decoded file, where they sit in time — the sampled frames' timestamps and
indices and the source's frame rate, frame count and duration (processors read these:
Qwen2.5-VL's ``second_per_grid_ts``, transformers' ``VideoMetadata``). Frames given without
metadata hash exactly like the bare array.

A cache key (:func:`item_key`) combines an item's hash with a *context digest*
(:func:`hash_context`): architecture, the model folder's processor configuration and the
processing options, as canonical (sorted-key) JSON. Whatever else changes the processor's output
(the transformers version, say) belongs in ``options``.

Two hash functions over the same framed stream:

* ``"blake3"`` (the default): cryptographic, full 256-bit digests (64 hex digits). In a server,
  requests from different clients share the processor-output cache, and the item hash travels to
  the engine, which keys its own caches (encoder outputs, prefix blocks) on it; a client able to
  craft two items with one hash could make another client's request use its content. Finding a
  BLAKE3-256 collision takes ~2**128 work; ~6 GB/s here.
* ``"xxh3"`` (xxHash3-128, 32 hex digits): non-cryptographic, ~2x faster on large arrays. It
  guards against accidental collisions only: for deployments whose every client is trusted.

The algorithm is a processor option (``hash_algorithm``). Hashes made with one are never compared
with hashes made with the other: keys differ in length, and blake3 context digests frame the
algorithm's name in. The engines one front end feeds should all be fed with the same algorithm.
"""

from __future__ import annotations

import enum
import json
import os
import struct
from collections.abc import Mapping
from typing import Any

import blake3
import numpy as np
import xxhash
from PIL import Image

from mmproc._torch import is_torch_tensor
from mmproc.media.items import AudioItem, VideoItem, VideoMetadata

__all__ = [
    "DEFAULT_HASH_ALGORITHM",
    "HASH_ALGORITHMS",
    "HASH_FORMAT_VERSION",
    "canonical_json",
    "check_hash_algorithm",
    "hash_context",
    "hash_encoded",
    "hash_item",
    "item_key",
]

HASH_FORMAT_VERSION = 1
"""Bumped whenever the framing changes, so old and new hashes never compare equal."""

_ITEM_MAGIC = b"mmproc-item/%d" % HASH_FORMAT_VERSION
_CONTEXT_MAGIC = b"mmproc-context/%d" % HASH_FORMAT_VERSION
_KEY_MAGIC = b"mmproc-key/%d" % HASH_FORMAT_VERSION
_U64 = struct.Struct("<Q")
_F64 = struct.Struct("<d")
# Chunk size for streaming PIL pixels into the hasher: small enough to stay in L2 cache, which is
# what makes streaming ~2x faster than Image.tobytes() (one large buffer, then a join), and large
# enough that the encoder's per-call cost stays small.
_PIL_CHUNK = 1 << 18


HASH_ALGORITHMS = ("blake3", "xxh3")
"""The hash functions items and contexts can be hashed with (the ``hash_algorithm`` option)."""
DEFAULT_HASH_ALGORITHM = "blake3"
"""Cryptographic by default: cache keys are shared between clients (see the module docs)."""

# blake3.blake3() hashes on the calling thread alone unless told otherwise: right here, since
# hashing runs beside the preprocessing workers, which have the cores.
_HASHERS: dict[str, Any] = {"blake3": blake3.blake3, "xxh3": xxhash.xxh3_128}


def check_hash_algorithm(algorithm: object) -> str:
    """``algorithm`` if it names one of `HASH_ALGORITHMS`, else a ``ValueError`` saying which
    names are known."""
    if not isinstance(algorithm, str) or algorithm not in _HASHERS:
        raise ValueError(
            f"unknown hash algorithm {algorithm!r}; expected one of {', '.join(HASH_ALGORITHMS)}"
        )
    return algorithm


def _hasher(algorithm: str) -> Any:
    try:
        return _HASHERS[algorithm]()
    except (KeyError, TypeError):
        check_hash_algorithm(algorithm)
        raise


def _field(h: Any, data: bytes | memoryview) -> None:
    """Feed one length-prefixed field."""
    h.update(_U64.pack(len(data)))
    h.update(data)


def hash_item(modality: str, item: Any, algorithm: str = DEFAULT_HASH_ALGORITHM) -> str:
    """Return the hex content hash of one parsed media item (64 hex digits with blake3, 32 with
    xxh3).

    Args:
        modality: ``"image"``, ``"video"``, ``"audio"`` (any string; it is part of the hash, so a
            one-frame video never shares a hash with an image).
        item: A PIL image, a numpy array (or CPU/GPU torch tensor), a
            :class:`~mmproc.inputs.VideoItem` or an :class:`~mmproc.inputs.AudioItem`.
        algorithm: one of `HASH_ALGORITHMS`.

    Raises:
        TypeError: the item is of another type (parse it with ``parse_mm_data`` first).
        ValueError: ``algorithm`` is not one of `HASH_ALGORITHMS`.
    """
    h = _hasher(algorithm)
    _field(h, _ITEM_MAGIC)
    _field(h, modality.encode())
    if isinstance(item, Image.Image):
        _hash_pil(h, item)
    elif isinstance(item, VideoItem):
        if item.metadata is not None:
            _hash_video_metadata(h, item.metadata)
        _hash_array(h, item.frames)
    elif isinstance(item, AudioItem):
        _field(h, b"audio")
        h.update(_U64.pack(item.sample_rate))
        _hash_array(h, item.waveform)
    elif isinstance(item, np.ndarray):
        _hash_array(h, item)
    elif is_torch_tensor(item):
        _hash_tensor(h, item)
    else:
        raise TypeError(
            f"cannot hash a {type(item).__name__} {modality} item; expected a PIL image, a numpy "
            "array, a torch tensor, a VideoItem or an AudioItem (parse mm_data first)"
        )
    return h.hexdigest()


def hash_encoded(
    modality: str, data: bytes, recipe: bytes, algorithm: str = DEFAULT_HASH_ALGORITHM
) -> str:
    """Return the hex hash of an item given encoded (a file's bytes), as long as
    :func:`hash_item`'s.

    Args:
        modality: as for ``hash_item``.
        data: the encoded bytes, as read.
        recipe: everything besides the bytes that decides what decoding them gives (the decoder
            versions, the video sampling, the audio format), in one canonical form.
        algorithm: one of `HASH_ALGORITHMS`.

    Framed apart from ``hash_item``'s formats: an encoded item never shares a hash with a
    decoded one, though both stand for what the model receives.
    """
    h = _hasher(algorithm)
    _field(h, _ITEM_MAGIC)
    _field(h, modality.encode())
    _field(h, b"encoded")
    _field(h, recipe)
    _field(h, data)
    return h.hexdigest()


def _hash_video_metadata(h: Any, metadata: VideoMetadata) -> None:
    _field(h, b"video-metadata")
    h.update(_F64.pack(metadata.fps))
    h.update(_F64.pack(metadata.duration_s))
    h.update(_U64.pack(metadata.total_frames))
    _field(h, np.asarray(metadata.frame_indices, dtype="<i8").tobytes())
    _field(h, np.asarray(metadata.timestamps_s, dtype="<f8").tobytes())


def _hash_pil(h: Any, image: Image.Image) -> None:
    image.load()
    _field(h, b"pil")
    _field(h, image.mode.encode())
    h.update(_U64.pack(image.width))
    h.update(_U64.pack(image.height))
    # What else changes pixels after convert("RGB"/"RGBA"): the palette and the transparency key.
    palette = b""
    if image.mode in ("P", "PA") and image.palette is not None:
        palette = image.palette.mode.encode() + b":" + bytes(image.getpalette(None) or [])
    _field(h, palette)
    transparency = image.info.get("transparency")
    _field(h, b"" if transparency is None else repr(transparency).encode())
    _field(h, b"raw")
    # Data last, followed (not preceded) by its length: the length is only known once streamed.
    h.update(_U64.pack(_stream_pil_pixels(h, image)))


def _stream_pil_pixels(h: Any, image: Image.Image) -> int:
    """Feed ``image.tobytes()`` to ``h`` chunk by chunk; return the byte count."""
    if image.width == 0 or image.height == 0:
        return 0
    try:
        # The same encoder Image.tobytes() runs, minus its final join. _getencoder is private but
        # has been stable for over a decade; fall back to tobytes() if it ever goes away.
        encoder = Image._getencoder(image.mode, "raw", image.mode)
    except (AttributeError, OSError):
        data = image.tobytes()
        h.update(data)
        return len(data)
    total = 0
    try:
        encoder.setimage(image.im, (0, 0, *image.size))
        bufsize = max(_PIL_CHUNK, image.width * 4)  # the raw encoder needs a whole row
        while True:
            _, status, chunk = encoder.encode(bufsize)
            h.update(chunk)
            total += len(chunk)
            if status:
                break
        if status < 0:
            raise RuntimeError(f"Pillow raw encoder error {status} while hashing")
    finally:
        encoder.cleanup()
    return total


def _hash_array(h: Any, arr: np.ndarray, dtype_tag: str | None = None) -> None:
    _field(h, b"ndarray")
    _field(h, (dtype_tag or arr.dtype.str).encode())
    h.update(_U64.pack(arr.ndim))
    for dim in arr.shape:
        h.update(_U64.pack(dim))
    if arr.dtype.hasobject:
        raise TypeError("cannot hash an object array")
    # C order is part of the format; only a non-contiguous view pays for a copy.
    data = np.ascontiguousarray(arr)
    _field(h, data.reshape(-1).view(np.uint8).data)


def _hash_tensor(h: Any, tensor: Any) -> None:
    import torch

    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    try:
        arr = t.numpy()  # same hash as the equal numpy array
    except TypeError:  # bfloat16 & co. have no numpy dtype: hash the raw bytes, tagged
        raw = t.view(torch.uint8).numpy().reshape((*t.shape, t.element_size()))
        _hash_array(h, raw, dtype_tag=str(t.dtype))
        return
    _hash_array(h, arr)


def _json_default(obj: Any) -> Any:
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, set | frozenset):
        return sorted(obj, key=canonical_json)
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    if isinstance(obj, bytes):
        return {"__bytes__": obj.hex()}
    if isinstance(obj, enum.Enum):
        return obj.value
    if type(obj).__module__ == "torch" and type(obj).__name__ == "dtype":
        return str(obj)
    # repr() would often embed an address (different every run): refuse rather than be unstable.
    raise TypeError(
        f"cannot hash a {type(obj).__name__} in the processing context; pass JSON-like values "
        "(str, int, float, bool, None, lists, dicts with str keys)"
    )


def canonical_json(value: Any) -> str:
    return json.dumps(
        value,
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=False,
        default=_json_default,
    )


def hash_context(
    architecture: str,
    processor_config: Mapping[str, Any],
    options: Mapping[str, Any],
    algorithm: str = DEFAULT_HASH_ALGORITHM,
) -> bytes:
    """Return the digest (32 bytes with blake3, 16 with xxh3) of everything besides the item that
    decides the processor output.

    Args:
        architecture: The model architecture name (``config.json`` ``architectures[0]``).
        processor_config: The model folder's processor configuration (e.g. the merged contents of
            ``preprocessor_config.json`` / ``processor_config.json``).
        options: Processing options (``hf_kwargs``, ``device_normalize``, ...).
        algorithm: one of `HASH_ALGORITHMS`.

    Raises:
        TypeError: a value is not JSON-like (see ``_json_default`` for the extra types accepted:
            numpy scalars and arrays, sets, paths, bytes, enums, torch dtypes) or dict keys mix
            types that cannot be sorted.
    """
    payload = {
        "architecture": architecture,
        "processor_config": dict(processor_config),
        "options": dict(options),
    }
    h = _hasher(algorithm)
    if algorithm != "xxh3":  # xxh3 contexts keep the digests they were first pinned with
        _field(h, algorithm.encode())
    _field(h, _CONTEXT_MAGIC)
    _field(h, canonical_json(payload).encode())
    return h.digest()


def item_key(context_digest: bytes, item_hash: str, algorithm: str = DEFAULT_HASH_ALGORITHM) -> str:
    """Combine a context digest and an item hash into the item's cache key (hex, as long as the
    algorithm's item hashes)."""
    h = _hasher(algorithm)
    _field(h, _KEY_MAGIC)
    _field(h, context_digest)
    _field(h, item_hash.encode())
    return h.hexdigest()
