"""A call's items and outputs between the serving process and a worker process, in shared memory.

The items go as their arrays (an image in mode ``L``, ``RGB`` or ``RGBA`` as its pixels, a
video's frames, an audio waveform; any other item pickled), the per-item outputs as their
tensors, each copied once into the block (or made there: :mod:`mmproc.output_memory`) and once
out of it (or not out of it: the outputs blocks of :mod:`mmproc.lent_blocks`). Each worker has
two blocks of its own, one for items and one for outputs, made by the serving process and kept
from call to call: a new block costs a page fault per page written, more than the copy itself. A
block too small for a call is replaced by a larger one (outputs that do not fit come back once
in a block of the call's own, and the next call finds a block their size); a call larger than
``KEPT_BLOCK_MAX`` goes in blocks of its own, so a rare large video does not hold that much
shared memory for as long as the worker lives. A block's memory is reserved when it is made, so
shared memory that runs out fails the request with a ``WorkerProcessError`` instead of killing a
process with SIGBUS. The serving process unlinks a worker's own blocks when the worker stops,
and a call's own (``mmproc_<serving pid>_<call>_in`` / ``_out``) once the call ends, its worker
answered or stopped; a worker unlinks an outputs block it made for a call it then failed.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import itertools
import logging
import os
import pickle
import secrets
from collections.abc import Mapping
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory
from typing import Any

import numpy as np

from mmproc.errors import WorkerProcessError
from mmproc.output_memory import OutputArena, aligned

__all__ = [
    "KEPT_BLOCK_MAX",
    "AttachedBlocks",
    "KeptBlock",
    "Where",
    "call_block_names",
    "drop_block",
    "new_call_block",
    "read_items",
    "read_outputs",
    "release_block",
    "write_items",
    "write_outputs",
]

logger = logging.getLogger(__name__)

KEPT_BLOCK_MAX = 64 << 20  # bytes: the largest block a worker keeps from call to call
_GROWTH = 1.25  # a worker's block made for a call has this much room for larger ones to come


# Call names: the pid, a token drawn once (a stale block of a dead process that had this pid
# cannot collide), a counter (drawing random bytes for every call costs a system call).
_SESSION = secrets.token_hex(4)
_CALLS = itertools.count()


def call_block_names() -> tuple[str, str]:
    """The names of one call's own blocks, items and outputs: unique, and known to the serving
    process before either exists, so it can unlink what a stopped worker left."""
    call = f"mmproc_{os.getpid()}_{_SESSION}{next(_CALLS)}"
    return f"{call}_in", f"{call}_out"


def _allocated(name: str, size: int) -> SharedMemory:
    """A new block of ``size`` bytes with its memory reserved now: shared memory that runs out
    (a container's small /dev/shm) fails here, not as a SIGBUS that kills whichever process
    first writes a page nobody can give it. Where reserving is not supported (no
    ``posix_fallocate``, a file system without it), the block is made without.

    Raises:
        WorkerProcessError: no block of that size could be made.
    """
    try:
        block = SharedMemory(name=name, create=True, size=size)
    except OSError as exc:
        raise WorkerProcessError(f"no shared memory block of {size:,} bytes: {exc}") from exc
    try:
        os.posix_fallocate(block._fd, 0, size)  # type: ignore[attr-defined]
    except (AttributeError, OSError) as exc:
        if isinstance(exc, AttributeError) or exc.errno in (errno.EOPNOTSUPP, errno.EINVAL):
            return block  # nothing to reserve with: the block works, unreserved
        drop_block(block)
        raise WorkerProcessError(f"no shared memory for {size:,} bytes: {exc}") from exc
    except BaseException:
        drop_block(block)
        raise
    return block


def new_call_block(name: str, size: int) -> SharedMemory:
    """A block for one call: kept out of this process's resource tracker, as the serving process
    unlinks it (at the latest when the call ends)."""
    block = _allocated(name, max(size, 1))
    resource_tracker.unregister(block._name, "shared_memory")  # type: ignore[attr-defined]
    return block


def release_block(name: str | None) -> None:
    """Unlink a shared block if it is still there. A failure (no file descriptor left) is
    logged, not raised: it runs where another error may be on its way to the caller."""
    if name is None:
        return
    try:
        block = SharedMemory(name=name)
        block.close()
        block.unlink()
    except FileNotFoundError:
        pass
    except OSError as exc:
        logger.warning("shared memory block %s could not be unlinked: %s", name, exc)


# Blocks whose mapping a view still holds (a copy cut short by an error, an image a plugin kept):
# closed once the view is gone. Dropped instead, each would report its BufferError on stderr
# when it is collected.
_still_viewed: list[SharedMemory] = []


def _unmap(block: SharedMemory) -> None:
    """Close this process's mapping of a block; where a view of it is still open, the mapping
    goes when the view does (tried again at each later unmap)."""
    for viewed in list(_still_viewed):
        with contextlib.suppress(BufferError):
            viewed.close()
            _still_viewed.remove(viewed)
    try:
        block.close()
    except BufferError:
        _still_viewed.append(block)


def drop_block(block: SharedMemory | None) -> None:
    """Unmap and unlink a block this process has open."""
    if block is None:
        return
    _unmap(block)
    try:
        block.unlink()
    except FileNotFoundError:
        pass
    except OSError as exc:  # as in release_block: logged, so the error on its way stays the one
        logger.warning("shared memory block %s could not be unlinked: %s", block.name, exc)


class KeptBlock:
    """A worker's block of one direction, made by the serving process and used call after call;
    left in the resource tracker, so that it is unlinked even if the serving process dies."""

    def __init__(self, worker_index: int, role: str) -> None:
        self._prefix = f"mmproc_{os.getpid()}_w{worker_index}"
        self._role = role
        self.block: SharedMemory | None = None

    def fitted(self, needed: int) -> SharedMemory | None:
        """The block, replaced by a larger one if it holds less than ``needed`` bytes; None when
        ``needed`` is more than a worker keeps (the call makes a block of its own)."""
        if needed > KEPT_BLOCK_MAX:
            return None
        if self.block is None or self.block.size < needed:
            size = min(KEPT_BLOCK_MAX, max(needed + 1, int(needed * _GROWTH)))
            name = f"{self._prefix}_{secrets.token_hex(4)}_{self._role}"
            fresh = _allocated(name, size)
            drop_block(self.block)
            self.block = fresh
        return self.block

    def drop(self) -> None:
        drop_block(self.block)
        self.block = None


class AttachedBlocks:
    """The worker's mappings of the serving process's blocks, by role and name: a block is
    mapped once, and unmapped when the serving process says it dropped it (:meth:`forget`), or
    when a role has more blocks mapped than it has room for (the serving process names a new
    one in place of one it dropped). ``outputs``: the outputs blocks a worker writes to in turn
    (its own, and those lent to outputs)."""

    def __init__(self, outputs: int = 1) -> None:
        self._room = {"in": 1, "out": outputs}
        self._blocks: dict[str, collections.OrderedDict[str, SharedMemory]] = {}

    def __call__(self, role: str, name: str) -> SharedMemory:
        mapped = self._blocks.setdefault(role, collections.OrderedDict())
        block = mapped.get(name)
        if block is not None:
            mapped.move_to_end(name)
            return block
        # Opening registers it with the resource tracker the worker shares with the serving
        # process: the serving process's unlink unregisters it.
        block = mapped[name] = SharedMemory(name=name)
        while len(mapped) > self._room.get(role, 1):
            _unmap(mapped.popitem(last=False)[1])
        return block

    def forget(self, names: list[str]) -> None:
        """Unmap the blocks ``names`` (the serving process dropped them)."""
        for mapped in self._blocks.values():
            for name in names:
                block = mapped.pop(name, None)
                if block is not None:
                    _unmap(block)


# Where a call's items or outputs lie: (block name, whether it is one the worker keeps, bytes
# used), or None when there is no array to hold.
Where = tuple[str, bool, int] | None


def write_items(
    items: Mapping[str, list[Any]], inbox: KeptBlock, call_name: str
) -> tuple[Where, list[Any]]:
    """The items' pixels and samples written to shared memory (an image as its array when that
    is all it is; anything else pickled): the worker's items block, or one of the call's own
    (``call_name``) when they are more than a worker keeps; where they lie, and how to rebuild
    each item."""
    from PIL import Image

    from mmproc.media.items import AudioItem, VideoItem
    from mmproc.media.pillow_pixels import rgbx_pixels
    from mmproc.media.video import ARRAY_MODES

    arrays: list[np.ndarray] = []
    described: list[Any] = []
    keep_alive: list[object] = []  # what the views of Pillow's memory need until copied
    offset = 0

    def place(array: np.ndarray) -> tuple[str, tuple[int, ...], int]:
        nonlocal offset
        offset = aligned(offset)
        arrays.append(np.ascontiguousarray(array))
        at = offset
        offset += array.nbytes
        return str(array.dtype), tuple(array.shape), at

    for modality, values in items.items():
        entries: list[tuple[Any, ...]] = []
        for value in values:
            if (
                isinstance(value, Image.Image)
                and value.mode in ARRAY_MODES
                and not value.info.get("transparency")
            ):
                # An RGB image goes as Pillow holds it, four bytes a pixel, where Pillow
                # exports that memory: one copy, where np.asarray would make another to drop
                # the fourth byte. Otherwise (several memory blocks) the copy rgbx_pixels made.
                if value.mode == "RGB":
                    pixels, alive = rgbx_pixels(value)
                    keep_alive.append(alive)
                    raw_mode = "RGBX" if pixels.shape[-1] == 4 else "RGB"
                    entries.append(("image", ("RGB", raw_mode), *place(pixels)))
                else:
                    entries.append(("image", (value.mode, value.mode), *place(np.asarray(value))))
            elif isinstance(value, VideoItem):
                entries.append(("video", value.metadata, *place(value.frames)))
            elif isinstance(value, AudioItem):
                entries.append(("audio", value.sample_rate, *place(value.waveform)))
            else:
                entries.append(("pickle", pickle.dumps(value)))
        described.append((modality, entries))
    if not arrays:
        return None, described
    kept = inbox.fitted(offset)
    block = kept if kept is not None else new_call_block(call_name, offset)
    try:
        position = 0
        for _, entries in described:
            for entry in entries:
                if entry[0] == "pickle":
                    continue
                _, _, dtype, shape, at = entry
                view = np.ndarray(shape, np.dtype(dtype), buffer=block.buf, offset=at)
                view[...] = arrays[position]
                del view
                position += 1
    finally:
        if kept is None:
            _unmap(block)  # unlinked once the call ends
    return (block.name, kept is not None, offset), described


def read_items(
    attached: AttachedBlocks, at: Where, described: list[Any], borrowed: list[int] | None = None
) -> dict[str, list[Any]]:
    """The items a worker was sent, copied out of shared memory (the block is used again); given
    ``borrowed``, the images in the worker's kept block are made over its memory instead, where
    Pillow can (:func:`~mmproc.media.pillow_pixels.borrowed_image`), and their tokens added to
    it: the block must not be written again while one of them is alive."""
    from PIL import Image

    from mmproc.media.items import AudioItem, VideoItem
    from mmproc.media.pillow_pixels import borrowed_image

    block = None if at is None else attached("in", at[0]) if at[1] else SharedMemory(name=at[0])
    lend = borrowed is not None and at is not None and at[1]
    try:
        items: dict[str, list[Any]] = {}
        for modality, entries in described:
            values = items.setdefault(modality, [])
            for entry in entries:
                if entry[0] == "pickle":
                    values.append(pickle.loads(entry[1]))
                    continue
                kind, extra, dtype, shape, offset = entry
                assert block is not None  # items with arrays come with their block
                view = np.ndarray(shape, np.dtype(dtype), buffer=block.buf, offset=offset)
                if kind == "image":  # frombytes copies (fromarray may not, for L and RGBA)
                    mode, raw_mode = extra
                    size = (shape[1], shape[0])
                    lent = None
                    if lend and raw_mode == ("RGBX" if mode == "RGB" else mode):
                        assert block.buf is not None  # mapped: the view above is of it
                        pixels = block.buf[offset : offset + view.nbytes]
                        lent = borrowed_image(pixels, mode, size)
                        del pixels  # the image keeps its own export of the block
                    if lent is None:
                        values.append(Image.frombytes(mode, size, view, "raw", raw_mode))
                    else:
                        values.append(lent[0])
                        assert borrowed is not None
                        borrowed.append(lent[1])
                elif kind == "video":
                    values.append(VideoItem(view.copy(), extra))
                else:
                    values.append(AudioItem(view.copy(), extra))
                del view
        return items
    finally:
        if at is not None and not at[1] and block is not None:
            _unmap(block)


def write_outputs(
    per_item: Mapping[str, list[dict[str, Any]]],
    call_name: str,
    *,
    attached: AttachedBlocks | None = None,
    outbox: tuple[str, int] | None = None,
    arena: OutputArena | None = None,
) -> tuple[Where, list[Any]]:
    """Put every tensor of ``per_item`` in shared memory: the worker's outputs block (``outbox``:
    its name and size) when they fit, else a block of the call's own named ``call_name``. Where
    they lie (None when there is no tensor) and the layout: per modality, per item, key ->
    ("tensor", dtype, shape, offset) or ("value", v).

    ``arena``: the one :func:`~mmproc.output_memory.outputs_in` opened on the outputs block;
    tensors made in it stay where they are (written once), and the rest go after them."""
    import torch

    arrays: list[tuple[dict[str, Any], str, np.ndarray, int | None]] = []
    layout: list[Any] = []
    for modality, items in per_item.items():
        entries = []
        for item in items:
            described: dict[str, Any] = {}
            for key, value in item.items():
                if isinstance(value, torch.Tensor | np.ndarray):
                    tensor = torch.as_tensor(value).detach().cpu().contiguous()
                    as_bits = tensor.view(torch.int16) if tensor.dtype == torch.bfloat16 else tensor
                    array = as_bits.numpy()
                    in_place = None if arena is None else arena.offset_of(array)
                    described[key] = ("tensor", str(tensor.dtype), tuple(tensor.shape), in_place)
                    arrays.append((described, key, array, in_place))
                else:
                    described[key] = ("value", value)
            entries.append(described)
        layout.append((modality, entries))
    if not arrays:
        return None, layout

    def place(start: int, keep_in_place: bool) -> int:
        """Give every tensor its offset, from ``start`` on; the end of the last."""
        offset = start
        for described, key, array, in_place in arrays:
            kind, dtype, shape, _ = described[key]
            if keep_in_place and in_place is not None:
                described[key] = (kind, dtype, shape, in_place)
                continue
            offset = aligned(offset)
            described[key] = (kind, dtype, shape, offset)
            offset += array.nbytes
        return offset

    kept = outbox is not None and attached is not None
    size = place(arena.used if kept and arena is not None else 0, keep_in_place=kept)
    if kept and outbox is not None and size > outbox[1]:  # arena tensors move with the rest
        kept = False
        size = place(0, keep_in_place=False)
    if kept:
        assert attached is not None and outbox is not None
        block = attached("out", outbox[0])
    else:
        block = new_call_block(call_name, size)  # WorkerProcessError when there is no room
    try:
        for described, key, array, in_place in arrays:
            at = described[key][3]
            if kept and at == in_place:
                continue  # made where it lies
            view = np.ndarray(array.shape, array.dtype, buffer=block.buf, offset=at)
            view[...] = array
            del view
    finally:
        if not kept:
            _unmap(block)  # the serving process unlinks it once it has copied the outputs out
    return (block.name, kept, size), layout


def read_outputs(
    block: SharedMemory | None, layout: list[Any], shared: memoryview | None = None
) -> dict[str, list[dict[str, Any]]]:
    """The per-item outputs in a worker's block: copied out of it, or, given ``shared`` (the
    block's buffer, lent to them: :mod:`mmproc.lent_blocks`), views of its memory."""
    import torch

    buffer = shared if shared is not None else None if block is None else block.buf
    per_item: dict[str, list[dict[str, Any]]] = {}
    for modality, entries in layout:
        items = per_item.setdefault(modality, [])
        for described in entries:
            item: dict[str, Any] = {}
            for key, entry in described.items():
                if entry[0] == "value":
                    item[key] = entry[1]
                    continue
                _, dtype_name, shape, offset = entry
                assert buffer is not None  # a layout with tensors comes with its block
                dtype = getattr(torch, dtype_name.removeprefix("torch."))
                carrier = torch.int16 if dtype == torch.bfloat16 else dtype
                count = int(np.prod(shape)) if shape else 1
                if count == 0:  # torch.frombuffer takes no empty range
                    item[key] = torch.empty(shape, dtype=dtype)
                    continue
                raw = torch.frombuffer(buffer, dtype=carrier, count=count, offset=offset)
                tensor = raw.view(shape) if shared is not None else raw.clone().view(shape)
                del raw
                item[key] = tensor.view(dtype) if carrier is not dtype else tensor
            items.append(item)
    return per_item
