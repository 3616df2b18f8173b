"""The settings that decide how media files become items: sampling, audio format, limits, sources.

Every type here is a frozen dataclass checked when it is built: a bad value is a
:class:`~mmproc.errors.ConfigurationError` naming the field (``"MediaLimits.max_item_bytes must
be a positive integer or None, got 0"``), so a misconfigured server fails at start-up, not on the
first request. :class:`MediaOptions` bundles them; ``parse_mm_data(..., media=None)`` uses
``MediaOptions()``.
"""

from __future__ import annotations

import ipaddress
import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeAlias

from mmproc.errors import ConfigurationError

__all__ = [
    "ALLOWED_MEDIA_PATHS_ENV",
    "DEFAULT_VIDEO_FPS",
    "AudioFormat",
    "IPNetwork",
    "MediaLimits",
    "MediaOptions",
    "RemoteMedia",
    "VideoSampling",
    "allowed_media_paths_from_env",
]

DEFAULT_VIDEO_FPS = 2.0
"""Frames sampled per second of video when neither ``fps`` nor ``num_frames`` is given."""

ALLOWED_MEDIA_PATHS_ENV = "MMPROC_ALLOWED_MEDIA_PATHS"
"""The environment variable :func:`allowed_media_paths_from_env` reads."""

IPNetwork: TypeAlias = ipaddress.IPv4Network | ipaddress.IPv6Network

_MIB = 1 << 20
_GIB = 1 << 30


def _positive_int(owner: str, name: str, value: Any, *, optional: bool = False) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        allowed = "a positive integer or None" if optional else "a positive integer"
        raise ConfigurationError(f"{owner}.{name} must be {allowed}, got {value!r}")


def _positive_number(owner: str, name: str, value: Any, *, optional: bool = False) -> None:
    if value is None and optional:
        return
    ok = (
        not isinstance(value, bool)
        and isinstance(value, int | float)
        and math.isfinite(value)
        and value > 0
    )
    if not ok:
        allowed = "a positive number or None" if optional else "a positive number"
        raise ConfigurationError(f"{owner}.{name} must be {allowed}, got {value!r}")


@dataclass(frozen=True, slots=True)
class VideoSampling:
    """Which frames of a video file the model gets.

    Give a rate (``fps``) or an exact count (``num_frames``), not both; with neither the rate is
    :data:`DEFAULT_VIDEO_FPS`. To switch a sampling that has a rate to a count, replace both:
    ``dataclasses.replace(sampling, num_frames=16, fps=None)``.

    The number of frames *n* for a clip of *D* seconds with *N* frames, with ``m`` the
    ``frame_multiple``, is decided in this order:

    1. ``num_frames``, or ``ceil(D * fps)`` — one frame every ``1 / fps`` seconds from the start.
    2. Clamped to ``[min_frames, max_frames]``, those bounds first rounded *inward* to multiples
       of ``m`` (``min_frames`` up, ``max_frames`` down).
    3. Never more than the clip has: ``min(n, N)``.
    4. Rounded *down* to a multiple of ``m``, but at least ``m``: only a clip with fewer than
       ``m`` frames gets a frame twice, and only a clip with fewer frames than ``min_frames``
       gets fewer than ``min_frames``.

    The *n* frames are taken at the times ``i * D / n`` (``i = 0 .. n-1``), each being the frame on
    screen at that time (the last one whose timestamp is not after it), so a variable frame rate
    clip is sampled evenly in time; a frame held longer than ``D / n`` is taken more than once.
    """

    fps: float | None = None
    """Frames to sample per second of video (default :data:`DEFAULT_VIDEO_FPS` when
    ``num_frames`` is not given)."""
    num_frames: int | None = None
    """Sample this many frames (still clamped and rounded by the rule above)."""
    min_frames: int = 1
    """The fewest frames a clip gets (if it has them)."""
    max_frames: int | None = None
    """The most frames a clip gets; ``None``: no cap (``MediaLimits.max_video_frames`` still
    refuses a video that would need more)."""
    frame_multiple: int = 1
    """The frame count is a multiple of this (Qwen2-VL: 2, its temporal patch size)."""

    def __post_init__(self) -> None:
        owner = "VideoSampling"
        if self.fps is not None and self.num_frames is not None:
            raise ConfigurationError(
                f"{owner}: give fps or num_frames, not both (got fps={self.fps!r}, "
                f"num_frames={self.num_frames!r}); replace(sampling, num_frames=n, fps=None)"
            )
        _positive_number(owner, "fps", self.fps, optional=True)
        _positive_int(owner, "num_frames", self.num_frames, optional=True)
        _positive_int(owner, "min_frames", self.min_frames)
        _positive_int(owner, "max_frames", self.max_frames, optional=True)
        _positive_int(owner, "frame_multiple", self.frame_multiple)
        if self.max_frames is not None and self.max_frames < self.min_frames:
            raise ConfigurationError(
                f"{owner}.max_frames ({self.max_frames}) is below min_frames ({self.min_frames})"
            )
        low, high = self._bounds()
        if high is not None and high < low:
            raise ConfigurationError(
                f"{owner}.max_frames ({self.max_frames}) leaves no multiple of frame_multiple "
                f"({self.frame_multiple}) at or above min_frames ({self.min_frames})"
            )
        if self.fps is None and self.num_frames is None:
            object.__setattr__(self, "fps", DEFAULT_VIDEO_FPS)
        elif self.fps is not None:
            object.__setattr__(self, "fps", float(self.fps))

    def _bounds(self) -> tuple[int, int | None]:
        """``min_frames`` rounded up and ``max_frames`` rounded down to ``frame_multiple``."""
        m = self.frame_multiple
        low = -(-self.min_frames // m) * m
        high = None if self.max_frames is None else self.max_frames // m * m
        return low, high

    def frame_count(self, duration_s: float, available: int) -> int:
        """The number of frames to sample from a clip of ``duration_s`` seconds with ``available``
        frames (the rule in the class docstring); 0 only when ``available`` is 0."""
        if available <= 0:
            return 0
        if self.num_frames is not None:
            n = self.num_frames
        else:
            fps = self.fps if self.fps is not None else DEFAULT_VIDEO_FPS
            # Durations come from float timestamps: 0.1 s at 30 fps must be 3 frames, not 4.
            n = max(1, math.ceil(duration_s * fps - 1e-9))
        low, high = self._bounds()
        n = max(n, low)
        if high is not None:
            n = min(n, high)
        n = min(n, available)
        return max(self.frame_multiple, n - n % self.frame_multiple)


@dataclass(frozen=True, slots=True)
class AudioFormat:
    """The waveform a model receives: sample rate and channels.

    Every audio item (decoded from a file or given as a waveform) is converted to this, and the
    hash stands for what the model receives: a waveform is hashed once converted, a file by its
    bytes together with this format. Resampled with soxr (its "HQ" quality) when ``sample_rate``
    differs from the item's, and downmixed to one channel (the mean of the channels) when
    ``mono``.
    """

    sample_rate: int | None = None
    """Resample to this rate (Hz); ``None`` keeps each item's own rate."""
    mono: bool = False
    """Downmix channels-first ``(channels, samples)`` audio to 1-D by the mean of the channels."""

    def __post_init__(self) -> None:
        _positive_int("AudioFormat", "sample_rate", self.sample_rate, optional=True)
        if not isinstance(self.mono, bool):
            raise ConfigurationError(f"AudioFormat.mono must be a bool, got {self.mono!r}")


@dataclass(frozen=True, slots=True)
class MediaFormat:
    """What a model needs its media in, as its plugin's ``media_format`` hook says.

    ``video``: how video files are sampled for it (e.g. Qwen2-VL: 2 fps, 4 to 768 frames, an
    even count); ``audio``: the rate and channels its waveforms must have. ``None`` leaves the
    core's default (the caller's ``video_sampling`` option still wins over a model's sampling).
    """

    video: VideoSampling | None = None
    audio: AudioFormat | None = None

    def __post_init__(self) -> None:
        if self.video is not None and not isinstance(self.video, VideoSampling):
            raise ConfigurationError(
                f"MediaFormat.video must be a VideoSampling, got {self.video!r}"
            )
        if self.audio is not None and not isinstance(self.audio, AudioFormat):
            raise ConfigurationError(
                f"MediaFormat.audio must be an AudioFormat, got {self.audio!r}"
            )


@dataclass(frozen=True, slots=True)
class MediaLimits:
    """What one request may cost; an item over a limit is a ``MediaItemError`` naming the limit.

    Every limit may be ``None`` (no limit). The defaults let a library user pass any ordinary
    media; a server facing untrusted clients should lower them to what its models use.
    """

    max_item_bytes: int | None = 256 * _MIB
    """The most encoded bytes of one item, however it arrives (file, URL, ``data:`` URL, bytes).
    Files and downloads are read incrementally and stopped at the limit."""
    read_timeout_s: float | None = 30.0
    """The longest one file read may take (checked between chunks: a read the kernel blocks in,
    e.g. on a hung network file system, is not interrupted); for a URL, the deadline of the
    download when shorter than ``RemoteMedia.timeout_s``."""
    max_video_seconds: float | None = 600.0
    """The longest video file (by its frames' timestamps), checked before decoding any frame."""
    max_video_frames: int | None = 1024
    """The most frames one video item may have after sampling (or as given)."""
    max_audio_seconds: float | None = 600.0
    """The longest audio item, decoded or given."""
    max_request_decoded_bytes: int | None = 2 * _GIB
    """The most decoded bytes (pixels of images and sampled frames, float32 samples of audio)
    the items of one request may add up to: those given decoded and those decoded for it (an
    encoded item a processor's cache answers is never decoded, so it adds nothing). Checked from
    the items' headers before anything is decoded, in item order, and again once decoded."""

    def __post_init__(self) -> None:
        owner = "MediaLimits"
        _positive_int(owner, "max_item_bytes", self.max_item_bytes, optional=True)
        _positive_number(owner, "read_timeout_s", self.read_timeout_s, optional=True)
        _positive_number(owner, "max_video_seconds", self.max_video_seconds, optional=True)
        _positive_int(owner, "max_video_frames", self.max_video_frames, optional=True)
        _positive_number(owner, "max_audio_seconds", self.max_audio_seconds, optional=True)
        _positive_int(
            owner, "max_request_decoded_bytes", self.max_request_decoded_bytes, optional=True
        )


def _as_network(owner: str, value: Any) -> IPNetwork:
    if isinstance(value, ipaddress.IPv4Network | ipaddress.IPv6Network):
        return value
    try:
        return ipaddress.ip_network(value)
    except (TypeError, ValueError) as exc:
        raise ConfigurationError(
            f"{owner}.allowed_networks: {value!r} is not a network such as '10.1.0.0/16'"
        ) from exc


@dataclass(frozen=True, slots=True)
class RemoteMedia:
    """Fetching ``http://`` and ``https://`` URLs (off unless ``MediaOptions.remote`` is set).

    Every hop (the URL and each redirect) must use http or https, have a host the allow-list
    admits, and resolve only to public addresses: loopback, private, link-local, shared,
    multicast, reserved and every other special-purpose address, in IPv4 and in each IPv6 form
    (`mmproc.media.fetch.address_is_public`), are refused (checked on the addresses the name
    resolves to, which are the addresses connected to) unless ``allow_private_addresses`` or
    ``allowed_networks`` lets them through. Proxies and ``.netrc`` from the environment are
    ignored. A download obeys both this and ``MediaLimits``: the smaller byte limit, the shorter
    deadline (``timeout_s`` or ``MediaLimits.read_timeout_s``).
    """

    allowed_domains: tuple[str, ...] | None = None
    """Hosts that may be fetched from: ``"example.com"`` (that host only) or
    ``"*.example.com"`` (its subdomains, not the apex); IP literals match as written.
    ``None``: any host (whose addresses are public)."""
    max_bytes: int | None = None
    """The most bytes one download may have; ``None``: ``MediaLimits.max_item_bytes``."""
    timeout_s: float = 10.0
    """The deadline of one download, in seconds: resolving, connecting, TLS, status line,
    headers and body, of the URL and every redirect together. It holds against a server that
    trickles its bytes (each socket operation gets only the time left). Each download holds an
    ``io_workers`` thread until it ends, so this bounds what a slow server can hold."""
    max_redirects: int = 3
    """Redirects followed per URL (0: none)."""
    allow_private_addresses: bool = False
    """Allow every non-public address (for trusted deployments only)."""
    allowed_networks: tuple[IPNetwork, ...] = ()
    """Non-public networks allowed anyway, e.g. ``("10.1.0.0/16",)`` for an internal media
    store; strings are parsed."""

    def __post_init__(self) -> None:
        owner = "RemoteMedia"
        if self.allowed_domains is not None:
            if isinstance(self.allowed_domains, str) or not isinstance(
                self.allowed_domains, Iterable
            ):
                raise ConfigurationError(
                    f"{owner}.allowed_domains must be a sequence of host names or None, "
                    f"got {self.allowed_domains!r}"
                )
            domains = tuple(self.allowed_domains)
            for domain in domains:
                bare = domain[2:] if isinstance(domain, str) and domain.startswith("*.") else domain
                if not isinstance(bare, str) or not bare or "*" in bare or "/" in bare:
                    raise ConfigurationError(
                        f"{owner}.allowed_domains: {domain!r} is not a host name such as "
                        "'example.com' or '*.example.com'"
                    )
            object.__setattr__(
                self, "allowed_domains", tuple(d.lower().rstrip(".") for d in domains)
            )
        _positive_int(owner, "max_bytes", self.max_bytes, optional=True)
        _positive_number(owner, "timeout_s", self.timeout_s)
        if (
            isinstance(self.max_redirects, bool)
            or not isinstance(self.max_redirects, int)
            or self.max_redirects < 0
        ):
            raise ConfigurationError(
                f"{owner}.max_redirects must be a non-negative integer, got {self.max_redirects!r}"
            )
        if not isinstance(self.allow_private_addresses, bool):
            raise ConfigurationError(
                f"{owner}.allow_private_addresses must be a bool, "
                f"got {self.allow_private_addresses!r}"
            )
        if isinstance(self.allowed_networks, str):
            raise ConfigurationError(
                f"{owner}.allowed_networks must be a sequence of networks, "
                f"got the string {self.allowed_networks!r}"
            )
        networks = tuple(_as_network(owner, n) for n in self.allowed_networks)
        object.__setattr__(self, "allowed_networks", networks)


def _as_paths(value: Any) -> tuple[Path, ...] | None:
    if value is None:
        return None
    if isinstance(value, str | os.PathLike) or not isinstance(value, Iterable):
        raise ConfigurationError(
            f"MediaOptions.allowed_paths must be a sequence of directories or None, got {value!r}"
        )
    roots = []
    for root in value:
        if not isinstance(root, str | os.PathLike) or not os.fspath(root):
            raise ConfigurationError(
                f"MediaOptions.allowed_paths: {root!r} is not a directory path"
            )
        # Resolved once here, so that a root given through a symlink still contains its files.
        roots.append(Path(root).expanduser().resolve())
    return tuple(roots)


@dataclass(frozen=True, slots=True)
class MediaOptions:
    """Everything ``parse_mm_data`` needs to know to load media, bundled.

    The defaults are for library use: any local path, no URL fetching, the default limits, audio
    kept at its own rate and channels, video sampled at 2 fps. A server facing untrusted clients
    should set ``allowed_paths`` (``()`` when clients send no paths) and lower ``limits``.
    """

    video: VideoSampling = field(default_factory=VideoSampling)
    """How video files are sampled (frames given already decoded are not resampled)."""
    audio: AudioFormat = field(default_factory=AudioFormat)
    """The rate and channels every audio item is converted to."""
    limits: MediaLimits = field(default_factory=MediaLimits)
    """What one item and one request may cost."""
    remote: RemoteMedia | None = None
    """URL fetching settings; ``None``: ``http(s)://`` items are refused."""
    allowed_paths: tuple[Path, ...] | None = None
    """Directories local files must be inside (after resolving symlinks and ``..``); ``None``:
    any path; ``()``: no local path at all. Stored resolved."""

    def __post_init__(self) -> None:
        for name, kind in (
            ("video", VideoSampling),
            ("audio", AudioFormat),
            ("limits", MediaLimits),
        ):
            if not isinstance(getattr(self, name), kind):
                raise ConfigurationError(
                    f"MediaOptions.{name} must be a {kind.__name__}, "
                    f"got {type(getattr(self, name)).__name__}"
                )
        if self.remote is not None and not isinstance(self.remote, RemoteMedia):
            raise ConfigurationError(
                f"MediaOptions.remote must be a RemoteMedia or None, "
                f"got {type(self.remote).__name__}"
            )
        object.__setattr__(self, "allowed_paths", _as_paths(self.allowed_paths))


def allowed_media_paths_from_env(
    environ: Mapping[str, str] | None = None,
) -> tuple[Path, ...] | None:
    """Read ``MMPROC_ALLOWED_MEDIA_PATHS`` into a value for ``MediaOptions.allowed_paths``.

    The variable holds directories separated by ``os.pathsep`` (``:`` on Linux). Unset: ``None``
    (any path). Set but empty (or only separators): ``()``, no path at all — a server that sets
    the variable means to confine paths, so an empty value confines to nothing rather than
    allowing everything. Directories are resolved (symlinks, ``..``) when read.
    """
    env = os.environ if environ is None else environ
    value = env.get(ALLOWED_MEDIA_PATHS_ENV)
    if value is None:
        return None
    return _as_paths([part for part in value.split(os.pathsep) if part.strip()])
