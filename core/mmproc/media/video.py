"""Video files with PyAV: sample frames by a :class:`~mmproc.media.policy.VideoSampling`,
decoding only what those frames need.

Two steps, so that a request's size is known before anything big is allocated:

1. :func:`plan_video` opens the container (only the demuxers in :data:`VIDEO_CONTAINERS`: probing
   every format ffmpeg knows would let playlists such as HLS open other files and URLs), reads
   every packet of the first video stream *without decoding it* — a few milliseconds — and so
   learns each frame's timestamp and which packets are keyframes. From that it knows the
   duration (refused over ``MediaLimits.max_video_seconds``, while reading), picks the frames
   (the rule in ``VideoSampling``: the frame on screen at evenly spaced times, so variable frame
   rates are sampled evenly in time) and the decoded size.
2. :meth:`VideoPlan.decode` decodes. Packets are fed to the decoder only for the groups of
   pictures (keyframe to keyframe) that hold a sampled frame; the decoder is told to skip
   non-reference frames that are not sampled (nothing else depends on them), and only sampled
   frames are converted to RGB — the conversion, not the decoding, is most of the cost of
   decoding every frame. Decoding stops after the last sampled frame. Should that not give every
   sampled frame — one did not come out (a broken stream), a packet flagged as a keyframe did not
   decode to one, or frames came out of timestamp order (an AVI file has no timestamps: B-frames
   there get made-up ones) — the whole stream is decoded again, plainly, and the sampled frames
   are taken by their position in it.

Frames come out as one C-contiguous ``uint8`` ``(T, H, W, 3)`` array at the stream's size (a
stream that changes size midway is scaled back to its first size).
"""

from __future__ import annotations

import bisect
import io
import itertools
import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import av
import numpy as np

from mmproc.inputs import VideoItem, VideoMetadata
from mmproc.media.policy import MediaLimits, VideoSampling
from mmproc.media.problem import MediaProblem

__all__ = ["VIDEO_CONTAINERS", "VideoPlan", "plan_video"]

VIDEO_CONTAINERS: tuple[str, ...] = (
    "mov",
    "mp4",
    "matroska",
    "webm",
    "avi",
    "mpegts",
    "ogg",
)
"""ffmpeg demuxers video files may be in (mp4 / mov / m4v, mkv, webm, avi, MPEG-TS, ogg)."""

# A stream with more frames than this per second of the duration limit is refused while
# demuxing: the index of a hostile file of tiny packets would otherwise grow with its size.
_MAX_SOURCE_FPS = 1000


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def open_container(data: bytes, formats: tuple[str, ...]) -> Any:
    """Open ``data`` with PyAV, allowing only the demuxers named in ``formats``."""
    if not data:
        raise MediaProblem("empty file (0 bytes)")
    try:
        return av.open(
            io.BytesIO(data),
            container_options={"format_whitelist": ",".join(formats), "fflags": "+genpts"},
        )
    except av.error.ArgumentError as exc:
        raise MediaProblem(
            f"not a supported container (allowed: {', '.join(formats)}); starts {bytes(data[:8])!r}"
        ) from exc
    except Exception as exc:
        raise MediaProblem(
            f"cannot open it ({len(data):,} bytes, starts {bytes(data[:8])!r}): {_describe(exc)}"
        ) from exc


@dataclass(slots=True)
class _Index:
    """The video stream's packets in decode order: timestamps, keyframe flags, durations."""

    pts: list[int]
    keyframe: list[bool]
    end: int  # the largest pts + duration: where the last frame stops showing
    start: int  # the smallest pts


def _declared_seconds(container: Any, stream: Any) -> float | None:
    if stream.duration is not None and stream.time_base:
        return float(stream.duration * stream.time_base)
    if container.duration is not None:
        return container.duration / av.time_base
    return None


def _read_index(container: Any, stream: Any, limits: MediaLimits) -> _Index:
    limit = limits.max_video_seconds
    declared = _declared_seconds(container, stream)
    if limit is not None and declared is not None and declared > limit:
        raise MediaProblem(
            f"{declared:,.1f} s is over the limit of {limit:g} s (MediaLimits.max_video_seconds)"
        )
    time_base = stream.time_base
    limit_ticks = None if limit is None else limit / time_base
    max_packets = None if limit is None else math.ceil(limit * _MAX_SOURCE_FPS) + _MAX_SOURCE_FPS
    pts: list[int] = []
    keyframe: list[bool] = []
    start = end = None
    any_duration = False
    packets = 0
    for packet in container.demux(stream):
        if packet.size == 0:
            continue  # the flush packet
        packets += 1
        if packet.is_corrupt:
            raise MediaProblem(f"corrupt or truncated data at packet {packets - 1}")
        if packet.pts is None:
            continue  # a frame without a time cannot be sampled by time
        pts.append(packet.pts)
        keyframe.append(bool(packet.is_keyframe))
        any_duration = any_duration or bool(packet.duration)
        start = packet.pts if start is None else min(start, packet.pts)
        stop = packet.pts + (packet.duration or 0)
        end = stop if end is None else max(end, stop)
        if limit_ticks is not None and end - start > limit_ticks:
            raise MediaProblem(
                f"frames go past {float((end - start) * time_base):,.1f} s, over the limit of "
                f"{limit:g} s (MediaLimits.max_video_seconds)"
            )
        if max_packets is not None and len(pts) > max_packets:
            raise MediaProblem(
                f"more than {max_packets:,} frames within the limit of {limit:g} s "
                "(MediaLimits.max_video_seconds)"
            )
    if start is None or end is None:
        raise MediaProblem("the video stream has no frames")
    if stream.frames and packets < stream.frames:
        raise MediaProblem(
            f"truncated or corrupt: the header promises {stream.frames:,} frames, the file "
            f"holds {packets:,}"
        )
    if not any_duration:
        # No packet says how long it shows: the last frame lasts one typical frame interval.
        ordered = sorted(pts)
        gaps = [b - a for a, b in itertools.pairwise(ordered) if b > a]
        if gaps:
            end = ordered[-1] + int(np.median(gaps))
        elif stream.average_rate:
            end = ordered[-1] + max(1, round(1 / (stream.average_rate * time_base)))
    index = _Index(pts, keyframe, end, start)
    _check_declared_duration(container, index, time_base)
    return index


def _check_declared_duration(container: Any, index: _Index, time_base: Fraction) -> None:
    """Refuse a video-only file whose frames end well before the duration its header declares:
    a cut (or garbled) Matroska / WebM file otherwise decodes as a shorter clip. With other
    streams (audio may outlast the video) the declared duration says nothing about the video."""
    if len(container.streams) != 1 or container.duration is None:
        return
    declared = container.duration / av.time_base
    found = float((index.end - index.start) * time_base)
    if found < declared - max(1.0, 0.1 * declared):
        raise MediaProblem(
            f"truncated or corrupt: the header says {declared:,.1f} s, the frames end at "
            f"{found:,.1f} s"
        )


def _video_stream(container: Any) -> Any:
    for stream in container.streams.video:
        if not stream.disposition & av.stream.Disposition.attached_pic:  # cover art
            return stream
    kinds = sorted({s.type for s in container.streams}) or ["none"]
    raise MediaProblem(f"no video stream in the file (streams: {', '.join(kinds)})")


def plan_video(
    data: bytes,
    sampling: VideoSampling,
    limits: MediaLimits,
    containers: tuple[str, ...] = VIDEO_CONTAINERS,
) -> VideoPlan:
    """Open a video file, index its packets and choose the frames to sample; decode nothing yet.

    Raises:
        MediaProblem: not a video, no frames, corrupt, or over ``MediaLimits`` (duration,
            frames). The frame size (``width``, ``height``) is the caller's to check.
    """
    container = open_container(data, containers)
    try:
        stream = _video_stream(container)
        if stream.codec_context is None:
            raise MediaProblem(f"no decoder for the video codec {stream.codec.name!r}")
        width, height = stream.codec_context.width, stream.codec_context.height
        if width <= 0 or height <= 0:
            raise MediaProblem(f"the video stream has no frame size ({width}x{height})")
        try:
            index = _read_index(container, stream, limits)
        except MediaProblem:
            raise
        except Exception as exc:
            raise MediaProblem(f"corrupt or truncated video: {_describe(exc)}") from exc
        plan = VideoPlan(container, stream, index, width, height, sampling, limits)
    except BaseException:
        container.close()
        raise
    return plan


class VideoPlan:
    """An opened, indexed video and the frames chosen from it; :meth:`decode` decodes them.

    ``metadata`` and ``decoded_bytes`` are known before decoding. Holds the container open until
    :meth:`decode` (or :meth:`close`).
    """

    def __init__(
        self,
        container: Any,
        stream: Any,
        index: _Index,
        width: int,
        height: int,
        sampling: VideoSampling,
        limits: MediaLimits,
    ) -> None:
        self._container = container
        self._stream = stream
        self._index = index
        self.width = width
        self.height = height
        time_base = stream.time_base
        shown = sorted(set(index.pts))  # presentation order
        span = index.end - index.start
        duration = float(span * time_base)
        count = sampling.frame_count(duration, len(shown))
        limit = limits.max_video_frames
        if limit is not None and count > limit:
            raise MediaProblem(
                f"{count:,} sampled frames is over the limit of {limit:,} "
                "(MediaLimits.max_video_frames)"
            )
        # The frame on screen at start + i * span / count, in exact arithmetic (pts ticks).
        self._chosen = [
            bisect.bisect_right(shown, index.start + Fraction(i * span, count)) - 1
            for i in range(count)
        ]
        self._targets = [shown[j] for j in self._chosen]
        self.metadata = VideoMetadata(
            fps=len(shown) / duration if duration > 0 else float(stream.average_rate or 0),
            duration_s=duration,
            total_frames=len(shown),
            frame_indices=tuple(self._chosen),
            timestamps_s=tuple(float((p - index.start) * time_base) for p in self._targets),
            width=width,
            height=height,
        )

    @property
    def decoded_bytes(self) -> int:
        """The size of the frames :meth:`decode` returns."""
        return len(self._targets) * self.height * self.width * 3

    def close(self) -> None:
        """Close the container (``decode`` does it itself)."""
        self._container.close()

    def decode(self) -> VideoItem:
        """Decode the chosen frames into a :class:`~mmproc.inputs.VideoItem`.

        Raises:
            MediaProblem: the stream cannot be decoded.
        """
        frames = np.empty((len(self._targets), self.height, self.width, 3), np.uint8)
        try:
            if not self._decode_needed(frames):
                self._decode_everything(frames)
        except MediaProblem:
            raise
        except Exception as exc:
            raise MediaProblem(f"cannot decode the video: {_describe(exc)}") from exc
        finally:
            self.close()
        return VideoItem(frames, self.metadata)

    def _store(self, frame: Any, slots: list[int], frames: np.ndarray) -> None:
        rgb = frame.to_ndarray(format="rgb24", width=self.width, height=self.height)
        for slot in slots:
            frames[slot] = rgb

    def _slots_by_pts(self) -> dict[int, list[int]]:
        slots: dict[int, list[int]] = {}
        for slot, pts in enumerate(self._targets):
            slots.setdefault(pts, []).append(slot)
        return slots

    def _needed_groups(self) -> set[int]:
        """Decode-order positions of the keyframes whose groups hold a sampled frame."""
        index = self._index
        group_of: list[int] = []
        group = -1
        for i, key in enumerate(index.keyframe):
            group = i if key else group
            group_of.append(group)
        position = {pts: i for i, pts in enumerate(index.pts)}
        keyframes = [i for i, key in enumerate(index.keyframe) if key]
        needed: set[int] = set()
        for pts in set(self._targets):
            group = group_of[position[pts]]
            needed.add(group)
            if group >= 0 and pts < index.pts[group]:
                # Shown before its keyframe (an open GOP): it refers to the group before.
                earlier = bisect.bisect_left(keyframes, group) - 1
                needed.add(keyframes[earlier] if earlier >= 0 else -1)
        return needed

    def _decode_needed(self, frames: np.ndarray) -> bool:
        """Decode the groups of pictures that hold sampled frames. False when that could not give
        every sampled frame — one did not come out, a packet flagged as a keyframe did not decode
        to one, or frames came out of timestamp order (made-up timestamps) — so that the caller
        decodes everything instead."""
        index = self._index
        needed = self._needed_groups()
        pending = self._slots_by_pts()
        last = max(i for i, pts in enumerate(index.pts) if pts in pending)
        codec = self._stream.codec_context
        self._container.seek(0)
        position = -1
        feeding = -1 in needed
        fresh = False  # the decoder restarted after skipping: its first frame must be a keyframe
        shown = -1  # the timestamp of the frame that came out last, within one run of groups
        for packet in self._container.demux(self._stream):
            if packet.size == 0:
                continue
            if packet.pts is not None:  # positions count what the index holds
                position += 1
                if position > last:
                    break
                if packet.is_keyframe:
                    was_feeding, feeding = feeding, position in needed
                    if feeding and not was_feeding:
                        codec.flush_buffers()
                        fresh = position > 0
                        shown = -1
                    elif was_feeding and not feeding:
                        self._drain(codec, pending, frames)
            if not feeding:
                continue
            wanted = packet.pts is None or packet.pts in pending
            codec.skip_frame = "DEFAULT" if wanted else "NONREF"
            for frame in codec.decode(packet):
                if fresh and not frame.key_frame:
                    return False
                if frame.pts is None or frame.pts <= shown:
                    return False  # frames out of time order: the timestamps are made up
                fresh, shown = False, frame.pts
                if frame.pts in pending:
                    self._store(frame, pending.pop(frame.pts), frames)
        self._drain(codec, pending, frames)
        return not pending

    def _drain(self, codec: Any, pending: dict[int, list[int]], frames: np.ndarray) -> None:
        codec.skip_frame = "DEFAULT"
        for frame in codec.decode(None):
            if frame.pts in pending:
                self._store(frame, pending.pop(frame.pts), frames)
        codec.flush_buffers()

    def _decode_everything(self, frames: np.ndarray) -> None:
        """Decode every frame and take the sampled ones by their position in presentation order
        (the order frames come out of the decoder), not by timestamp: this is the way when the
        timestamps cannot be trusted (an AVI file has none: B-frames there get made-up ones)."""
        slots: dict[int, list[int]] = {}
        for slot, position in enumerate(self._chosen):
            slots.setdefault(position, []).append(slot)
        self._container.seek(0)
        codec = self._stream.codec_context
        codec.skip_frame = "DEFAULT"  # the first pass may have stopped while skipping
        codec.flush_buffers()
        last = None
        for position, frame in enumerate(self._container.decode(self._stream)):
            if position in slots:
                self._store(frame, slots.pop(position), frames)
            last = frame
            if not slots:
                return
        if last is None:
            raise MediaProblem("no frame of the video could be decoded")
        # The decoder gave fewer frames than the file has packets: the rest get its last frame.
        self._store(last, [slot for group in slots.values() for slot in group], frames)
