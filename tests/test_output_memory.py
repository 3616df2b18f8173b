"""Output tensors a plugin makes with ``output_tensor``: fresh tensors outside a worker process,
and inside one laid out in the outputs block, aligned, one after another, while they fit."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from mmproc.output_memory import ALIGN, OutputArena, aligned, outputs_in
from mmproc.plugin import output_tensor


def address(tensor: torch.Tensor) -> int:
    return int(tensor.data_ptr())


def test_outside_a_worker_process_an_output_tensor_is_a_new_one_of_the_shape_and_dtype() -> None:
    made = output_tensor((3, 5))
    assert made.shape == (3, 5) and made.dtype == torch.uint8
    halves = output_tensor([2, 2], torch.bfloat16)
    assert halves.shape == (2, 2) and halves.dtype == torch.bfloat16
    assert address(output_tensor((3, 5))) != address(made)


def test_inside_outputs_in_tensors_lie_in_the_buffer_aligned_one_after_another() -> None:
    buffer = bytearray(4096)
    start = np.frombuffer(buffer, np.uint8).ctypes.data
    with outputs_in(memoryview(buffer)) as arena:
        assert arena is not None
        first = output_tensor((3, 7))  # 21 bytes: the next starts on the next cache line
        second = output_tensor((4,), torch.float32)
        third = output_tensor((2, 3), torch.bfloat16)
    assert address(first) - start == 0
    assert address(second) - start == ALIGN
    assert address(third) - start == 2 * ALIGN
    assert arena.used == 2 * ALIGN + 12
    first.fill_(9)
    second.copy_(torch.tensor([1.5, -2.0, 0.0, 4.0]))
    assert bytes(buffer[:21]) == b"\x09" * 21
    assert np.frombuffer(buffer, np.float32, 4, ALIGN).tolist() == [1.5, -2.0, 0.0, 4.0]
    assert address(output_tensor((3, 7))) not in range(start, start + len(buffer))  # closed


def test_a_tensor_that_does_not_fit_is_a_new_one_and_later_ones_still_fill_the_room() -> None:
    buffer = bytearray(256)
    start = np.frombuffer(buffer, np.uint8).ctypes.data
    inside = range(start, start + len(buffer))
    with outputs_in(memoryview(buffer)) as arena:
        assert arena is not None
        big = output_tensor((300,))
        small = output_tensor((10, 10))
        none = output_tensor((0, 4))
    assert big.shape == (300,) and address(big) not in inside
    assert address(small) == start and arena.used == 100
    assert none.shape == (0, 4)


def test_the_arena_finds_arrays_only_in_the_part_it_handed_out() -> None:
    buffer = bytearray(1024)
    arena = OutputArena(memoryview(buffer))
    made = arena.tensor((8, 16), torch.uint8)
    assert made is not None
    assert arena.offset_of(made.numpy()) == 0
    assert arena.offset_of(made[4:].numpy()) == 64  # a row slice: where it starts
    assert arena.offset_of(made[:, ::2].numpy()) is None  # not contiguous
    assert arena.offset_of(np.frombuffer(buffer, np.uint8, 16, 512)) is None  # not handed out
    assert arena.offset_of(np.zeros(4, np.uint8)) is None


@pytest.mark.parametrize(("offset", "expected"), [(0, 0), (1, ALIGN), (ALIGN, ALIGN)])
def test_offsets_are_rounded_up_to_a_cache_line(offset: int, expected: int) -> None:
    assert aligned(offset) == expected


def test_a_dtype_that_is_not_torchs_is_refused_by_name_inside_a_worker_and_out() -> None:
    with pytest.raises(TypeError, match=r"output_tensor: dtype must be a torch\.dtype"):
        output_tensor((2, 2), np.uint8)  # type: ignore[arg-type]
    with outputs_in(memoryview(bytearray(64))):
        with pytest.raises(TypeError, match=r"output_tensor: dtype must be a torch\.dtype"):
            output_tensor((2, 2), "uint8")  # type: ignore[arg-type]
