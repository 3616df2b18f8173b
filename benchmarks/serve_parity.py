"""``mmproc serve`` against ``vllm launch render``: the same chat requests, the same answers?

Run with the peer environment's Python (vLLM 0.33, as ``../shared/peer/build_vllm_peer.sh``
builds it), so that vLLM's own ``decode_mm_kwargs_item`` reads both servers' items::

    PEER_VENV/bin/python benchmarks/serve_parity.py --mmproc .venv/bin/mmproc [--demo qwen2-vl]

Both servers run on one demo folder (written by mmproc's environment), one after the other. Each
request is a chat of pictures (JPEG and PNG data URLs of several sizes, one or two turns, text
around them); for each, the table says whether the prompt's token ids, the placeholder ranges
and every item's tensors (key, dtype, shape, bytes) and field are equal, as vLLM decodes them.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from PIL import Image


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def picture_url(seed: int, size: tuple[int, int], fmt: str) -> str:
    rng = np.random.default_rng(seed)
    coarse = rng.integers(0, 256, (max(size[1] // 16, 1), max(size[0] // 16, 1), 3), np.uint8)
    image = Image.fromarray(coarse).resize(size, Image.Resampling.BICUBIC)
    buffer = io.BytesIO()
    image.save(buffer, fmt)
    mime = "jpeg" if fmt == "JPEG" else "png"
    return f"data:image/{mime};base64," + base64.b64encode(buffer.getvalue()).decode()


def part(seed: int, size: tuple[int, int], fmt: str = "JPEG") -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": picture_url(seed, size, fmt)}}


def text(value: str) -> dict[str, Any]:
    return {"type": "text", "text": value}


def requests() -> dict[str, dict[str, Any]]:
    """Named chat bodies."""
    return {
        "one 1024x768 JPEG": {
            "messages": [{"role": "user", "content": [part(1, (1024, 768)), text("What is it?")]}]
        },
        "one 333x517 PNG": {
            "messages": [{"role": "user", "content": [text("Look:"), part(2, (333, 517), "PNG")]}]
        },
        "two pictures, two turns": {
            "messages": [
                {"role": "user", "content": [part(3, (640, 480)), text("And this?")]},
                {"role": "assistant", "content": "A picture."},
                {"role": "user", "content": [text("Compare:"), part(4, (200, 900))]},
            ]
        },
        "a system message, string content": {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": [part(5, (1280, 720)), text("Describe.")]},
            ]
        },
        "text only": {"messages": [{"role": "user", "content": "Hello there."}]},
        "no generation prompt": {
            "messages": [{"role": "user", "content": [part(6, (64, 64)), text("Tiny.")]}],
            "add_generation_prompt": False,
        },
    }


def start(command: list[str], port: int, env: dict[str, str] | None = None) -> subprocess.Popen:
    process = subprocess.Popen(
        command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env
    )
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{command[0]} exited with {process.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return process
        except httpx.TransportError:
            pass
        time.sleep(0.25)
    process.terminate()
    raise RuntimeError(f"{command[0]} did not become healthy")


def answers(command: list[str], port: int, env: dict[str, str] | None = None) -> dict[str, Any]:
    process = start(command, port, env)
    try:
        url = f"http://127.0.0.1:{port}/v1/chat/completions/render"
        got = {}
        for name, body in requests().items():
            response = httpx.post(url, json={"model": "parity", **body}, timeout=120)
            got[name] = (response.status_code, response.json())
        return got
    finally:
        process.terminate()
        process.wait(60)


def items(answer: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """Each modality's items as vLLM decodes them: key -> (dtype, shape, bytes, field)."""
    import torch
    from vllm.entrypoints.scale_out.token_in_token_out.mm_serde import decode_mm_kwargs_item

    decoded: dict[str, list[dict[str, Any]]] = {}
    for modality, encoded in ((answer.get("features") or {}).get("kwargs_data") or {}).items():
        for data in encoded:
            item = decode_mm_kwargs_item(data)
            decoded.setdefault(modality, []).append(
                {
                    key: (
                        str(element.data.dtype),
                        tuple(element.data.shape),
                        element.data.contiguous().view(-1).view(torch.uint8).numpy().tobytes(),
                        type(element.field).__name__,
                    )
                    for key, element in item.items()
                }
            )
    return decoded


def compare(ours: dict[str, Any], theirs: dict[str, Any]) -> str:
    if ours["token_ids"] != theirs["token_ids"]:
        return "prompt ids differ"
    features = (ours.get("features") or {}, theirs.get("features") or {})
    if features[0].get("mm_placeholders") != features[1].get("mm_placeholders"):
        return "placeholders differ"
    a, b = items(ours), items(theirs)
    if a.keys() != b.keys() or any(len(a[m]) != len(b[m]) for m in a):
        return "items differ in number"
    for modality in a:
        for index, (x, y) in enumerate(zip(a[modality], b[modality], strict=True)):
            if x.keys() != y.keys():
                return f"{modality} {index}: keys {sorted(x)} vs {sorted(y)}"
            for key in x:
                if x[key] != y[key]:
                    what = ("dtype", "shape", "bytes", "field")
                    which = next(w for w, p, q in zip(what, x[key], y[key], strict=True) if p != q)
                    return f"{modality} {index}: {key} differs in {which}"
    return "equal"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mmproc", type=Path, required=True, help="the mmproc command")
    parser.add_argument("--demo", default="qwen2-vl", help="the demo model (default qwen2-vl)")
    args = parser.parse_args()
    python = args.mmproc.parent / "python"
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / args.demo
        write = (
            "import sys; from pathlib import Path; from mmproc.demo_models import open_model; "
            "folder, _ = open_model(sys.argv[1], Path(sys.argv[2])); print(folder)"
        )
        written = subprocess.run(
            [str(python), "-c", write, f"demo:{args.demo}", tmp],
            check=True,
            capture_output=True,
            text=True,
        )
        folder = Path(written.stdout.strip().splitlines()[-1])
        port = free_port()
        serve = [str(args.mmproc), "serve", "--model", str(folder), "--port", str(port)]
        ours = answers([*serve, "--served-model-name", "parity", "--log-level", "warning"], port)
        port = free_port()
        vllm = str(Path(sys.executable).parent / "vllm")
        render = [vllm, "launch", "render", str(folder), "--host", "127.0.0.1", "--port", str(port)]
        theirs = answers(
            [*render, "--served-model-name", "parity"],
            port,
            env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"},
        )
    print(
        f"demo:{args.demo}: mmproc serve against vllm launch render, items as vLLM decodes them\n"
    )
    print("| request | mmproc | vLLM | tokens | items | result |")
    print("|---|---:|---:|---:|---:|---|")
    failures = 0
    for name in requests():
        (status_a, a), (status_b, b) = ours[name], theirs[name]
        if status_a != 200 or status_b != 200:
            result = "not both answered"
        else:
            result = compare(a, b)
        failures += result != "equal"
        count = sum(len(v) for v in ((a.get("features") or {}).get("kwargs_data") or {}).values())
        print(
            f"| {name} | {status_a} | {status_b} | {len(a.get('token_ids') or [])} | {count} "
            f"| {result} |"
        )
    print(json.dumps({"requests": len(ours), "differing": failures}))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
