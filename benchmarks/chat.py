"""Benchmark what chat rendering costs on top of ``process``, with every item cached.

Run: ``.venv/bin/python benchmarks/chat.py [--calls N]``. For a 2-message and a 20-message
conversation holding one 1024x768 JPEG (a ``data:`` URL, as a server receives it), on the qwen_vl
plugin's Qwen2-VL demo model (its real template), it prints one Markdown table:

* ``process_chat``: the whole chat request, median wall time;
* ``process``: the same request as ``process`` takes it (the token ids the template renders, the
  same data URL), median wall time;
* the difference, and the ``render`` stage of ``Processor.recording_stages()`` (checking the
  messages, rendering the template, tokenising): what chat rendering costs;
* the targets: at most 0.5 ms for 2 messages, 2 ms for 20.

The image is cached before timing, so both paths answer from the cache on the caller's thread.
"""

from __future__ import annotations

import argparse
import base64
import io
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from mmproc.factory import get_processor
from mmproc_qwen_vl.demo import write_qwen2_vl_folder
from PIL import Image

TARGETS_MS = {2: 0.5, 20: 2.0}


def median_ms(fn: Callable[[], object], calls: int) -> float:
    fn()  # warm up
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def jpeg_url(width: int = 1024, height: int = 768) -> str:
    rng = np.random.default_rng(0)
    small = rng.integers(0, 256, (height // 8, width // 8, 3), dtype=np.uint8)
    picture = Image.fromarray(small.repeat(8, axis=0).repeat(8, axis=1))
    buffer = io.BytesIO()
    picture.save(buffer, "JPEG", quality=90)
    return "data:image/jpeg;base64," + base64.b64encode(buffer.getvalue()).decode()


def conversation(messages: int, url: str) -> list[dict[str, Any]]:
    """``messages`` turns, user and assistant in turn; the image in the first user turn."""
    chat: list[dict[str, Any]] = [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": url}},
                {"type": "text", "text": "What is in this picture?"},
            ],
        }
    ]
    for turn in range(1, messages):
        role = "assistant" if turn % 2 else "user"
        chat.append({"role": role, "content": f"Turn {turn}: a sentence or two of conversation."})
    return chat


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=200, help="timed calls per row")
    args = parser.parse_args()
    url = jpeg_url()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_qwen2_vl_folder(Path(tmp) / "qwen2-vl")
        with get_processor(folder, warm_up=True) as proc:
            for count in TARGETS_MS:
                chat = conversation(count, url)
                hf = proc.hf_processor
                text = hf.apply_chat_template(
                    [
                        {**m, "content": [{"type": "image"}, m["content"][1]]}
                        if not isinstance(m["content"], str)
                        else m
                        for m in chat
                    ],
                    tokenize=False,
                    add_generation_prompt=True,
                )
                ids = hf.tokenizer.encode(text, add_special_tokens=False)
                mm_data = {"image": [url]}
                assert (
                    proc.process_chat(chat).prompt_token_ids
                    == proc.process(ids, mm_data).prompt_token_ids
                ), "the two paths must be the same request"
                chat_ms = median_ms(lambda chat=chat: proc.process_chat(chat), args.calls)
                plain_ms = median_ms(lambda ids=ids, m=mm_data: proc.process(ids, m), args.calls)
                with proc.recording_stages() as log:
                    for _ in range(args.calls):
                        proc.process_chat(chat)
                render_ms = statistics.median(c.seconds["render"] for c in log.clocks) * 1e3
                target = TARGETS_MS[count]
                rows.append(
                    (
                        f"{count} messages, 1 image (cached)",
                        f"{chat_ms:.3f} ms",
                        f"{plain_ms:.3f} ms",
                        f"{chat_ms - plain_ms:.3f} ms",
                        f"{render_ms:.3f} ms",
                        f"<= {target} ms {'met' if render_ms <= target else 'missed'}",
                    )
                )
    header = ("conversation", "process_chat", "process", "difference", "render stage", "target")
    print(f"chat rendering on top of process, median of {args.calls} calls\n")
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join("---" for _ in header) + "|")
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
