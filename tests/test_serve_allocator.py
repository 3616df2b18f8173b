"""The serving process's allocator settings (mmproc.serve.allocator), each in a fresh process:
they are process-wide."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")

# Fills and frees 16 buffers of 4 MiB, then fills 16 again: the second round's page faults.
REUSE = """
import json, resource, sys
from mmproc.serve.allocator import keep_freed_memory

applied = keep_freed_memory() if sys.argv[1] == "keep" else {}

def fill_and_free():
    buffers = [bytearray(4 << 20) for _ in range(16)]
    for buffer in buffers:
        buffer[::4096] = b"x" * len(buffer[::4096])
    del buffers

fill_and_free()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
fill_and_free()
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(json.dumps({"applied": applied, "faults": faults}))
"""


def run(script: str, mode: str, **env: str) -> dict[str, object]:
    """``script`` in a fresh interpreter, given ``mode``; what it prints, as JSON."""
    done = subprocess.run(
        [sys.executable, "-c", script, mode],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, **env},
    )
    return json.loads(done.stdout)


def test_buffers_freed_by_one_request_are_reused_by_the_next_without_page_faults() -> None:
    pages = 16 * (4 << 20) // 4096
    kept = run(REUSE, "keep")
    assert kept["applied"] == {
        "malloc_mmap_threshold": 32 << 20,
        "malloc_trim_threshold": 512 << 20,
    }
    assert kept["faults"] < pages // 10
    # Without the settings, glibc gives the freed memory back and faults it in again.
    assert run(REUSE, "default")["faults"] > pages // 2


def test_a_threshold_the_operator_set_in_the_environment_is_left_as_set() -> None:
    kept = run(REUSE, "keep", MALLOC_TRIM_THRESHOLD_="1048576")
    assert kept["applied"] == {"malloc_mmap_threshold": 32 << 20}


# A worker thread keeps two batches of 4 x 4 MiB (as a cache keeps new items' outputs), asking
# the reserve for room before the second when told to; prints each batch's page faults (that
# thread's alone: the reserve's own faults are its thread's).
KEEP = """
import json, resource, sys, threading, time
from mmproc.serve import allocator

allocator.keep_freed_memory()
mode = sys.argv[1]
heap = None
if mode != "none":
    heap = allocator.reserve_heap(reserve=20 << 20, top_pad=0, interval=None)
    assert heap is not None
faults = []
kept = []

def keep_a_batch():
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    for _ in range(4):
        buffer = bytearray(4 << 20)
        buffer[::4096] = b"x" * len(buffer[::4096])
        kept.append(buffer)
    faults.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before)

def in_a_thread(target):
    thread = threading.Thread(target=target)
    thread.start()
    thread.join()

in_a_thread(keep_a_batch)
if mode == "refill":
    fills = heap.fills
    allocator.make_room()
    deadline = time.monotonic() + 10
    while heap.fills == fills:
        assert time.monotonic() < deadline, "the reserve did not refill"
        time.sleep(0.01)
in_a_thread(keep_a_batch)
print(json.dumps({"faults": faults, "applied": heap.applied if heap else None}))
"""

BATCH_PAGES = 4 * (4 << 20) // 4096


def test_what_a_request_keeps_comes_from_memory_the_reserve_faulted_in() -> None:
    reserved = run(KEEP, "reserve")
    assert reserved["faults"][0] < BATCH_PAGES // 10
    # The reserve held 20 MiB: the second batch of 16 MiB outgrew it.
    assert reserved["faults"][1] > BATCH_PAGES // 2
    unreserved = run(KEEP, "none")
    assert unreserved["faults"][0] > BATCH_PAGES // 2


def test_make_room_refills_the_reserve_a_request_used() -> None:
    assert run(KEEP, "refill")["faults"] == [pytest.approx(0, abs=BATCH_PAGES // 10)] * 2


def test_the_reserve_makes_one_heap_unless_the_operator_set_the_arenas() -> None:
    assert run(KEEP, "reserve")["applied"] == {"malloc_arena_max": 1, "malloc_top_pad": 0}
    assert run(KEEP, "reserve", MALLOC_ARENA_MAX="2")["applied"] == {"malloc_top_pad": 0}


# Buffers in use when the reserve populates the whole heap keep what they hold.
POPULATE = """
import hashlib, random
from mmproc.serve import allocator

allocator.keep_freed_memory()
rng = random.Random(0)
buffers = [bytearray(rng.randbytes(3 << 20)) for _ in range(8)]
digests = [hashlib.sha256(buffer).digest() for buffer in buffers]
heap = allocator.reserve_heap(reserve=1 << 20, top_pad=256 << 20, interval=None)
assert heap is not None and heap.fills == 1
heap.fill()
assert [hashlib.sha256(buffer).digest() for buffer in buffers] == digests
print("intact")
"""


def test_populating_the_heap_leaves_the_memory_in_use_as_it_was() -> None:
    done = subprocess.run(
        [sys.executable, "-c", POPULATE], capture_output=True, text=True, check=True
    )
    assert done.stdout.strip() == "intact"
