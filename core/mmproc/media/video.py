"""Videos: frames given decoded, and video files decoded with PyAV, to :class:`VideoItem`.

A video item is ``frames``, one C-contiguous ``uint8`` ``(T, H, W, C)`` array (so hashing needs
no copy and every HF video processor accepts it), with ``metadata`` (:class:`VideoMetadata`) when
it came from a file. Frames given decoded (an array, a ``(T, H, W, C)`` / ``(T, C, H, W)`` tensor,
a list of frames each in any image form, or a :class:`VideoItem`) are kept as given: never
resampled. PIL frames in modes other than ``L``/``RGB``/``RGBA`` become ``RGB`` (``RGBA`` with
transparency), since an array has no palette. A list of frames given encoded counts its frames'
bytes together against ``MediaLimits.max_item_bytes``, as one file would.

A video file is sampled by a :class:`~mmproc.media.policy.VideoSampling`, decoding only what the
sampled frames need, in two steps, so that a request's size is known before anything big is
allocated:

1. :func:`plan_video` opens the container (only the demuxers in :data:`VIDEO_CONTAINERS`), reads
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

A file's frames come out as ``(T, H, W, 3)`` at the stream's size (a stream that changes size
midway is scaled back to its first size).

Part of the decoding recipe (:func:`recipe`): PyAV and FFmpeg's libraries as loaded, and the
sampling.
"""

from __future__ import annotations

import bisect
import itertools
import math
from dataclasses import asdict, dataclass
from fractions import Fraction
from typing import Any

import numpy as np
from PIL import Image

from mmproc._torch import is_torch_tensor
from mmproc.media.arrays import is_array, to_numpy
from mmproc.media.image import CHANNELS_TO_MODE, check_pixels, prepare_image
from mmproc.media.items import ENCODED_FORMS, DecodePlan, DecodeSettings, VideoItem, VideoMetadata
from mmproc.media.policy import MediaLimits, MediaOptions, VideoSampling
from mmproc.media.problem import MediaProblem, describe
from mmproc.media.sources import check_item_size, read_media_bytes

# PyAV is imported where a video file first needs it: frames given decoded never load it.

__all__ = [
    "ARRAY_MODES",
    "DATA_URL_TYPES",
    "VIDEO_CONTAINERS",
    "VideoPlan",
    "open_video_file",
    "plan_video",
    "prepare_video",
    "recipe",
]

DATA_URL_TYPES: tuple[str, ...] = ("video/",)
"""Media types a ``data:`` URL of a video may have."""

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


@dataclass(slots=True)
class _Index:
    """The video stream's packets in decode order: timestamps, keyframe flags, durations."""

    pts: list[int]
    keyframe: list[bool]
    end: int  # the largest pts + duration: where the last frame stops showing
    start: int  # the smallest pts


def _declared_seconds(container: Any, stream: Any) -> float | None:
    import av

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
    import av

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
    import av

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
    from mmproc.media.container import open_container

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
            raise MediaProblem(f"corrupt or truncated video: {describe(exc)}") from exc
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
        """Decode the chosen frames into a :class:`~mmproc.media.items.VideoItem`.

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
            raise MediaProblem(f"cannot decode the video: {describe(exc)}") from exc
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


# --- the entry points of the decoding contract ------------------------------------------------


def open_video_file(data: bytes, settings: DecodeSettings) -> DecodePlan:
    """Index a video file and choose its frames by the sampling (decoding is the plan's)."""
    media = settings.media
    plan = plan_video(data, media.video, media.limits)
    try:
        check_pixels(plan.width, plan.height)
    except MediaProblem:
        plan.close()
        raise
    return DecodePlan(plan.decoded_bytes, plan.decode, heavy=True, discard=plan.close)


def recipe(media: MediaOptions) -> dict[str, Any]:
    """What decides what a video file decodes to: PyAV and FFmpeg's libraries as loaded, and
    the frames sampled from it."""
    import av

    return {
        "av": {"version": av.__version__, **av.library_versions},
        "sampling": asdict(media.video),
    }


def prepare_video(raw: Any, settings: DecodeSettings) -> DecodePlan:
    """Check a video given as frames (an array or tensor, a list of frames, a VideoItem)."""
    if isinstance(raw, VideoItem):
        return _prepare_video_item(raw, settings)
    if is_array(raw):
        frames = _video_from_array(raw)
        _check_frame_count(frames.shape[0], settings)
        return DecodePlan.done(VideoItem(frames), frames.nbytes)
    if isinstance(raw, list | tuple):
        return _prepare_frame_list(raw, settings)
    raise MediaProblem(
        f"unsupported video type {type(raw).__name__}; expected a video file (bytes, a path, a "
        "data: URL or an http(s):// URL), a list of frames or a (T, H, W, C) uint8 array"
    )


def _check_frame_count(count: int, settings: DecodeSettings) -> None:
    limit = settings.media.limits.max_video_frames
    if limit is not None and count > limit:
        raise MediaProblem(
            f"{count:,} frames is over the limit of {limit:,} (MediaLimits.max_video_frames)"
        )


def _prepare_video_item(item: VideoItem, settings: DecodeSettings) -> DecodePlan:
    frames = _video_from_array(item.frames)
    _check_frame_count(frames.shape[0], settings)
    metadata = item.metadata
    if metadata is not None:
        if not isinstance(metadata, VideoMetadata):
            raise MediaProblem(
                f"VideoItem.metadata must be a VideoMetadata or None, got {type(metadata).__name__}"
            )
        described = {len(metadata.frame_indices), len(metadata.timestamps_s)}
        if described != {frames.shape[0]}:
            raise MediaProblem(
                f"its metadata describes {sorted(described)} frames, its array has "
                f"{frames.shape[0]}"
            )
    same = frames is item.frames
    return DecodePlan.done(item if same else VideoItem(frames, metadata), frames.nbytes)


def _prepare_frame_list(raw: list[Any] | tuple[Any, ...], settings: DecodeSettings) -> DecodePlan:
    if not raw:
        raise MediaProblem("empty video (no frames)")
    _check_frame_count(len(raw), settings)
    frames: list[DecodePlan] = []
    encoded_bytes = 0
    for t, frame in enumerate(raw):
        try:
            if isinstance(frame, ENCODED_FORMS):
                data = read_media_bytes(
                    frame, data_url_types=_FRAME_DATA_URL_TYPES, options=settings.media
                )
                # One video, one item: its frames' bytes count together, as a file's would.
                encoded_bytes += len(data)
                check_item_size(
                    encoded_bytes, settings.media.limits, what="the video's encoded frames"
                )
                frames.append(prepare_image(data, settings))
            else:
                frames.append(prepare_image(frame, settings))
        except MediaProblem as exc:
            raise MediaProblem(f"frame {t}: {exc}") from exc.__cause__

    def finish() -> VideoItem:
        arrays: list[np.ndarray] = []
        for t, pending in enumerate(frames):
            try:
                arrays.append(_frame_to_array(pending.decode()))
            except MediaProblem as exc:
                raise MediaProblem(f"frame {t}: {exc}") from exc.__cause__
            if arrays[t].shape != arrays[0].shape:
                raise MediaProblem(
                    f"frame {t} has shape {arrays[t].shape} (H, W, C), frame 0 has "
                    f"{arrays[0].shape}; all frames must match"
                )
        return VideoItem(np.stack(arrays))

    heavy = any(p.heavy for p in frames)
    return DecodePlan(sum(p.decoded_bytes for p in frames), finish, heavy=heavy)


def _video_from_array(raw: Any) -> np.ndarray:
    if not is_array(raw):
        raise MediaProblem(f"video frames must be a uint8 array, got {type(raw).__name__}")
    arr = to_numpy(raw)
    if arr.dtype != np.uint8:
        raise MediaProblem(f"video arrays must be uint8, got {arr.dtype}")
    if arr.ndim != 4:
        raise MediaProblem(f"video array shape {tuple(arr.shape)} is not (T, H, W, C)")
    if is_torch_tensor(raw) and arr.shape[1] in CHANNELS_TO_MODE:
        arr = arr.transpose(0, 2, 3, 1)  # (T, C, H, W), torch's channels-first convention
    frames, height, width, channels = arr.shape
    if channels not in CHANNELS_TO_MODE:
        raise MediaProblem(
            f"video array shape {tuple(raw.shape)} is not (T, H, W, C) with C in 1, 3, 4"
        )
    if frames == 0 or height == 0 or width == 0:
        raise MediaProblem(f"empty video (shape {tuple(arr.shape)})")
    check_pixels(width, height)
    return np.ascontiguousarray(arr)  # no copy when it already is


def _frame_to_array(image: Image.Image) -> np.ndarray:
    if image.mode not in ARRAY_MODES:
        image = image.convert("RGBA" if image.has_transparency_data else "RGB")
    arr = np.asarray(image)
    return arr[:, :, None] if arr.ndim == 2 else arr


ARRAY_MODES = frozenset(CHANNELS_TO_MODE.values())
"""The PIL modes whose pixels are an array as they are (``L``, ``RGB``, ``RGBA``); a frame in
any other mode is converted first."""
# A video's frames given as data: URLs are images.
_FRAME_DATA_URL_TYPES: tuple[str, ...] = ("image/",)


def is_frame(obj: Any) -> bool:
    """Whether ``obj`` is one frame (a PIL image, a 2-D or 3-D array or tensor), so that a list
    starting with it is one video given as frames rather than a list of videos."""
    return isinstance(obj, Image.Image) or (is_array(obj) and obj.ndim in (2, 3))
