"""An RGB image's pixels read where Pillow holds them, without the copy ``np.asarray`` makes.

Pillow keeps an RGB image as four bytes per pixel (the fourth unused) and, from 11.2, exports an
image held in one memory block through the Arrow C data interface. Reading that memory in place
saves a copy of the whole image (a millisecond or so on a large one) wherever pixels are only
read: a resize that takes channels-last memory, a copy into shared memory for a worker process.
"""

from __future__ import annotations

import ctypes

import numpy as np
from PIL import Image

__all__ = ["rgb_pixels", "rgbx_pixels"]


class _ArrowSchema(ctypes.Structure):
    """``struct ArrowSchema`` of the Arrow C data interface (a stable ABI)."""

    _fields_ = (
        ("format", ctypes.c_char_p),
        ("name", ctypes.c_char_p),
        ("metadata", ctypes.c_char_p),
        ("flags", ctypes.c_int64),
        ("n_children", ctypes.c_int64),
        ("children", ctypes.POINTER(ctypes.c_void_p)),
        ("dictionary", ctypes.c_void_p),
        ("release", ctypes.c_void_p),
        ("private_data", ctypes.c_void_p),
    )


class _ArrowArray(ctypes.Structure):
    """``struct ArrowArray`` of the Arrow C data interface."""


_ArrowArray._fields_ = (
    ("length", ctypes.c_int64),
    ("null_count", ctypes.c_int64),
    ("offset", ctypes.c_int64),
    ("n_buffers", ctypes.c_int64),
    ("n_children", ctypes.c_int64),
    ("buffers", ctypes.POINTER(ctypes.c_void_p)),
    ("children", ctypes.POINTER(ctypes.POINTER(_ArrowArray))),
    ("dictionary", ctypes.c_void_p),
    ("release", ctypes.c_void_p),
    ("private_data", ctypes.c_void_p),
)

# Our own prototype of PyCapsule_GetPointer: setting argtypes on ctypes.pythonapi's shared
# function object would change it for every other user in the process.
_capsule_pointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", ctypes.pythonapi)
)


def rgb_pixels(image: Image.Image) -> tuple[np.ndarray, object]:
    """(H, W, 3) uint8 pixels of an RGB image, and what must stay alive while they are read
    (a view of Pillow's memory where it exports it, see :func:`rgbx_pixels`; else a copy)."""
    pixels, keep_alive = rgbx_pixels(image)
    return pixels[..., :3], keep_alive


def rgbx_pixels(image: Image.Image) -> tuple[np.ndarray, object]:
    """An RGB image's pixels as Pillow holds them, and what must stay alive while they are read:
    (H, W, 4) uint8 with the fourth byte unused, or (H, W, 3) where Pillow does not export them.

    The view is of Pillow's export, ``+w:4`` (four bytes per pixel, the fourth unused) over its
    own memory. Anything else (an image in several blocks, an older Pillow, an unexpected
    layout) is copied instead.
    """
    width, height = image.size
    try:
        schema_capsule, array_capsule = image.__arrow_c_array__()
        schema = _ArrowSchema.from_address(_capsule_pointer(schema_capsule, b"arrow_schema"))
        array = _ArrowArray.from_address(_capsule_pointer(array_capsule, b"arrow_array"))
    except (AttributeError, ValueError):
        return np.array(image), None
    pixels = width * height
    if (
        image.mode != "RGB"
        or schema.format != b"+w:4"
        or schema.n_children != 1
        or (array.length, array.offset, array.null_count, array.n_children) != (pixels, 0, 0, 1)
    ):
        return np.array(image), None
    child = array.children[0].contents
    child_schema = _ArrowSchema.from_address(schema.children[0])
    if (
        child_schema.format != b"C"
        or (child.length, child.offset, child.n_buffers) != (pixels * 4, 0, 2)
        or not child.buffers[1]
    ):
        return np.array(image), None
    memory = (ctypes.c_uint8 * child.length).from_address(child.buffers[1])
    rgbx = np.frombuffer(memory, dtype=np.uint8).reshape(height, width, 4)
    # The capsules release Pillow's reference to the memory when they are collected.
    return rgbx, (schema_capsule, array_capsule, image)
