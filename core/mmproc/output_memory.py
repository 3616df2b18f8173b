"""Where a plugin's output tensors are made: in a worker process, in the shared block its outputs
go back through, so they are written once, not written and then copied.

A plugin that fills a large output itself (patches it writes row by row) asks for it with
:func:`output_tensor`. In a thread worker, and wherever the core has no block to offer, that is
a new tensor (``torch.empty``). In a worker process (``worker_kind="process"``) the core opens an
:class:`OutputArena` on the block the call's outputs are to go in, and the tensor is made there:
:func:`mmproc.shared_blocks.write_outputs` finds it in place and copies only the rest. The values
are the same either way; only where the memory lies differs.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np
    import torch

__all__ = ["OutputArena", "output_tensor", "outputs_in"]

ALIGN = 64  # bytes: every tensor in a block starts on a cache line

_ARENA: contextvars.ContextVar[OutputArena | None] = contextvars.ContextVar(
    "mmproc_output_arena", default=None
)


def aligned(offset: int) -> int:
    """``offset`` rounded up to the next multiple of :data:`ALIGN`."""
    return -(-offset // ALIGN) * ALIGN


class OutputArena:
    """Tensors handed out one after another from the front of ``buffer`` (a shared block's),
    aligned, while they fit; :attr:`used` bytes are taken."""

    def __init__(self, buffer: memoryview) -> None:
        import numpy as np

        self._buffer = buffer
        self._size = buffer.nbytes
        self._base = np.frombuffer(buffer, np.uint8).ctypes.data if self._size else 0
        self.used = 0

    def tensor(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor | None:
        """A tensor of ``shape`` and ``dtype`` in the buffer, or None when it does not fit."""
        import torch

        count = math.prod(shape)
        nbytes = count * dtype.itemsize
        at = aligned(self.used)
        if count == 0 or at + nbytes > self._size:
            return None
        # bfloat16 and other dtypes numpy lacks are read through bytes of the same width.
        raw = torch.frombuffer(self._buffer, dtype=torch.uint8, count=nbytes, offset=at)
        self.used = at + nbytes
        return raw.view(dtype).view(tuple(shape))

    def offset_of(self, array: np.ndarray) -> int | None:
        """Where C-contiguous ``array`` lies in the part of the buffer handed out, or None when
        it lies elsewhere (or holds no bytes)."""
        if array.nbytes == 0 or not array.flags.c_contiguous:
            return None
        at = array.ctypes.data - self._base
        if 0 <= at and at + array.nbytes <= self.used:
            return at
        return None


@contextlib.contextmanager
def outputs_in(buffer: memoryview | None) -> Iterator[OutputArena | None]:
    """While inside, :func:`output_tensor` makes tensors in ``buffer`` (None: nowhere; new
    tensors, as in a thread worker). Yields the arena, for the outputs' writer."""
    arena = None if buffer is None else OutputArena(buffer)
    token = _ARENA.set(arena)
    try:
        yield arena
    finally:
        _ARENA.reset(token)


def output_tensor(shape: Sequence[int], dtype: torch.dtype | None = None) -> torch.Tensor:
    """A new, uninitialised tensor for an output the plugin fills itself (default dtype uint8).

    Use it for a large output a hook returns from ``process_mm_data`` (the patches of an image
    it writes): in a worker process it is made in the shared memory the outputs go back
    through, so the core does not copy it again. Fill all of it, return it (or views of it)
    among the outputs, and keep no reference after the hook returns: its memory is used again
    for a later call.
    """
    import torch

    dtype = torch.uint8 if dtype is None else dtype
    if not isinstance(dtype, torch.dtype):  # a numpy dtype would fail only inside a worker
        raise TypeError(f"output_tensor: dtype must be a torch.dtype, not {dtype!r}")
    arena = _ARENA.get()
    made = None if arena is None else arena.tensor(shape, dtype)
    return made if made is not None else torch.empty(tuple(shape), dtype=dtype)
