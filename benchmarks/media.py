"""Benchmark decoding media files: video sampling against decoding every frame, and audio decoding
plus resampling.

Run: ``.venv/bin/python benchmarks/media.py``. Prints two Markdown tables. The files are made here
with PyAV / soundfile (mmproc.testing.samples): a 1280x720, 30 fps H.264 mp4 of moving shapes over
a gradient with a little noise, once with x264's default keyframe interval (250 frames) and once
with a keyframe every second (as streaming encoders set it); and a minute of 44.1 kHz stereo as
WAV, FLAC and MP3. Times are the best of ``--repeat`` runs, per second of video or minute of audio.

"Every frame" is what a caller without mmproc writes: decode each frame with PyAV and convert it to
RGB. mmproc decodes only the groups of pictures that hold a sampled frame, skips the non-reference
frames it does not keep, and converts only the sampled frames to RGB.
"""

from __future__ import annotations

import argparse
import io
import time
from collections.abc import Callable, Iterator

import av
import numpy as np
from mmproc.inputs import parse_mm_data
from mmproc.media import AudioFormat, MediaLimits, MediaOptions, VideoSampling
from mmproc.testing.samples import encode_audio, encode_video

WIDTH, HEIGHT, FPS = 1280, 720, 30
NO_LIMITS = MediaLimits(
    max_item_bytes=None,
    max_video_seconds=None,
    max_video_frames=None,
    max_audio_seconds=None,
    max_request_decoded_bytes=None,
)


def best_of(fn: Callable[[], object], repeat: int) -> float:
    """The best time (s) of ``repeat`` calls, after one to warm up."""
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def scene(seconds: float) -> Iterator[np.ndarray]:
    """Frames of two moving discs over a gradient, with a little noise (so that the encoder has
    something to code and the decoder something to decode), one at a time."""
    rng = np.random.default_rng(0)
    y, x = np.mgrid[0:HEIGHT, 0:WIDTH]
    background = np.stack(
        [x * 255 // WIDTH, y * 255 // HEIGHT, (x + y) * 255 // (WIDTH + HEIGHT)], axis=-1
    ).astype(np.uint8)
    for i in range(round(seconds * FPS)):
        frame = background.copy()
        for k, (speed, colour) in enumerate([(9, (250, 40, 40)), (-6, (40, 40, 250))]):
            cx = (200 + 300 * k + speed * i) % WIDTH
            cy = HEIGHT // 2 + int(150 * np.sin(i / 15 + k))
            frame[(x - cx) ** 2 + (y - cy) ** 2 < 90**2] = colour
        frame ^= rng.integers(0, 8, frame.shape, dtype=np.uint8)
        yield frame


def every_frame(data: bytes, rgb: bool) -> int:
    with av.open(io.BytesIO(data)) as container:
        if rgb:
            return len(np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)]))
        return sum(1 for _ in container.decode(video=0))


def video_rows(seconds: float, repeat: int) -> list[tuple[str, ...]]:
    count = round(seconds * FPS)
    rows = []
    for gop_name, options in [
        ("keyint 250", {"preset": "veryfast"}),
        ("keyint 30", {"preset": "veryfast", "g": "30"}),
    ]:
        data = encode_video(scene(seconds), fps=FPS, options=options)
        baseline = best_of(lambda d=data: every_frame(d, rgb=True), repeat)
        rows.append(
            (
                gop_name,
                "every frame, decode + RGB",
                str(count),
                f"{baseline / seconds * 1e3:.1f}",
                "1.0x",
            )
        )
        decode_only = best_of(lambda d=data: every_frame(d, rgb=False), repeat)
        rows.append(
            (
                gop_name,
                "every frame, decode only (no RGB)",
                str(count),
                f"{decode_only / seconds * 1e3:.1f}",
                f"{baseline / decode_only:.1f}x",
            )
        )
        for name, sampling in [
            ("mmproc, 2 fps (default)", VideoSampling()),
            ("mmproc, 1 fps", VideoSampling(fps=1)),
            ("mmproc, 4 frames", VideoSampling(num_frames=4)),
            ("mmproc, 8 frames", VideoSampling(num_frames=8)),
            ("mmproc, 32 frames", VideoSampling(num_frames=32)),
            ("mmproc, 30 fps (every frame)", VideoSampling(fps=30)),
        ]:
            media = MediaOptions(video=sampling, limits=NO_LIMITS)
            out: list[int] = []

            def run(d: bytes = data, m: MediaOptions = media, o: list[int] = out) -> None:
                o.append(parse_mm_data({"video": d}, media=m)["video"][0].num_frames)

            took = best_of(run, repeat)
            rows.append(
                (
                    gop_name,
                    name,
                    str(out[-1]),
                    f"{took / seconds * 1e3:.1f}",
                    f"{baseline / took:.1f}x",
                )
            )
    return rows


def audio_rows(seconds: float, repeat: int) -> list[tuple[str, ...]]:
    rng = np.random.default_rng(1)
    t = np.arange(round(seconds * 44100)) / 44100
    wave = np.stack([0.3 * np.sin(2 * np.pi * 440 * t), 0.3 * np.sin(2 * np.pi * 660 * t)])
    wave = (wave + 0.01 * rng.standard_normal(wave.shape)).astype(np.float32)
    keep = MediaOptions(limits=NO_LIMITS)
    to_16k = MediaOptions(audio=AudioFormat(sample_rate=16000, mono=True), limits=NO_LIMITS)
    rows = []
    for fmt in ["wav", "flac", "mp3"]:
        data = encode_audio(wave, 44100, fmt)
        for name, media in [("decode", keep), ("decode + 16 kHz mono", to_16k)]:
            took = best_of(lambda d=data, m=media: parse_mm_data({"audio": d}, media=m), repeat)
            rows.append((fmt, f"{len(data) / 1e6:.1f} MB", name, f"{took / seconds * 60e3:.1f}"))
    return rows


def print_table(header: tuple[str, ...], rows: list[tuple[str, ...]], right: int) -> None:
    """A Markdown table; the last ``right`` columns right-aligned."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    first_right = len(header) - right

    def line(row: tuple[str, ...]) -> str:
        cells = [
            c.rjust(w) if i >= first_right else c.ljust(w)
            for i, (c, w) in enumerate(zip(row, widths))
        ]
        return "| " + " | ".join(cells) + " |"

    print(line(header))
    print(
        "|"
        + "|".join("-" * (w + 1) + (":" if i >= first_right else "-") for i, w in enumerate(widths))
        + "|"
    )
    for row in rows:
        print(line(row))


def main() -> None:
    parser = argparse.ArgumentParser(description="Benchmark video sampling and audio decoding.")
    parser.add_argument("--seconds", type=float, default=8.0, help="length of the 720p video")
    parser.add_argument("--audio-seconds", type=float, default=60.0, help="length of the audio")
    parser.add_argument("--repeat", type=int, default=3, help="runs per measurement (best kept)")
    args = parser.parse_args()
    print(
        f"Video: {WIDTH}x{HEIGHT}, {FPS} fps, H.264 mp4, {args.seconds:g} s; "
        "time per second of video.\n"
    )
    print_table(
        ("GOP", "how", "frames", "ms / s of video", "vs every frame"),
        video_rows(args.seconds, args.repeat),
        right=3,
    )
    print(f"\nAudio: 44.1 kHz stereo, {args.audio_seconds:g} s; time per minute of audio.\n")
    print_table(
        ("file", "size", "what", "ms / min of audio"),
        audio_rows(args.audio_seconds, args.repeat),
        right=1,
    )


if __name__ == "__main__":
    main()
