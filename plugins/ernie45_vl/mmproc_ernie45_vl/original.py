"""ERNIE-4.5-VL's original-layout processor, rebuilt from the model's rules (its own is remote
code, never run).

What Baidu's processor does with a prompt and its media, restated here:

* **Markers.** An image is written ``<|IMAGE_START|><|image@placeholder|><|IMAGE_END|>`` in the
  prompt, a video ``<|VIDEO_START|><|video@placeholder|><|VIDEO_END|>``; the chat template adds
  ``Picture N:`` / ``Video N:`` before them. Each marker becomes its start token,
  ``<|IMAGE_PLACEHOLDER|>`` (``im_patch_id``) repeated once per token, and its end token; videos
  use the image placeholder id too.
* **Sizes.** An image is resized to ``smart_resize`` of its size with factor
  ``patch_size * spatial_conv_size`` (28) and the processor's ``image_min_pixels`` /
  ``image_max_pixels``; a video's frames with ``video_min_pixels`` / ``video_max_pixels``. The
  original rule clamps an aspect ratio over 200 instead of refusing it (:func:`smart_resize`).
  Tokens: ``gh * gw / spatial_conv_size**2`` per image, ``T * gh * gw / (spatial_conv_size**2 *
  temporal_conv_size)`` per video of ``T`` frames, for a ``gh x gw`` patch grid.
* **Pixels.** ``Image.convert("RGB")`` (an alpha band is dropped, not composited), a Pillow
  resize (bicubic) on uint8, then 14 x 14 patches cut channel-major, in 2 x 2 merge blocks
  (:func:`patchify`): rows of ``3 * 14 * 14 = 588`` whole numbers 0-255, one frame per row for
  videos. Baidu's processor returns exactly these (the model or the engine normalises later);
  here they come out raw with ``do_rescale=False, do_normalize=False`` and otherwise rescaled and
  normalised with the folder's ``rescale_factor`` / ``image_mean`` / ``image_std``, as an HF
  processor does, so that mmproc's device normalisation can ship the raw rows as uint8.
* **Video frames** are stamped with their time before resizing (:func:`stamp_frame`): black
  ``"time: HH:MM:SS.ss"`` with a white outline, top left, in the folder's ``Roboto-Regular.ttf``
  at a tenth of the frame's shorter side; an odd frame count is padded with a copy of the last
  stamped frame. The frames given are used as given (mmproc samples video files at the model's
  2 fps before they get here).

The outputs are split the way vLLM and SGLang split Baidu's combined ``images`` / ``grid_thw``
(``pixel_values`` / ``image_grid_thw`` for images, ``pixel_values_videos`` / ``video_grid_thw``
for videos), without their assumption that all images come before all videos. ``token_type_ids``
are Baidu's: 0 for text, 1 for image placeholders and for all four start and end tokens, 2 for
video placeholders. ``position_ids`` (3-D M-RoPE positions) and ``image_type_ids`` are left out:
engines compute the positions from the ids and grids, and the type of each frame is its item's
modality.
"""

from __future__ import annotations

import io
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont

__all__ = [
    "CLIP_MEAN",
    "CLIP_STD",
    "FONT_FILE",
    "IMAGE_END",
    "IMAGE_MARKER",
    "IMAGE_PLACEHOLDER",
    "IMAGE_START",
    "MAX_ASPECT_RATIO",
    "PATCH_TOKEN",
    "VIDEO_END",
    "VIDEO_MARKER",
    "VIDEO_PLACEHOLDER",
    "VIDEO_START",
    "Ernie45VLOriginalImageProcessor",
    "Ernie45VLOriginalProcessor",
    "frame_timestamps",
    "patchify",
    "smart_resize",
    "stamp_frame",
    "timestamp_text",
]

IMAGE_START = "<|IMAGE_START|>"
IMAGE_END = "<|IMAGE_END|>"
VIDEO_START = "<|VIDEO_START|>"
VIDEO_END = "<|VIDEO_END|>"
IMAGE_PLACEHOLDER = "<|image@placeholder|>"
VIDEO_PLACEHOLDER = "<|video@placeholder|>"
#: What the chat template writes per image / video.
IMAGE_MARKER = IMAGE_START + IMAGE_PLACEHOLDER + IMAGE_END
VIDEO_MARKER = VIDEO_START + VIDEO_PLACEHOLDER + VIDEO_END
#: The token each image and video patch token is (``config.json``'s ``im_patch_id``).
PATCH_TOKEN = "<|IMAGE_PLACEHOLDER|>"
#: The font the timestamps are drawn in, a file of the model folder.
FONT_FILE = "Roboto-Regular.ttf"
#: Aspect ratios beyond this are clamped (and the image distorted) by the original rule.
MAX_ASPECT_RATIO = 200

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)

_CHANNELS = 3
_TEXT, _IMAGE, _VIDEO = 0, 1, 2  # Baidu's token types
_FONT_RATE = 0.1  # font size / shorter frame side, and outline width / font size


def smart_resize(
    height: int, width: int, *, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """The ``(height, width)`` the original processor resizes an image of this size to.

    Both sides become multiples of ``factor``, each at least ``factor``, the area inside
    ``[min_pixels, max_pixels]``. Unlike transformers' rule, an aspect ratio over
    `MAX_ASPECT_RATIO` is clamped to 200:1 (the short side rounded to the grid, the long side
    made 200 times that) rather than refused, and a result outside the limits raises.

    Raises:
        ValueError: a side is not positive, or no size inside the limits comes out.
    """
    if height <= 0 or width <= 0:
        raise ValueError(f"an image of {width}x{height} pixels (width x height) has no pixels")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        if height > width:
            width = max(factor, round(width / factor) * factor)
            height = math.floor(width * MAX_ASPECT_RATIO / factor) * factor
        else:
            height = max(factor, round(height / factor) * factor)
            width = math.floor(height * MAX_ASPECT_RATIO / factor) * factor
    h_bar = max(factor, round(height / factor) * factor)
    w_bar = max(factor, round(width / factor) * factor)
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = math.floor(height / beta / factor) * factor
        w_bar = math.floor(width / beta / factor) * factor
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    if not min_pixels <= h_bar * w_bar <= max_pixels:
        raise ValueError(
            f"no size inside [{min_pixels}, {max_pixels}] pixels for an image of "
            f"{width}x{height} (width x height): got {w_bar}x{h_bar}"
        )
    return h_bar, w_bar


def patchify(frames: np.ndarray, *, patch_size: int, merge_size: int) -> np.ndarray:
    """Cut ``(T, H, W, C)`` uint8 frames into the original processor's patch rows.

    Rows: frame by frame; in a frame, the ``merge_size x merge_size`` blocks of patches in
    raster order, and the patches of a block in raster order. A row is one patch, channel-major
    (the ``patch_size x patch_size`` plane of each channel in turn). Returns
    ``(T * gh * gw, C * patch_size**2)`` uint8, C-contiguous.
    """
    count, height, width, channels = frames.shape
    p, m = patch_size, merge_size
    grid_h, grid_w = height // p, width // p
    blocks = frames.reshape(count, grid_h // m, m, p, grid_w // m, m, p, channels)
    # (frame, block row, block col, row in block, col in block, channel, y, x)
    ordered = blocks.transpose(0, 1, 4, 2, 5, 7, 3, 6)
    return np.ascontiguousarray(ordered).reshape(count * grid_h * grid_w, channels * p * p)


def timestamp_text(seconds: float) -> str:
    """``"time: HH:MM:SS.ss"``, hours and minutes taken off whole, seconds with two decimals
    (so 59.999 s reads ``00:00:60.00``, as the original's formatting gives)."""
    hours = minutes = 0
    while seconds >= 3600:
        hours += 1
        seconds -= 3600
    while seconds >= 60:
        minutes += 1
        seconds -= 60
    return f"time: {hours:02d}:{minutes:02d}:{seconds:05.02f}"


def stamp_frame(frame: Image.Image, text: str, font: ImageFont.FreeTypeFont) -> None:
    """Draw ``text`` on ``frame`` in place: black, white outline a tenth of the font size, at
    the top left corner."""
    outline = int(font.size * _FONT_RATE)
    ImageDraw.Draw(frame).text(
        (0, 0), text, font=font, fill=(0, 0, 0), stroke_width=outline, stroke_fill=(255, 255, 255)
    )


def frame_timestamps(metadata: Any, count: int, default_fps: float) -> list[float]:
    """The time of each of ``count`` frames, in seconds.

    ``metadata`` is what the frames came with: mmproc's ``VideoMetadata`` (its sampled frames'
    own timestamps), transformers' ``VideoMetadata`` or a mapping (``frames_indices / fps``), or
    ``None`` for frames given as they are, which are taken as consecutive samples at
    ``default_fps`` (the processor's ``video_fps``: the rate the model's videos are sampled at).
    """
    if metadata is None:
        return [index / default_fps for index in range(count)]
    own = getattr(metadata, "timestamps_s", None)
    if own is not None:
        times = [float(t) for t in own]
    else:
        get = metadata.get if isinstance(metadata, Mapping) else (lambda k: getattr(metadata, k))
        fps, indices = get("fps"), get("frames_indices")
        if indices is None:
            indices = range(count)
        rate = float(fps) if fps else default_fps
        times = [int(index) / rate for index in indices]
    if len(times) != count:
        raise ValueError(f"the video has {count} frames but its metadata times {len(times)}")
    return times


def _frames_of(video: Any) -> list[Image.Image]:
    """A video's frames as RGB images: ``(T, H, W, C)`` uint8 arrays or tensors (C 1, 3 or 4),
    or a sequence of PIL images (converted as the original converts decoded frames)."""
    if isinstance(video, torch.Tensor):
        video = video.numpy()
    if isinstance(video, np.ndarray):
        if video.ndim != 4 or video.shape[-1] not in (1, 3, 4) or video.dtype != np.uint8:
            raise ValueError(
                f"a video must be (frames, height, width, 1 | 3 | 4) uint8, got {video.dtype} "
                f"{tuple(video.shape)}"
            )
        if len(video) == 0:
            raise ValueError("a video has no frames")
        modes = {1: "L", 3: "RGB", 4: "RGBA"}
        channels = video.shape[-1]
        frames = [
            Image.fromarray(f[..., 0] if channels == 1 else f, modes[channels]) for f in video
        ]
    else:
        frames = list(video)
        if not frames or not all(isinstance(f, Image.Image) for f in frames):
            raise ValueError("a video must be an array of frames or a non-empty list of images")
    return [f.convert("RGB") for f in frames]


class Ernie45VLOriginalImageProcessor:
    """Resizing, patch cutting and (optional) normalisation of the original processor.

    Attributes mirror an HF image processor's where they mean the same (``patch_size``,
    ``merge_size``, ``resample``, ``do_rescale``, ``rescale_factor``, ``do_normalize``,
    ``image_mean``, ``image_std``), which is what :class:`mmproc.fused_norm.NormSpec` reads.
    """

    temporal_patch_size = 1  # one frame per patch row

    def __init__(
        self,
        *,
        patch_size: int = 14,
        merge_size: int = 2,
        resample: int = int(Image.Resampling.BICUBIC),
        do_rescale: bool = True,
        rescale_factor: float = 1 / 255,
        do_normalize: bool = True,
        image_mean: Sequence[float] = CLIP_MEAN,
        image_std: Sequence[float] = CLIP_STD,
    ) -> None:
        self.patch_size = int(patch_size)
        self.merge_size = int(merge_size)
        self.resample = int(resample)
        self.do_rescale = bool(do_rescale)
        self.rescale_factor = float(rescale_factor)
        self.do_normalize = bool(do_normalize)
        self.image_mean = [float(v) for v in image_mean]
        self.image_std = [float(v) for v in image_std]
        if len(self.image_mean) != _CHANNELS or len(self.image_std) != _CHANNELS:
            raise ValueError("image_mean and image_std need one value per RGB channel")

    @property
    def factor(self) -> int:
        """Both sides of a resized image are multiples of this (28)."""
        return self.patch_size * self.merge_size

    def resized_size(
        self, height: int, width: int, min_pixels: int, max_pixels: int
    ) -> tuple[int, int]:
        """``(height, width)`` after resizing (:func:`smart_resize`)."""
        return smart_resize(
            height, width, factor=self.factor, min_pixels=min_pixels, max_pixels=max_pixels
        )

    def patch_rows(self, frames: Sequence[Image.Image], size: tuple[int, int]) -> np.ndarray:
        """RGB images (one image, or a video's frames) resized to ``size`` and cut into uint8
        patch rows."""
        height, width = size
        resample = Image.Resampling(self.resample)
        resized = np.empty((len(frames), height, width, _CHANNELS), dtype=np.uint8)
        for index, frame in enumerate(frames):
            resized[index] = np.asarray(frame.resize((width, height), resample))
        return patchify(resized, patch_size=self.patch_size, merge_size=self.merge_size)

    def finish(
        self, rows: np.ndarray, do_rescale: bool | None, do_normalize: bool | None
    ) -> torch.Tensor:
        """The rows as they leave the processor: uint8 with both switches off, else float32
        ``(x * rescale_factor - mean) / std`` per channel (each switch defaulting to the
        folder's setting)."""
        rescale = self.do_rescale if do_rescale is None else do_rescale
        normalize = self.do_normalize if do_normalize is None else do_normalize
        pixels = torch.from_numpy(rows)
        if not (rescale or normalize):
            return pixels
        values = pixels.to(torch.float32)
        if rescale:
            values = values * self.rescale_factor
        if normalize:
            plane = self.patch_size * self.patch_size
            mean = torch.tensor(self.image_mean, dtype=torch.float32).repeat_interleave(plane)
            std = torch.tensor(self.image_std, dtype=torch.float32).repeat_interleave(plane)
            values = (values - mean) / std
        return values


class Ernie45VLOriginalProcessor:
    """Tokenizer and image processor of an original-layout folder, with the model's prompt rules
    (see the module docs). Keeps no state between calls; deep-copies cleanly (each worker
    thread gets its own copy)."""

    def __init__(
        self,
        *,
        tokenizer: Any,
        image_processor: Ernie45VLOriginalImageProcessor,
        font_bytes: bytes,
        spatial_conv_size: int = 2,
        temporal_conv_size: int = 2,
        image_min_pixels: int = 4 * 28 * 28,
        image_max_pixels: int = 6177 * 28 * 28,
        video_min_pixels: int = 299 * 28 * 28,
        video_max_pixels: int = 1196 * 28 * 28,
        video_fps: float = 2,
        video_min_frames: int = 16,
        video_max_frames: int = 180,
        chat_template: str | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        self.font_bytes = font_bytes
        self.spatial_conv_size = int(spatial_conv_size)
        self.temporal_conv_size = int(temporal_conv_size)
        self.image_min_pixels = int(image_min_pixels)
        self.image_max_pixels = int(image_max_pixels)
        self.video_min_pixels = int(video_min_pixels)
        self.video_max_pixels = int(video_max_pixels)
        self.video_fps = float(video_fps)
        self.video_min_frames = int(video_min_frames)
        self.video_max_frames = int(video_max_frames)
        self.chat_template = chat_template
        ids = {token: self._single_id(token) for token in _SINGLE_TOKENS}
        self.im_patch_id = ids[PATCH_TOKEN]
        self.image_start_token_id = ids[IMAGE_START]
        self.image_end_token_id = ids[IMAGE_END]
        self.video_start_token_id = ids[VIDEO_START]
        self.video_end_token_id = ids[VIDEO_END]
        #: Each marker as the tokenizer splits it: what prompts and prompt updates match.
        self.image_marker_ids = self._marker_ids(IMAGE_MARKER, IMAGE_START, IMAGE_END)
        self.video_marker_ids = self._marker_ids(VIDEO_MARKER, VIDEO_START, VIDEO_END)

    def _single_id(self, token: str) -> int:
        index = self.tokenizer.convert_tokens_to_ids(token)
        if not isinstance(index, int) or index == self.tokenizer.unk_token_id:
            raise ValueError(f"the tokenizer has no {token} token")
        return index

    def _marker_ids(self, marker: str, start: str, end: str) -> tuple[int, ...]:
        ids = tuple(self.tokenizer.encode(marker, add_special_tokens=False))
        if len(ids) < 3 or ids[0] != self._single_id(start) or ids[-1] != self._single_id(end):
            raise ValueError(f"the tokenizer does not keep {start} and {end} whole in {marker}")
        return ids

    # --- token counts ----------------------------------------------------------------------

    def image_token_count(self, grid_thw: Sequence[int]) -> int:
        """Placeholder tokens of an image with patch grid ``(1, gh, gw)``."""
        t, h, w = (int(v) for v in grid_thw)
        return t * h * w // self.spatial_conv_size**2

    def video_token_count(self, grid_thw: Sequence[int]) -> int:
        """Placeholder tokens of a video with patch grid ``(T, gh, gw)`` (T even)."""
        t, h, w = (int(v) for v in grid_thw)
        return t * h * w // (self.spatial_conv_size**2 * self.temporal_conv_size)

    # --- media -----------------------------------------------------------------------------

    def _image_rows(self, image: Image.Image) -> tuple[np.ndarray, list[int]]:
        rgb = image.convert("RGB")
        width, height = rgb.size
        ip = self.image_processor
        size = ip.resized_size(height, width, self.image_min_pixels, self.image_max_pixels)
        rows = ip.patch_rows([rgb], size)
        return rows, [1, size[0] // ip.patch_size, size[1] // ip.patch_size]

    def _video_rows(self, video: Any, metadata: Any) -> tuple[np.ndarray, list[int]]:
        frames = _frames_of(video)
        width, height = frames[0].size
        if any(f.size != (width, height) for f in frames):
            raise ValueError("the frames of a video differ in size")
        font_size = int(min(width, height) * _FONT_RATE)
        if font_size < 1:
            raise ValueError(
                f"frames of {width}x{height} pixels are too small to stamp their time on (the "
                f"font is a tenth of the shorter side); the model takes frames of at least "
                f"{math.ceil(1 / _FONT_RATE)} pixels a side"
            )
        font = ImageFont.truetype(io.BytesIO(self.font_bytes), font_size)
        for frame, seconds in zip(
            frames, frame_timestamps(metadata, len(frames), self.video_fps), strict=True
        ):
            stamp_frame(frame, timestamp_text(seconds), font)
        if len(frames) % self.temporal_conv_size:
            pad = self.temporal_conv_size - len(frames) % self.temporal_conv_size
            frames += [frames[-1].copy() for _ in range(pad)]
        ip = self.image_processor
        size = ip.resized_size(height, width, self.video_min_pixels, self.video_max_pixels)
        rows = ip.patch_rows(frames, size)
        return rows, [len(frames), size[0] // ip.patch_size, size[1] // ip.patch_size]

    # --- the call ----------------------------------------------------------------------------

    def __call__(
        self,
        text: str | Sequence[str] | None = None,
        images: Sequence[Image.Image] | Image.Image | None = None,
        videos: Sequence[Any] | None = None,
        *,
        video_metadata: Sequence[Any] | None = None,
        do_rescale: bool | None = None,
        do_normalize: bool | None = None,
        return_tensors: str | None = "pt",
    ) -> dict[str, torch.Tensor]:
        """Tokenise one prompt with its image and video markers expanded for ``images`` and
        ``videos`` (each in prompt order), and process the media.

        Returns torch tensors (batch of one for the prompt): ``input_ids``, ``attention_mask``,
        ``token_type_ids``; with images ``pixel_values`` (rows of 588) and ``image_grid_thw``
        ``(1, gh, gw)``; with videos ``pixel_values_videos`` and ``video_grid_thw``
        ``(T, gh, gw)``. Pixels are uint8 with ``do_rescale=False, do_normalize=False``, float32
        otherwise. ``video_metadata``: one entry per video, see :func:`frame_timestamps`.
        """
        if return_tensors not in (None, "pt"):
            raise ValueError(f"return_tensors must be 'pt' (or None), got {return_tensors!r}")
        if text is None:
            raise ValueError("a prompt is needed (text=...)")
        prompts = [text] if isinstance(text, str) else list(text)
        if len(prompts) != 1:
            raise ValueError(f"one prompt per call, got {len(prompts)}")
        image_list = [images] if isinstance(images, Image.Image) else list(images or ())
        video_list = list(videos or ())
        metadata = list(video_metadata) if video_metadata is not None else [None] * len(video_list)
        if len(metadata) != len(video_list):
            raise ValueError(f"{len(video_list)} videos but {len(metadata)} video_metadata entries")

        ids = list(self.tokenizer(prompts[0])["input_ids"])
        image_spots, video_spots = self._find_markers(ids)
        for what, spots, given, marker in (
            ("image", image_spots, image_list, IMAGE_MARKER),
            ("video", video_spots, video_list, VIDEO_MARKER),
        ):
            if len(spots) != len(given):
                raise ValueError(
                    f"the prompt has {len(spots)} {what} markers ({marker}) but {len(given)} "
                    f"{what}s were given"
                )

        outputs: dict[str, torch.Tensor] = {}
        image_counts: list[int] = []
        if image_list:
            rows, grids = zip(*(self._image_rows(image) for image in image_list), strict=True)
            outputs["pixel_values"] = self.image_processor.finish(
                np.concatenate(rows), do_rescale, do_normalize
            )
            outputs["image_grid_thw"] = torch.tensor(grids, dtype=torch.long)
            image_counts = [self.image_token_count(grid) for grid in grids]
        video_counts: list[int] = []
        if video_list:
            rows, grids = zip(
                *(self._video_rows(v, m) for v, m in zip(video_list, metadata, strict=True)),
                strict=True,
            )
            outputs["pixel_values_videos"] = self.image_processor.finish(
                np.concatenate(rows), do_rescale, do_normalize
            )
            outputs["video_grid_thw"] = torch.tensor(grids, dtype=torch.long)
            video_counts = [self.video_token_count(grid) for grid in grids]

        expanded, types = self._expand(ids, image_spots, image_counts, video_spots, video_counts)
        return {
            "input_ids": torch.tensor([expanded], dtype=torch.long),
            "attention_mask": torch.ones((1, len(expanded)), dtype=torch.long),
            "token_type_ids": torch.tensor([types], dtype=torch.long),
            **outputs,
        }

    def _find_markers(self, ids: Sequence[int]) -> tuple[list[int], list[int]]:
        """Start positions of the image and of the video markers in ``ids``, left to right,
        never overlapping."""
        images: list[int] = []
        videos: list[int] = []
        i = 0
        while i < len(ids):
            for marker, found in ((self.image_marker_ids, images), (self.video_marker_ids, videos)):
                if tuple(ids[i : i + len(marker)]) == marker:
                    found.append(i)
                    i += len(marker)
                    break
            else:
                i += 1
        return images, videos

    def _expand(
        self,
        ids: Sequence[int],
        image_spots: Sequence[int],
        image_counts: Sequence[int],
        video_spots: Sequence[int],
        video_counts: Sequence[int],
    ) -> tuple[list[int], list[int]]:
        """The prompt ids with each marker expanded, and Baidu's token types."""
        spots = sorted(
            [(at, "image", n) for at, n in zip(image_spots, image_counts, strict=True)]
            + [(at, "video", n) for at, n in zip(video_spots, video_counts, strict=True)]
        )
        expanded: list[int] = []
        types: list[int] = []
        position = 0
        for at, modality, count in spots:
            expanded += ids[position:at]
            types += [_TEXT] * (at - position)
            if modality == "image":
                start, end, kind = self.image_start_token_id, self.image_end_token_id, _IMAGE
                position = at + len(self.image_marker_ids)
            else:
                start, end, kind = self.video_start_token_id, self.video_end_token_id, _VIDEO
                position = at + len(self.video_marker_ids)
            expanded += [start, *[self.im_patch_id] * count, end]
            types += [_IMAGE, *[kind] * count, _IMAGE]
        expanded += ids[position:]
        types += [_TEXT] * (len(ids) - position)
        return expanded, types

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any:
        """The tokenizer's chat template call, with the folder's template."""
        if self.chat_template is not None:
            kwargs.setdefault("chat_template", self.chat_template)
        return self.tokenizer.apply_chat_template(conversation, **kwargs)


_SINGLE_TOKENS = (PATCH_TOKEN, IMAGE_START, IMAGE_END, VIDEO_START, VIDEO_END)
