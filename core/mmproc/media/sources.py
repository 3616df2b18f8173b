"""Getting an item's encoded bytes: from bytes, a ``data:`` URL, a local file or an http(s) URL.

A string is a URL when it starts with a scheme, in any case (RFC 3986: ``DATA:`` and ``Data:``
are ``data:`` URLs, ``HTTPS://`` is ``https://``); any other string is a path (a file whose
name starts with ``data:`` is given as ``./data:...``).

Local files are read only when they are *regular* files inside the allowed directories:

* Confinement: with ``MediaOptions.allowed_paths`` set, the path is resolved (symlinks, ``..``)
  and must lie inside one of the (resolved) roots: a symlink under a root is followed when what
  it leads to is inside a root too, and ``..`` cannot climb out. The resolved path is then
  opened one component at a time from the root's own descriptor (``openat``: each directory
  with ``O_DIRECTORY | O_NOFOLLOW``, the file with ``O_NOFOLLOW``), so no symlink is followed
  after the check: a directory or the file swapped for a symlink between the check and the open
  (a race a client with write access to the root could run) makes the open fail instead of
  leaving the root. ``()`` refuses every path. A hard link inside a root to a file elsewhere is
  that file, and cannot be told from the path: keep roots where clients cannot make hard links
  to files they could not read.
* Regular files only: the file is opened with ``O_NONBLOCK`` (opening a FIFO would otherwise wait
  for a writer forever) and ``fstat``-ed before a byte is read: devices (``/dev/zero``,
  ``/dev/urandom``), FIFOs, sockets and directories are refused.
* Limits: the size is checked against ``MediaLimits.max_item_bytes`` before reading, and again
  while reading in chunks (a file may grow); ``MediaLimits.read_timeout_s`` is checked between
  chunks.

Every refusal is a :class:`~mmproc.media.problem.MediaProblem` naming the path as given (not what
it resolves to, which a client should not learn) and the limit. With paths unconfined a client
may name any file the server can read, so a refusal about a path never says more about the file
than that it was refused: never its size (a file over the byte limit "is over the limit of N
bytes") and never its contents. Every message is bounded: a path, scheme or media type it quotes
is cut to :data:`QUOTE_CHARS` characters (with an ellipsis), and a path longer than
:data:`MAX_PATH_CHARS` is refused before it is resolved.
"""

from __future__ import annotations

import binascii
import errno
import os
import re
import stat
import time
from pathlib import Path

from mmproc.base64_text import decode_base64
from mmproc.media.policy import MediaLimits, MediaOptions
from mmproc.media.problem import MediaProblem

__all__ = [
    "MAX_PATH_CHARS",
    "QUOTE_CHARS",
    "check_item_size",
    "decode_data_url",
    "is_url",
    "quoted",
    "read_local_file",
    "read_media_bytes",
    "shortened",
]

QUOTE_CHARS = 200
"""The most characters of a caller's string (a path, a URL's host, a media type) a refusal
quotes; longer ones are cut, with an ellipsis."""

MAX_PATH_CHARS = 4096
"""The longest file path accepted (Linux's ``PATH_MAX``): a longer one is refused before it is
resolved, which would otherwise cost a system call per component."""

# "scheme://..." — anything that looks like a URL rather than a local path.
_URL_RE = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
_CHUNK = 1 << 20
# Directories on a confined walk: never through a symlink. O_PATH (Linux) opens a directory the
# process may search but not list, as the kernel's own path walk would.
_DIR_FLAGS = os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_PATH", 0) | getattr(os, "O_CLOEXEC", 0)
_FILE_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISSOCK, "a socket"),
)


def shortened(text: str) -> str:
    """``text`` cut to :data:`QUOTE_CHARS` characters, with an ellipsis when it was longer."""
    return text if len(text) <= QUOTE_CHARS else text[:QUOTE_CHARS] + "…"


def quoted(text: str) -> str:
    """``text`` as a refusal quotes it: the ``repr`` of :func:`shortened` ``text``."""
    return repr(shortened(text))


def is_url(text: str) -> bool:
    """Whether ``text`` is a ``scheme://`` URL rather than a local path."""
    return _URL_RE.match(text) is not None


def check_item_size(size: int, limits: MediaLimits, *, what: str = "the item") -> None:
    """Refuse ``size`` encoded bytes when over ``MediaLimits.max_item_bytes``."""
    limit = limits.max_item_bytes
    if limit is not None and size > limit:
        raise MediaProblem(
            f"{what} has {size:,} bytes, over the limit of {limit:,} bytes "
            "(MediaLimits.max_item_bytes)"
        )


def read_media_bytes(
    raw: bytes | bytearray | memoryview | str | os.PathLike[str],
    *,
    data_url_types: tuple[str, ...],
    options: MediaOptions,
) -> bytes:
    """The encoded bytes of one item given as bytes, a ``data:`` URL, a URL or a local path.

    Args:
        raw: The item as the caller gave it.
        data_url_types: Media type prefixes a ``data:`` URL may have, e.g. ``("image/",)``.
        options: Confinement, limits and URL fetching.

    Raises:
        MediaProblem: unreadable, refused, or over a limit.
    """
    limits = options.limits
    if isinstance(raw, bytes | bytearray | memoryview):
        data = bytes(raw) if not isinstance(raw, bytes) else raw
        check_item_size(len(data), limits)
        return data
    if isinstance(raw, str):
        if raw[:5].lower() == "data:":  # schemes are case-insensitive (RFC 3986)
            return decode_data_url(raw, data_url_types, limits)
        match = _URL_RE.match(raw)
        if match:
            scheme = match.group(1).lower()
            if scheme not in ("http", "https"):
                raise MediaProblem(
                    f"{quoted(scheme)}:// URLs are not supported; pass the bytes, a local path, "
                    "a data: URL or an http(s):// URL"
                )
            if options.remote is None:
                raise MediaProblem(
                    f"{scheme}:// URLs are not fetched: URL fetching is off "
                    "(MediaOptions.remote); pass the bytes, a local path or a data: URL"
                )
            from mmproc.media.fetch import fetch_url  # httpx loads only when URLs are used

            return fetch_url(raw, options.remote, limits)
    return read_local_file(raw, allowed_paths=options.allowed_paths, limits=limits)


def decode_data_url(url: str, accepted_types: tuple[str, ...], limits: MediaLimits) -> bytes:
    """The payload of a base64 ``data:`` URL (the scheme in any case: ``DATA:`` too) whose media
    type starts with one of ``accepted_types``, or is ``application/octet-stream`` (the decoders
    tell a file's format by its bytes, so untyped data is taken as vLLM takes it)."""
    header, sep, payload = url.partition(",")
    if not sep:
        raise MediaProblem("malformed data: URL (no ',' before the data)")
    params = header[len("data:") :].split(";")
    media_type = params[0].strip().lower()
    if media_type != "application/octet-stream" and not media_type.startswith(accepted_types):
        expected = " or ".join(f"{prefix}*" for prefix in accepted_types)
        shown = quoted(media_type) if media_type else "'(none)'"
        raise MediaProblem(f"data: URL media type {shown} is not {expected}")
    if "base64" not in (p.strip().lower() for p in params[1:]):
        raise MediaProblem("data: URLs must be base64-encoded (';base64,')")
    # Refuse before decoding: base64 holds 3 bytes per 4 characters.
    check_item_size(len(payload) // 4 * 3, limits, what="the data: URL")
    try:
        return decode_base64(payload)
    except (binascii.Error, ValueError) as exc:
        raise MediaProblem(f"invalid base64 in data: URL: {shortened(str(exc))}") from exc


def _confine(text: str, allowed_paths: tuple[Path, ...]) -> tuple[Path, tuple[str, ...]]:
    """The root ``text`` resolves inside, and the components of the resolved path below it."""
    if not allowed_paths:
        raise MediaProblem(
            "local file paths are not accepted here (MediaOptions.allowed_paths is empty); "
            "pass the bytes or a data: URL"
        )
    try:
        resolved = Path(os.path.realpath(text))
    except OSError as exc:  # a symlink on the way changed while it was being read
        raise MediaProblem(f"cannot open {quoted(text)}: it changed while being opened") from exc
    for root in allowed_paths:
        if resolved.is_relative_to(root):
            return root, resolved.relative_to(root).parts
    raise MediaProblem(
        f"{quoted(text)} is outside the allowed media directories (MediaOptions.allowed_paths; "
        "symlinks and '..' are resolved first)"
    )


class _SymlinkAppeared(OSError):
    """A component of a resolved path is a symlink: it was swapped in after the check."""


def _open_at(name: str, flags: int, dir_fd: int) -> int:
    try:
        return os.open(name, flags, dir_fd=dir_fd)
    except OSError as exc:
        # O_NOFOLLOW refuses a symlink with ELOOP, O_DIRECTORY with ENOTDIR (as for a file).
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            try:
                swapped = stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
            except OSError:
                swapped = False
            if swapped:
                raise _SymlinkAppeared(exc.errno, exc.strerror) from exc
        raise


def _open_beneath(root: Path, parts: tuple[str, ...], flags: int) -> int:
    """Open ``root / parts`` one component at a time, following no symlink (see the module
    docstring); raises OSError as ``os.open`` does."""
    fd = os.open(root, _DIR_FLAGS)
    try:
        for name in parts[:-1]:
            below = _open_at(name, _DIR_FLAGS, fd)
            os.close(fd)
            fd = below
        return _open_at(parts[-1] if parts else ".", flags | os.O_NOFOLLOW, fd)
    finally:
        os.close(fd)


def read_local_file(
    path: str | os.PathLike[str],
    *,
    allowed_paths: tuple[Path, ...] | None,
    limits: MediaLimits,
) -> bytes:
    """Read a regular file, confined to ``allowed_paths`` (``None``: anywhere), within the byte
    and time limits (see the module docstring)."""
    text = os.fspath(path)
    if not isinstance(text, str):
        raise MediaProblem(f"file paths must be str or os.PathLike[str], got {type(text).__name__}")
    if "\x00" in text:
        raise MediaProblem("file path contains a NUL character")
    if len(text) > MAX_PATH_CHARS:
        raise MediaProblem(f"file path {quoted(text)} is longer than {MAX_PATH_CHARS} characters")
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    try:
        if allowed_paths is None:
            fd = os.open(text, flags)
        else:
            fd = _open_beneath(*_confine(text, allowed_paths), flags)
    except FileNotFoundError as exc:
        raise MediaProblem(f"no such file: {quoted(text)}") from exc
    except _SymlinkAppeared as exc:
        raise MediaProblem(
            f"cannot open {quoted(text)}: it changed while being opened (a symlink appeared in its "
            "path; MediaOptions.allowed_paths)"
        ) from exc
    except OSError as exc:
        raise MediaProblem(f"cannot open {quoted(text)}: {exc.strerror or exc}") from exc
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            kind = next((name for test, name in _FILE_KINDS if test(info.st_mode)), "not a file")
            if kind == "a directory":
                raise MediaProblem(f"{quoted(text)} is a directory, not a file")
            raise MediaProblem(f"{quoted(text)} is {kind}, not a regular file")
        _check_file_size(info.st_size, text, limits)
        return _read_all(fd, text, limits)
    finally:
        os.close(fd)


def _check_file_size(size: int, text: str, limits: MediaLimits) -> None:
    """Refuse a file over ``MediaLimits.max_item_bytes`` without saying how large it is."""
    limit = limits.max_item_bytes
    if limit is not None and size > limit:
        raise MediaProblem(
            f"{quoted(text)} is over the limit of {limit:,} bytes (MediaLimits.max_item_bytes)"
        )


def _read_all(fd: int, text: str, limits: MediaLimits) -> bytes:
    timeout = limits.read_timeout_s
    deadline = None if timeout is None else time.monotonic() + timeout
    buf = bytearray()
    while True:
        try:
            chunk = os.read(fd, _CHUNK)
        except OSError as exc:
            raise MediaProblem(f"cannot read {quoted(text)}: {exc.strerror or exc}") from exc
        if not chunk:
            return bytes(buf)
        buf += chunk
        _check_file_size(len(buf), text, limits)
        if deadline is not None and time.monotonic() > deadline:
            raise MediaProblem(
                f"reading {quoted(text)} took longer than the limit of {timeout:g} s "
                "(MediaLimits.read_timeout_s)"
            )
