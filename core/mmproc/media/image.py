"""Images: PIL images, uint8 arrays and tensors, and encoded images (Pillow) to loaded images.

An image item is a loaded ``PIL.Image.Image`` in its own mode (RGB conversion is the HF
processor's job). Arrays become ``L`` (one channel), ``RGB`` or ``RGBA`` images; a 3-D tensor
whose first dimension is 1, 3 or 4 is read as channels-first (torchvision's convention), numpy
arrays always as channels-last. Encoded images are opened only in the formats allowed
(:data:`IMAGE_FORMATS` by default: Pillow would otherwise also try formats such as EPS, which
hands data to Ghostscript), and every image, encoded or given as an array, is refused over
Pillow's ``Image.MAX_IMAGE_PIXELS``: the limit is about the memory and time a request may cost,
whatever its form. An encoded image is turned upright by its EXIF orientation, as vLLM's image
loader turns it (transformers' processors take the picture as given: a caller who hands one a
PIL image has opened it and oriented it or not).

Part of the decoding recipe (:func:`recipe`): Pillow's version and its codec libraries as loaded.
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from mmproc._torch import is_torch_tensor
from mmproc.media.arrays import is_array, to_numpy
from mmproc.media.items import ENCODED_FORMS, DecodePlan, DecodeSettings
from mmproc.media.policy import MediaOptions
from mmproc.media.problem import MediaProblem, describe
from mmproc.media.sources import read_media_bytes

__all__ = [
    "CHANNELS_TO_MODE",
    "DATA_URL_TYPES",
    "IMAGE_FORMATS",
    "check_pixels",
    "image_bytes",
    "open_image_file",
    "prepare_image",
    "recipe",
]

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

DATA_URL_TYPES: tuple[str, ...] = ("image/",)
"""Media types a ``data:`` URL of an image may have."""

CHANNELS_TO_MODE = {1: "L", 3: "RGB", 4: "RGBA"}
"""The PIL mode of an array image (or video frame) with that many channels."""


def check_pixels(width: int, height: int) -> None:
    """Refuse an image (or video frame) over ``PIL.Image.MAX_IMAGE_PIXELS``."""
    # Read the limit at call time: callers (and tests) may change it.
    limit = Image.MAX_IMAGE_PIXELS
    if limit is not None and width * height > limit:
        raise MediaProblem(
            f"{width}x{height} = {width * height} pixels is over the limit of {limit} "
            "(PIL.Image.MAX_IMAGE_PIXELS); possible decompression bomb"
        )


def image_bytes(image: Image.Image) -> int:
    """The decoded size of an image: its bands times their width (4 bytes for 32-bit modes)."""
    mode = image.mode
    try:
        bands = Image.getmodebands(mode)
    except (KeyError, ValueError):
        bands = 4
    per_band = 4 if mode in ("I", "F") else 2 if mode.startswith("I;16") else 1
    return image.width * image.height * bands * per_band


def prepare_image(raw: Any, settings: DecodeSettings) -> DecodePlan:
    """Check an image given decoded (a PIL image, an array or tensor), or read and open one given
    encoded (a video's frame given as bytes, a path or a URL)."""
    if isinstance(raw, Image.Image):
        check_pixels(*raw.size)
        return DecodePlan(image_bytes(raw), lambda: _load_pil(raw))
    if is_array(raw):
        image = _image_from_array(raw)
        return DecodePlan.done(image, image_bytes(image))
    if isinstance(raw, ENCODED_FORMS):
        data = read_media_bytes(raw, data_url_types=DATA_URL_TYPES, options=settings.media)
        return open_image_file(data, settings)
    raise MediaProblem(
        f"unsupported image type {type(raw).__name__}; expected a PIL image, a uint8 array or "
        "tensor, encoded bytes, a file path, a data: URL or an http(s):// URL"
    )


def open_image_file(data: bytes, settings: DecodeSettings) -> DecodePlan:
    """Parse the header of an encoded image (checked against the pixel limit); decoding its
    pixels is the plan's."""
    opened = _open_image(data, settings.image_formats)
    return DecodePlan(image_bytes(opened), lambda: _load_opened(opened), heavy=True)


def recipe(media: MediaOptions) -> dict[str, Any]:
    """What decides what an encoded image decodes to: Pillow and its codec libraries as loaded
    (they may be built against system ones, so the package version alone does not say). No
    media option changes how an image decodes."""
    from PIL import __version__ as pillow
    from PIL import features

    codecs = {c: features.version_codec(c) for c in ("jpg", "jpg_2000", "zlib", "libtiff")}
    modules = {m: features.version_module(m) for m in ("webp", "avif")}
    return {"pillow": {"version": pillow, **codecs, **modules}}


def _load_pil(image: Image.Image) -> Image.Image:
    try:
        image.load()  # a lazily opened image: read it now so truncation surfaces here
    except Exception as exc:
        raise MediaProblem(f"cannot load the PIL image: {describe(exc)}") from exc
    if image.width == 0 or image.height == 0:
        raise MediaProblem(f"empty image ({image.width}x{image.height})")
    return image


def _image_from_array(raw: Any) -> Image.Image:
    arr = to_numpy(raw)
    if arr.dtype != np.uint8:
        raise MediaProblem(f"image arrays must be uint8, got {arr.dtype}")
    if is_torch_tensor(raw) and arr.ndim == 3 and arr.shape[0] in CHANNELS_TO_MODE:
        arr = arr.transpose(1, 2, 0)  # torch convention: channels first (torchvision)
    if arr.ndim == 2:
        arr = arr[:, :, None]
    if arr.ndim != 3 or arr.shape[2] not in CHANNELS_TO_MODE:
        hint = ""
        if arr.ndim == 3 and arr.shape[0] in CHANNELS_TO_MODE:
            hint = "; numpy images are (H, W, C): transpose a channels-first array"
        raise MediaProblem(
            f"image array shape {tuple(raw.shape)} is not (H, W), (H, W, C) or, for tensors, "
            f"(C, H, W) with C in 1, 3, 4{hint}"
        )
    height, width, channels = arr.shape
    if height == 0 or width == 0:
        raise MediaProblem(f"empty image ({width}x{height})")
    check_pixels(width, height)
    if channels == 1:
        arr = arr[:, :, 0]
    return Image.fromarray(np.ascontiguousarray(arr))


def _open_image(data: bytes, formats: tuple[str, ...] | None) -> Image.Image:
    """Open (parse the header of) encoded image data; the pixels are decoded by
    ``_load_opened``."""
    if not data:
        raise MediaProblem("empty image data (0 bytes)")
    try:
        image = Image.open(io.BytesIO(data), formats=formats)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        # (the warning is raised when warnings are errors)
        raise MediaProblem(f"possible decompression bomb: {exc}") from exc
    except UnidentifiedImageError as exc:
        # Never quote the data: a path may name any readable file, and its head is a secret.
        allowed = f" (allowed formats: {', '.join(formats)})" if formats is not None else ""
        raise MediaProblem(f"cannot identify the image data as an image{allowed}") from exc
    except Exception as exc:
        raise MediaProblem(f"cannot open image: {describe(exc)}") from exc
    # Between 1x and 2x the limit Pillow only warns while opening; enforce 1x, as for arrays.
    check_pixels(*image.size)
    return image


def _load_opened(image: Image.Image) -> Image.Image:
    try:
        image.load()  # decode everything now: truncated or corrupt data fails here, not later
        ImageOps.exif_transpose(image, in_place=True)  # (no copy when there is nothing to do)
    except Exception as exc:
        fmt = image.format or "image"
        raise MediaProblem(f"corrupt or truncated {fmt} data: {describe(exc)}") from exc
    if image.width == 0 or image.height == 0:
        raise MediaProblem(f"empty image ({image.width}x{image.height})")
    return image
