"""Benchmark what hostile media costs a server: how long each attack holds it, against its limit.

Run: ``.venv/bin/python benchmarks/hostile_media.py``. Prints one Markdown table, one row per
attack; nothing is asserted. Every attack runs on this machine against real components:

* fetch deadline: a raw TCP server on 127.0.0.1 (``tests/_trickling_server.py``) sends its
  bytes one at a time, ``--interval`` apart -- the status line and headers, the body, or a TLS
  record -- so that each read returns long before any read timeout. The row says how long
  ``fetch_url`` took to refuse it, against ``RemoteMedia.timeout_s`` (``--deadline``).

* audio bomb: a FLAC file of a few tens of kB that holds 8 channels at 96 kHz for 120 s of
  silence: 368 MB of samples once decoded. Parsed in a fresh process under
  ``MediaLimits.max_request_decoded_bytes`` (``--audio-limit``); the row says how long it took and
  how much the process's peak RSS grew, against the limit.

A row is a function taking the parsed options and returning a `Row`; add one to `ROWS` (and its
options to `parse_args`) to add an attack.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path

from mmproc.media import MediaLimits, RemoteMedia
from mmproc.media.fetch import fetch_url
from mmproc.media.problem import MediaProblem

ROOT = Path(__file__).resolve().parent.parent

# The tests' trickling server, as the fetch tests use it.
sys.path.insert(0, str(ROOT / "tests"))
from _trickling_server import BODY, BODY_BURST, HEADERS, TLS_RECORD, TricklingServer  # noqa: E402

HEADER = ("attack", "limit", "configured", "held the server for", "outcome")
Row = tuple[str, str, str, str, str]


def _time_to_refusal(fetch: Callable[[], bytes]) -> tuple[float, str]:
    """Seconds until ``fetch`` ended, and how it ended: the limit a refusal names, or what it
    says when it names none."""
    start = time.perf_counter()
    try:
        fetch()
        outcome = "fetched (not refused)"
    except MediaProblem as exc:
        named = re.search(r"\(([^()]*)\)$", str(exc))
        outcome = f"refused ({named.group(1)})" if named else f"refused: {exc}"
    return time.perf_counter() - start, outcome


def _trickle_row(
    what: str, payload: bytes, burst: int, scheme: str, args: argparse.Namespace
) -> Row:
    remote = RemoteMedia(allowed_networks=("127.0.0.1/32",), timeout_s=args.deadline)
    limits = MediaLimits(read_timeout_s=None)  # the fetch's own deadline is what is measured
    with TricklingServer(payload, interval=args.interval, burst=burst) as server:
        took, outcome = _time_to_refusal(lambda: fetch_url(server.url(scheme), remote, limits))
    return (
        f"fetch deadline: {what} trickled, 1 byte / {args.interval * 1e3:g} ms",
        "RemoteMedia.timeout_s",
        f"{args.deadline:g} s",
        f"{took:.2f} s",
        outcome,
    )


def fetch_deadline_headers(args: argparse.Namespace) -> Row:
    """A server that trickles its status line and headers (which never end)."""
    return _trickle_row("status line and headers", HEADERS, 0, "http", args)


def fetch_deadline_body(args: argparse.Namespace) -> Row:
    """A server that sends its headers at once, then trickles a 100 kB body."""
    return _trickle_row("body", BODY, BODY_BURST, "http", args)


def fetch_deadline_tls(args: argparse.Namespace) -> Row:
    """An https server that trickles a 16 kB TLS handshake record."""
    return _trickle_row("TLS handshake", TLS_RECORD, 0, "https", args)


_AUDIO_BOMB_CHILD = """
import resource, sys, time
from mmproc.errors import MediaItemError
from mmproc.inputs import parse_mm_data
from mmproc.media import AudioFormat, MediaLimits, MediaOptions
data = open(sys.argv[1], "rb").read()
options = MediaOptions(
    audio=AudioFormat(16000, mono=True),
    limits=MediaLimits(max_request_decoded_bytes=int(sys.argv[2])),
)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
start = time.perf_counter()
try:
    parse_mm_data({"audio": [data]}, media=options)
    outcome = "decoded (not refused)"
except MediaItemError as exc:
    named = "max_request_decoded_bytes" in str(exc)
    outcome = "refused (MediaLimits.max_request_decoded_bytes)" if named else f"refused: {exc}"
took = time.perf_counter() - start
grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
print(f"{took}|{grew}|{outcome}")
"""


def audio_bomb(args: argparse.Namespace) -> Row:
    """A small FLAC that decodes to hundreds of MB, parsed in a process of its own."""
    import subprocess
    import tempfile

    import numpy as np
    import soundfile

    with tempfile.NamedTemporaryFile(suffix=".flac") as file:
        soundfile.write(file.name, np.zeros((96_000 * 120, 8), np.float32), 96_000, format="FLAC")
        size = Path(file.name).stat().st_size
        limit = int(args.audio_limit * (1 << 20))
        out = subprocess.run(
            [sys.executable, "-c", _AUDIO_BOMB_CHILD, file.name, str(limit)],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    took, grew, outcome = out.split("|", 2)
    return (
        f"audio bomb: {size / 1e3:,.0f} kB FLAC, 8 channels at 96 kHz for 120 s (368 MB decoded)",
        "MediaLimits.max_request_decoded_bytes",
        f"{args.audio_limit:g} MiB",
        f"{float(took):.3f} s, peak RSS +{int(grew) / 1024:,.1f} MB",
        outcome,
    )


ROWS: list[Callable[[argparse.Namespace], Row]] = [
    fetch_deadline_headers,
    fetch_deadline_body,
    fetch_deadline_tls,
    audio_bomb,
]


def print_table(header: tuple[str, ...], rows: list[Row], right: int) -> None:
    """A Markdown table; the ``right`` columns after the first two right-aligned."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    aligned = range(2, 2 + right)

    def line(row: tuple[str, ...]) -> str:
        cells = [
            c.rjust(w) if i in aligned else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))
        ]
        return "| " + " | ".join(cells) + " |"

    print(line(header))
    print(
        "|"
        + "|".join("-" * (w + 1) + (":" if i in aligned else "-") for i, w in enumerate(widths))
        + "|"
    )
    for row in rows:
        print(line(row))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="What hostile media costs, against each limit.")
    parser.add_argument(
        "--deadline",
        type=float,
        default=2.0,
        help="RemoteMedia.timeout_s for the fetch rows, in seconds (default 2; the library's "
        f"default is {RemoteMedia().timeout_s:g})",
    )
    parser.add_argument(
        "--interval",
        type=float,
        default=0.05,
        help="seconds between two bytes of a trickling server (default 0.05)",
    )
    parser.add_argument(
        "--audio-limit",
        type=float,
        default=64,
        help="MediaLimits.max_request_decoded_bytes for the audio bomb, in MiB (default 64)",
    )
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    print(f"Hostile media on this machine: each attack once, {len(ROWS)} rows.\n")
    print_table(HEADER, [row(args) for row in ROWS], right=2)


if __name__ == "__main__":
    main()
