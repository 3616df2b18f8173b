"""mmproc.media.sources: local paths confined and regular files only, within byte and time
limits; data: URLs and bytes within the byte limit. After every refusal, a good item still
parses."""

from __future__ import annotations

import base64
import io
import os
import socket
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from mmproc.errors import MediaItemError
from mmproc.inputs import parse_mm_data
from mmproc.media import ALLOWED_MEDIA_PATHS_ENV, MediaLimits, MediaOptions
from mmproc.media import allowed_media_paths_from_env as from_env
from mmproc.media.problem import MediaProblem
from mmproc.media.sources import read_local_file
from PIL import Image

HANG_GUARD_S = 30  # a refusal that has not come back by then never will


def _png(seed: int = 0) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (12, 16, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "PNG")
    return buf.getvalue()


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """An allowed media directory holding ``ok.png``, next to ``outside/secret.png``."""
    media = tmp_path / "media"
    media.mkdir()
    (media / "ok.png").write_bytes(_png())
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "secret.png").write_bytes(_png(1))
    return media


def _refused(item: Any, options: MediaOptions | None = None) -> MediaItemError:
    """Parse ``item`` as an image and return the error, once a good item has been seen to parse
    with the same options after it."""
    with pytest.raises(MediaItemError) as info:
        parse_mm_data({"image": [item]}, media=options)
    assert (info.value.modality, info.value.index) == ("image", 0)
    good = np.zeros((12, 16, 3), np.uint8)  # within every limit the tests set
    assert parse_mm_data({"image": good}, media=options)["image"][0].size == (16, 12)
    return info.value


def test_a_file_inside_the_allowed_directory_is_read(root: Path) -> None:
    options = MediaOptions(allowed_paths=[root])
    for form in [root / "ok.png", str(root / "ok.png"), str(root / "sub" / ".." / "ok.png")]:
        assert parse_mm_data({"image": form}, media=options)["image"][0].size == (16, 12)


def test_a_path_outside_the_allowed_directory_is_refused(root: Path) -> None:
    secret = root.parent / "outside" / "secret.png"
    err = _refused(secret, MediaOptions(allowed_paths=[root]))
    assert err.reason == (
        f"{str(secret)!r} is outside the allowed media directories "
        "(MediaOptions.allowed_paths; symlinks and '..' are resolved first)"
    )


def test_escaping_by_dot_dot_is_refused(root: Path) -> None:
    err = _refused(f"{root}/../outside/secret.png", MediaOptions(allowed_paths=[root]))
    assert "outside the allowed media directories" in err.reason


def test_escaping_by_a_symlink_is_refused(root: Path) -> None:
    (root / "innocent.png").symlink_to(root.parent / "outside" / "secret.png")
    (root / "door").symlink_to(root.parent / "outside")
    options = MediaOptions(allowed_paths=[root])
    assert "outside the allowed" in _refused(root / "innocent.png", options).reason
    assert "outside the allowed" in _refused(root / "door" / "secret.png", options).reason


def test_a_symlink_that_stays_inside_is_followed(root: Path) -> None:
    (root / "alias.png").symlink_to(root / "ok.png")
    options = MediaOptions(allowed_paths=[root])
    assert parse_mm_data({"image": root / "alias.png"}, media=options)["image"][0].size == (16, 12)


def test_a_symlinked_directory_that_stays_inside_is_followed(root: Path) -> None:
    (root / "real").mkdir()
    (root / "real" / "in.png").write_bytes(_png(2))
    (root / "alias").symlink_to(root / "real")
    options = MediaOptions(allowed_paths=[root])
    assert parse_mm_data({"image": root / "alias" / "in.png"}, media=options)["image"]


def test_a_directory_swapped_for_a_symlink_while_being_read_never_lets_an_outside_file_through(
    root: Path,
) -> None:
    # media/a/f.png is inside; a thread keeps turning media/a into a symlink to the outside
    # directory (which holds its own f.png) and back, while this thread reads media/a/f.png.
    inside, outside = _png(3), _png(4)
    parked_dir, parked_link = root / "parked-dir", root / "parked-link"
    parked_dir.mkdir()
    (parked_dir / "f.png").write_bytes(inside)
    (root.parent / "outside" / "f.png").write_bytes(outside)
    parked_link.symlink_to(root.parent / "outside")
    swapped = root / "a"
    os.rename(parked_dir, swapped)
    stop = threading.Event()
    swaps = [0]

    def swap() -> None:
        while not stop.is_set():
            os.rename(swapped, parked_dir)
            os.rename(parked_link, swapped)  # media/a -> outside
            os.rename(swapped, parked_link)
            os.rename(parked_dir, swapped)  # media/a is the directory again
            swaps[0] += 1

    swapper = threading.Thread(target=swap, daemon=True)
    swapper.start()
    read: dict[str, int] = {"inside": 0, "outside": 0, "refused": 0}
    limits = MediaLimits()
    try:
        for _ in range(3000):
            try:
                data = read_local_file(swapped / "f.png", allowed_paths=(root,), limits=limits)
            except MediaProblem:
                read["refused"] += 1
            else:
                read["inside" if data == inside else "outside"] += 1
    finally:
        stop.set()
        swapper.join(HANG_GUARD_S)
    assert swaps[0] > 0 and read["refused"] > 0  # the race was run
    assert read["outside"] == 0, read


def test_an_allowed_directory_given_through_a_symlink_still_contains_its_files(
    root: Path,
) -> None:
    (root.parent / "link").symlink_to(root)
    options = MediaOptions(allowed_paths=[root.parent / "link"])
    assert parse_mm_data({"image": root / "ok.png"}, media=options)["image"][0].size == (16, 12)


def test_no_allowed_directories_refuse_every_path(root: Path) -> None:
    err = _refused(root / "ok.png", MediaOptions(allowed_paths=()))
    assert "local file paths are not accepted here" in err.reason
    assert "MediaOptions.allowed_paths is empty" in err.reason


def test_the_environment_variable_confines_paths(root: Path) -> None:
    allowed = from_env({ALLOWED_MEDIA_PATHS_ENV: str(root)})
    options = MediaOptions(allowed_paths=allowed)
    assert parse_mm_data({"image": root / "ok.png"}, media=options)["image"]
    assert "outside the allowed" in _refused(root.parent / "outside" / "secret.png", options).reason
    everything_refused = MediaOptions(allowed_paths=from_env({ALLOWED_MEDIA_PATHS_ENV: ""}))
    assert "not accepted here" in _refused(root / "ok.png", everything_refused).reason


def test_by_default_any_path_is_read(root: Path) -> None:
    secret = root.parent / "outside" / "secret.png"
    assert parse_mm_data({"image": secret})["image"][0].size == (16, 12)


@pytest.mark.parametrize("device", ["/dev/zero", "/dev/urandom"])
def test_devices_are_refused_before_reading(device: str) -> None:
    # Without the check, reading /dev/zero runs until memory does.
    err = _refused(device, MediaOptions(limits=MediaLimits(max_item_bytes=None)))
    assert err.reason == f"{device!r} is a character device, not a regular file"


def test_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe.png"
    os.mkfifo(fifo)
    outcome: list[BaseException | None] = []

    def parse() -> None:
        try:
            parse_mm_data({"image": fifo})
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    reader = threading.Thread(target=parse, daemon=True)
    reader.start()
    reader.join(HANG_GUARD_S)
    assert outcome, "parse_mm_data blocked on a FIFO"
    assert isinstance(outcome[0], MediaItemError)
    assert outcome[0].reason == f"{str(fifo)!r} is a FIFO, not a regular file"
    assert parse_mm_data({"image": _png()})["image"]


def test_a_socket_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "s.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
        server.bind(str(path))
        err = _refused(path)
    assert err.reason.startswith(f"cannot open {str(path)!r}: ")


def test_a_directory_is_refused(root: Path) -> None:
    assert _refused(root).reason == f"{str(root)!r} is a directory, not a file"


def test_a_missing_file_is_named(root: Path) -> None:
    assert _refused(root / "nope.png").reason == f"no such file: {str(root / 'nope.png')!r}"


def test_a_file_over_the_byte_limit_is_refused_without_its_size(root: Path) -> None:
    size = (root / "ok.png").stat().st_size
    limits = MediaLimits(max_item_bytes=size - 1)
    err = _refused(root / "ok.png", MediaOptions(limits=limits))
    # A client naming any readable file must not learn its size.
    assert err.reason == (
        f"{str(root / 'ok.png')!r} is over the limit of {size - 1:,} bytes "
        "(MediaLimits.max_item_bytes)"
    )
    assert f"{size:,}" not in err.reason and str(size) not in err.reason
    exact = MediaOptions(limits=MediaLimits(max_item_bytes=size))
    assert parse_mm_data({"image": root / "ok.png"}, media=exact)["image"]


def test_a_proc_file_that_claims_no_size_is_still_cut_at_the_limit() -> None:
    # /proc files report a size of 0 and yield more: the limit holds while reading.
    err = _refused("/proc/self/maps", MediaOptions(limits=MediaLimits(max_item_bytes=64)))
    assert err.reason == (
        "'/proc/self/maps' is over the limit of 64 bytes (MediaLimits.max_item_bytes)"
    )


HUGE = 5_000_000  # characters: a refusal must not echo them
MESSAGE_BOUND = 600


@pytest.mark.parametrize(
    ("item", "options"),
    [
        ("x" * HUGE, None),  # a path too long to open
        ("/" + "x/" * (HUGE // 2), None),  # a path of many components
        ("DATA:" + "A" * HUGE, None),  # an upper-case data: URL without its ','
        ("data:" + "a" * HUGE + ";base64,AAAA", None),  # a media type of 5 MB
        ("gopher" * (HUGE // 6) + "://host/", None),  # an unsupported scheme
        ("/elsewhere/" + "x" * HUGE, "confined"),  # outside the allowed directories
    ],
    ids=["path", "components", "upper-case-data", "media-type", "scheme", "outside"],
)
def test_a_refusal_quotes_at_most_a_bounded_part_of_what_it_was_given(
    root: Path, item: str, options: str | None
) -> None:
    media = MediaOptions(allowed_paths=[root]) if options == "confined" else None
    err = _refused(item, media)
    assert len(err.reason) <= MESSAGE_BOUND, err.reason[:300]


def test_a_path_is_quoted_up_to_200_characters_with_an_ellipsis(root: Path) -> None:
    missing = str(root / ("m" * 300))  # longer than a name may be
    err = _refused(missing)
    assert err.reason == f"cannot open {(missing[:200] + '…')!r}: File name too long"


@pytest.mark.parametrize("scheme", ["DATA", "Data", "dAtA"])
def test_the_data_url_scheme_is_case_insensitive(scheme: str) -> None:
    png = _png(5)
    url = f"{scheme}:image/png;base64," + base64.b64encode(png).decode()
    image = parse_mm_data({"image": url})["image"][0]
    assert image.tobytes() == parse_mm_data({"image": png})["image"][0].tobytes()


def test_an_upper_case_data_url_is_refused_as_a_data_url_not_as_a_path() -> None:
    err = _refused("DATA:image/png;base64,not base64!" + "A" * HUGE)
    assert err.reason.startswith("invalid base64 in data: URL: ")
    assert len(err.reason) <= MESSAGE_BOUND


def test_a_read_slower_than_the_time_limit_is_refused(tmp_path: Path) -> None:
    big = tmp_path / "big.png"
    big.write_bytes(_png() + bytes(3 << 20))  # several chunks to read
    limits = MediaLimits(read_timeout_s=1e-9)
    err = _refused(big, MediaOptions(limits=limits))
    assert err.reason == (
        f"reading {str(big)!r} took longer than the limit of 1e-09 s (MediaLimits.read_timeout_s)"
    )


def test_bytes_over_the_limit_are_refused() -> None:
    png = _png()
    err = _refused(png, MediaOptions(limits=MediaLimits(max_item_bytes=100)))
    assert err.reason == (
        f"the item has {len(png):,} bytes, over the limit of 100 bytes (MediaLimits.max_item_bytes)"
    )


def test_a_data_url_over_the_limit_is_refused_before_decoding() -> None:
    url = "data:image/png;base64," + base64.b64encode(_png()).decode()
    err = _refused(url, MediaOptions(limits=MediaLimits(max_item_bytes=100)))
    assert err.reason.startswith("the data: URL has ")
    assert err.reason.endswith("over the limit of 100 bytes (MediaLimits.max_item_bytes)")


def test_data_url_media_types_follow_the_modality() -> None:
    def url(media_type: str) -> str:
        return f"data:{media_type};base64," + base64.b64encode(b"\x00" * 16).decode()

    with pytest.raises(MediaItemError, match=r"media type 'image/png' is not video/\*"):
        parse_mm_data({"video": url("image/png")})
    with pytest.raises(MediaItemError, match=r"'image/png' is not audio/\* or video/\*"):
        parse_mm_data({"audio": url("image/png")})
    with pytest.raises(MediaItemError, match=r"'audio/wav' is not image/\*"):
        parse_mm_data({"image": url("audio/wav")})
    # Untyped data is told by its bytes: here, bytes that are no image.
    with pytest.raises(MediaItemError, match="cannot identify the image data"):
        parse_mm_data({"image": url("application/octet-stream")})


def test_a_path_with_a_nul_character_is_refused() -> None:
    assert _refused("ok\x00.png").reason == "file path contains a NUL character"
