"""An image's pixels read where Pillow holds them, and an image made over memory that is
already there, without the copies ``np.asarray`` and ``Image.frombytes`` make.

Pillow keeps an RGB image as four bytes per pixel (the fourth unused) and, from 11.2, exports an
image held in one memory block through the Arrow C data interface, and makes an image over
memory another exports the same way. Reading that memory in place saves a copy of the whole
image (a millisecond or so on a large one) wherever pixels are only read: a resize that takes
channels-last memory, a copy into shared memory for a worker process, and the image a worker
process reads out of that shared memory (:func:`borrowed_image`).
"""

from __future__ import annotations

import ctypes

import numpy as np
from PIL import Image

__all__ = ["borrowed_image", "rgb_pixels", "rgbx_pixels", "still_borrowed"]


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

# Our own prototypes of PyCapsule_GetPointer and PyCapsule_New: setting argtypes on
# ctypes.pythonapi's shared function objects would change them for every other user in the
# process.
_capsule_pointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", ctypes.pythonapi)
)
_capsule_new = ctypes.PYFUNCTYPE(
    ctypes.py_object, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p
)(("PyCapsule_New", ctypes.pythonapi))

# The bytes per pixel of each mode's Pillow storage that borrowed_image takes.
_BORROWABLE = {"L": 1, "RGB": 4, "RGBA": 4}

# The memory of every borrowed image still alive, by the address of its array's capsule.
_lent: dict[int, _LentPixels] = {}


def _capsule_gone(address: int, lent: dict[int, _LentPixels] = _lent) -> None:
    lent.pop(address, None)  # bound at definition: it may run while the interpreter exits


def _released(address: int, offset: int) -> None:
    ctypes.c_void_p.from_address(address + offset).value = None  # "released", as the spec says


_Callback = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
# The callbacks live for good: any capsule or struct still alive may call them.
_callbacks = (
    _Callback(_capsule_gone),
    _Callback(lambda address: _released(address, _ArrowSchema.release.offset)),
    _Callback(lambda address: _released(address, _ArrowArray.release.offset)),
)
_CAPSULE_GONE, _RELEASE_SCHEMA, _RELEASE_ARRAY = (
    ctypes.cast(callback, ctypes.c_void_p).value for callback in _callbacks
)


class _LentPixels:
    """Memory lent to one image: the Arrow structs that describe it as one flat uint8 array,
    and an export of the buffer, which keeps it mapped (a shared block cannot be unmapped
    while an export is open) for as long as the image holds it."""

    def __init__(self, memory: memoryview) -> None:
        self.token = 0
        self.data = (ctypes.c_char * memory.nbytes).from_buffer(memory)
        self.schema = _ArrowSchema(format=b"C", name=b"", release=_RELEASE_SCHEMA)
        self.buffers = (ctypes.c_void_p * 2)(None, ctypes.addressof(self.data))
        self.array = _ArrowArray(
            length=memory.nbytes,
            n_buffers=2,
            buffers=ctypes.cast(self.buffers, ctypes.POINTER(ctypes.c_void_p)),
            release=_RELEASE_ARRAY,
        )

    def __arrow_c_array__(self, requested_schema: object = None) -> tuple[object, object]:
        # Pillow keeps a reference to the array's capsule for the image's life (it reads the
        # structs only while it makes the image): the capsule's destructor ends the loan.
        schema = _capsule_new(ctypes.addressof(self.schema), b"arrow_schema", None)
        array = _capsule_new(ctypes.addressof(self.array), b"arrow_array", _CAPSULE_GONE)
        self.token = id(array)
        _lent[self.token] = self
        return schema, array


def borrowed_image(
    memory: memoryview, mode: str, size: tuple[int, int]
) -> tuple[Image.Image, int] | None:
    """A read-only image of ``mode`` and ``size`` whose pixels are ``memory`` itself, laid out
    as Pillow keeps them (one byte a pixel for ``L``; four for ``RGB``, the fourth unused, and
    for ``RGBA``), and a token for :func:`still_borrowed`; None where Pillow cannot make one
    (before 11.2, another mode or layout, read-only memory): copy the pixels then.

    ``memory`` stays mapped while the image holds it. Whoever writes to it again must first
    know the image is gone (:func:`still_borrowed`), or the image's pixels change under it.
    """
    width, height = size
    if (
        memory.readonly
        or mode not in _BORROWABLE
        or memory.nbytes != width * height * _BORROWABLE[mode]
        or not hasattr(Image, "fromarrow")
    ):
        return None
    lent = _LentPixels(memory)
    try:
        image = Image.fromarrow(lent, mode, size)
    except Exception:  # a Pillow that takes this layout otherwise, or not at all: copy
        return None
    return image, lent.token


def still_borrowed(token: int) -> bool:
    """Whether the image :func:`borrowed_image` gave with ``token`` still holds its memory."""
    return token in _lent


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
