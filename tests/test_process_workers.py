"""Process workers (``worker_kind="process"``): the HF calls in worker processes of their own,
the cache and everything else in this one; the outputs those of the thread pool, bit for bit."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import mmproc
import numpy as np
import pytest
import torch
from mmproc.errors import ConfigurationError, WorkerProcessError
from mmproc.testing import noise_image

IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"


@pytest.fixture(scope="module")
def processes(qwen_folder: Path) -> Iterator[mmproc.Processor]:
    with mmproc.get_processor(
        qwen_folder, worker_kind="process", workers=2, warm_up=True, worker_timeout_s=5
    ) as processor:
        yield processor


@pytest.fixture(scope="module")
def threads(qwen_folder: Path) -> Iterator[mmproc.Processor]:
    with mmproc.get_processor(qwen_folder, workers=2) as processor:
        yield processor


def assert_same(a: mmproc.ProcessedInputs, b: mmproc.ProcessedInputs) -> None:
    assert a.prompt_token_ids == b.prompt_token_ids
    assert [(f.modality, f.placeholder, f.hash) for f in a.features] == [
        (f.modality, f.placeholder, f.hash) for f in b.features
    ]
    for fa, fb in zip(a.features, b.features):
        assert set(fa.data) == set(fb.data)
        for key in fa.data:
            left, right = torch.as_tensor(fa.data[key]), torch.as_tensor(fb.data[key])
            assert left.dtype == right.dtype and torch.equal(left, right), key


def test_process_workers_give_what_the_thread_pool_gives(
    processes: mmproc.Processor, threads: mmproc.Processor
) -> None:
    images = [noise_image(300, 200, seed=1), noise_image(57, 91, seed=2, mode="RGBA")]
    video = np.random.default_rng(3).integers(0, 256, (4, 56, 84, 3), dtype=np.uint8)
    prompt = f"{IMAGE} and {IMAGE} then {VIDEO}"
    mm_data = {"image": images, "video": [video]}
    assert_same(processes.process(prompt, mm_data), threads.process(prompt, mm_data))
    floats = {"do_normalize": True, "do_rescale": True}  # the float path, by request
    assert_same(
        processes.process(prompt, mm_data, hf_kwargs=floats),
        threads.process(prompt, mm_data, hf_kwargs=floats),
    )
    chat = [{"role": "user", "content": [{"type": "image", "image": images[0]}]}]
    assert_same(processes.process_chat(chat), threads.process_chat(chat))


def test_the_cache_is_the_serving_processs_one_for_every_worker(
    processes: mmproc.Processor,
) -> None:
    image = noise_image(120, 80, seed=4)
    first = processes.process(IMAGE, {"image": [image]})
    hits = processes.cache.stats().hits
    for _ in range(4):  # whichever worker would take it, the cache answers
        assert_same(processes.process(IMAGE, {"image": [image]}), first)
    assert processes.cache.stats().hits == hits + 4


def test_an_item_a_worker_rejects_is_named_as_with_threads(processes: mmproc.Processor) -> None:
    too_wide = noise_image(2010, 10, seed=5)  # 201:1, over Qwen's 200:1
    with pytest.raises(mmproc.MediaItemError, match=r"image item 1: .*aspect ratio"):
        processes.process(IMAGE * 2, {"image": [noise_image(64, 64, seed=6), too_wide]})


def wait_for_workers(processor: mmproc.Processor, count: int) -> list[int]:
    deadline = time.monotonic() + 120
    while len(processor._processes.pids) < count:  # type: ignore[union-attr]
        assert time.monotonic() < deadline, "the worker was not replaced"
        time.sleep(0.1)
    return processor._processes.pids  # type: ignore[union-attr]


def test_a_worker_that_dies_fails_only_its_request_and_is_replaced(
    processes: mmproc.Processor,
) -> None:
    pids = wait_for_workers(processes, 2)
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    failed = 0
    for seed in (7, 8):  # each worker is lent once before it is known dead
        try:
            processes.process(IMAGE, {"image": [noise_image(90, 60, seed=seed)]})
        except WorkerProcessError as exc:
            assert "died (exit code -9)" in str(exc)
            failed += 1
    assert failed == 2
    replaced = wait_for_workers(processes, 2)
    assert not set(replaced) & set(pids)
    assert processes.process(IMAGE, {"image": [noise_image(90, 60, seed=9)]}).features


def test_a_worker_that_hangs_is_stopped_at_the_time_limit_and_replaced(
    processes: mmproc.Processor,
) -> None:
    pids = wait_for_workers(processes, 2)
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)  # they hang
    with pytest.raises(WorkerProcessError, match=r"took longer than 5 s.*worker_timeout_s"):
        processes.process(IMAGE, {"image": [noise_image(90, 60, seed=10)]})
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):  # the stopped one is gone
            os.kill(pid, signal.SIGCONT)
    replaced = wait_for_workers(processes, 2)
    assert len(set(replaced) - set(pids)) >= 1  # the one that timed out is a new process
    assert processes.process(IMAGE, {"image": [noise_image(90, 60, seed=11)]}).features


def test_process_workers_need_an_installed_plugin_and_a_folder(
    folder_for, serving, qwen_folder: Path
) -> None:
    from _tiny_models import TinyQwenImageModel

    registry = serving({"ProcessTinyQwen": TinyQwenImageModel})
    with pytest.raises(ConfigurationError, match="needs a model folder and the installed plugins"):
        mmproc.get_processor(
            folder_for("ProcessTinyQwen"), registry=registry, worker_kind="process"
        )
    with pytest.raises(ConfigurationError, match="worker_kind must be 'thread' or 'process'"):
        mmproc.get_processor(qwen_folder, worker_kind="fork")
