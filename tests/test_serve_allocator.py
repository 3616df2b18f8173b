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


def run(mode: str, **env: str) -> dict[str, object]:
    done = subprocess.run(
        [sys.executable, "-c", REUSE, mode],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, **env},
    )
    return json.loads(done.stdout)


def test_buffers_freed_by_one_request_are_reused_by_the_next_without_page_faults() -> None:
    pages = 16 * (4 << 20) // 4096
    kept = run("keep")
    assert kept["applied"] == {
        "malloc_mmap_threshold": 32 << 20,
        "malloc_trim_threshold": 512 << 20,
    }
    assert kept["faults"] < pages // 10
    # Without the settings, glibc gives the freed memory back and faults it in again.
    assert run("default")["faults"] > pages // 2


def test_a_threshold_the_operator_set_in_the_environment_is_left_as_set() -> None:
    kept = run("keep", MALLOC_TRIM_THRESHOLD_="1048576")
    assert kept["applied"] == {"malloc_mmap_threshold": 32 << 20}
