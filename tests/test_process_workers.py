"""Process workers (``worker_kind="process"``): the HF calls in worker processes lent from an
idle queue, the cache and everything else in this one; the outputs those of the thread pool, bit
for bit; a worker that dies, hangs or never starts fails only its request and leaves no shared
memory behind; errors cross from a worker with what they name."""

from __future__ import annotations

import contextlib
import errno
import gc
import multiprocessing
import os
import pickle
import signal
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.shared_memory import SharedMemory
from pathlib import Path

import mmproc
import mmproc.errors
import numpy as np
import pytest
import torch
from mmproc.errors import (
    ChatRequestError,
    ChatTemplateError,
    ConfigurationError,
    DecodeError,
    EncodeError,
    FieldSpecError,
    IncompatiblePluginError,
    MediaItemError,
    MmprocError,
    PluginConflictError,
    PluginError,
    PluginLoadError,
    PluginSpecError,
    ProcessingError,
    ProcessorLoadError,
    PromptUpdateError,
    UnknownArchitectureError,
    WorkerProcessError,
)
from mmproc.lent_blocks import LENDABLE_BLOCKS, SHM_HEADROOM, LendableBlocks
from mmproc.media.pillow_pixels import still_borrowed
from mmproc.output_memory import OutputArena, outputs_in
from mmproc.plugin import output_tensor
from mmproc.process_workers import (
    WorkerProcesses,
    WorkerSpec,
    _items_kept,
    _portable,
    _send_answer,
)
from mmproc.shared_blocks import (
    AttachedBlocks,
    KeptBlock,
    call_block_names,
    read_items,
    read_outputs,
    release_block,
    write_items,
    write_outputs,
)
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
    def items_blocks() -> set[str]:
        return {name for name in processes._processes.kept_blocks if name.endswith("_in")}  # type: ignore[union-attr]

    before = items_blocks()
    too_wide = noise_image(2010, 10, seed=5)  # 201:1, over Qwen's 200:1
    with pytest.raises(mmproc.MediaItemError, match=r"image item 1: .*aspect ratio"):
        processes.process(IMAGE * 2, {"image": [noise_image(64, 64, seed=6), too_wide]})
    # The failed calls let go of their items (images made over the items block): every worker
    # keeps its block.
    assert before and before <= items_blocks()


def wait_for_workers(processor: mmproc.Processor, count: int) -> list[int]:
    deadline = time.monotonic() + 120
    while len(processor._processes.pids) < count:  # type: ignore[union-attr]
        assert time.monotonic() < deadline, "the worker was not replaced"
        time.sleep(0.1)
    return processor._processes.pids  # type: ignore[union-attr]


def wait_until(condition: Callable[[], bool], failure: str) -> None:
    deadline = time.monotonic() + 60
    while not condition():
        assert time.monotonic() < deadline, failure
        time.sleep(0.02)


def blocks_of_this_process() -> list[str]:
    """This process's shared memory blocks in /dev/shm: those its workers keep
    (``mmproc_<pid>_w<worker>_…``) and those of single calls (``mmproc_<pid>_<call>_in`` /
    ``_out``)."""
    return sorted(path.name for path in Path("/dev/shm").glob(f"mmproc_{os.getpid()}_*"))


def call_blocks() -> list[str]:
    return [name for name in blocks_of_this_process() if f"_{os.getpid()}_w" not in name]


def assert_only_live_workers_blocks(processor: mmproc.Processor) -> None:
    """No call's block is left, and the blocks kept are the live workers' own."""
    assert call_blocks() == []
    assert blocks_of_this_process() == processor._processes.kept_blocks  # type: ignore[union-attr]


def has_exited(pid: int) -> bool:
    """Whether ``pid`` has exited, so that its parent can see it: a zombie with no thread left
    but its first (a zombie whose other threads are still exiting cannot be waited for yet)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        threads = len(os.listdir(f"/proc/{pid}/task"))
    except FileNotFoundError:
        return True
    return state == "Z" and threads == 1


def test_each_worker_keeps_its_blocks_and_grows_them_for_a_larger_call(
    processes: mmproc.Processor, threads: mmproc.Processor
) -> None:
    small, large = noise_image(64, 48, seed=13), noise_image(640, 480, seed=14)
    sizes = []
    for image in (small, large, small, large):  # whichever worker takes each
        mm_data = {"image": [image]}
        assert_same(processes.process(IMAGE, mm_data), threads.process(IMAGE, mm_data))
        assert_only_live_workers_blocks(processes)
        sizes.append(sorted(os.path.getsize(f"/dev/shm/{n}") for n in blocks_of_this_process()))
    assert len(sizes[-1]) <= 2 * (2 + LENDABLE_BLOCKS)  # items, outputs, and those lent
    assert max(sizes[1]) >= 640 * 480 * 3  # grown for the large image's items
    assert sizes[3] == sizes[2]  # and kept, not made again, for the calls that fit


def test_a_call_larger_than_a_worker_keeps_goes_in_blocks_of_its_own(
    processes: mmproc.Processor, threads: mmproc.Processor, monkeypatch: pytest.MonkeyPatch
) -> None:
    import mmproc.shared_blocks

    monkeypatch.setattr(mmproc.shared_blocks, "KEPT_BLOCK_MAX", 1 << 16)
    before = {n: os.path.getsize(f"/dev/shm/{n}") for n in blocks_of_this_process()}
    mm_data = {"image": [noise_image(400, 300, seed=15)]}  # 360 kB of pixels, more outputs
    for _ in range(2):
        assert_same(processes.process(IMAGE, mm_data), threads.process(IMAGE, mm_data))
        assert call_blocks() == []
    after = {n: os.path.getsize(f"/dev/shm/{n}") for n in blocks_of_this_process()}
    assert all(size <= max(1 << 16, before.get(n, 0)) for n, size in after.items())


def test_shared_memory_that_runs_out_fails_the_request_with_an_error_not_the_server(
    processes: mmproc.Processor, monkeypatch: pytest.MonkeyPatch
) -> None:
    mm_data = {"image": [noise_image(800, 600, seed=16)]}  # more than any worker's block holds
    with monkeypatch.context() as patched:

        def full(fd: int, offset: int, length: int) -> None:
            raise OSError(errno.ENOSPC, "No space left on device")

        patched.setattr(os, "posix_fallocate", full)
        with pytest.raises(
            WorkerProcessError, match=r"\): this request's items: no shared memory for [\d,]+ bytes"
        ):
            processes.process(IMAGE, mm_data)
    assert_only_live_workers_blocks(processes)
    assert processes.process(IMAGE, mm_data).features


def test_where_shared_memory_cannot_be_reserved_blocks_are_made_without(
    processes: mmproc.Processor, threads: mmproc.Processor, monkeypatch: pytest.MonkeyPatch
) -> None:
    mm_data = {"image": [noise_image(1000, 800, seed=22)]}  # more than any block holds yet

    def unsupported(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.EOPNOTSUPP, "Operation not supported")

    with monkeypatch.context() as patched:
        patched.setattr(os, "posix_fallocate", unsupported)
        assert_same(processes.process(IMAGE, mm_data), threads.process(IMAGE, mm_data))
    assert_only_live_workers_blocks(processes)


def test_an_idle_worker_reaped_by_someone_else_is_still_seen_dead(
    processes: mmproc.Processor,
) -> None:
    pids = wait_for_workers(processes, 2)
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
        # Reaped here, as a SIGCHLD handler or waitpid(-1) elsewhere in the host process would:
        # multiprocessing's own waitpid then fails, and its is_alive() says True.
        os.waitpid(pid, 0)
    try:
        for seed in (23, 24):  # seeds no other test asks for: each a miss, sent to a worker
            assert processes.process(IMAGE, {"image": [noise_image(90, 60, seed=seed)]}).features
        assert not set(wait_for_workers(processes, 2)) & set(pids)
    finally:
        # The exit statuses taken above are multiprocessing's to read: handed back, so that its
        # active_children() does not list these processes as alive for the tests that follow.
        for child in multiprocessing.active_children():
            if child.pid in pids and child._popen is not None:  # type: ignore[attr-defined]
                child._popen.returncode = -signal.SIGKILL  # type: ignore[attr-defined]


def test_a_worker_that_dies_fails_only_its_request_and_one_dead_while_idle_fails_none(
    processes: mmproc.Processor,
) -> None:
    pids = wait_for_workers(processes, 2)
    workers = processes._processes
    assert workers is not None
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)  # whichever worker is lent the call, it holds it unanswered
    with ThreadPoolExecutor(1) as caller:
        request = caller.submit(processes.process, IMAGE, {"image": [noise_image(90, 60, seed=7)]})
        wait_until(lambda: workers.calls_in_flight == 1, "the call never reached a worker")
        kept_by_the_dead = set(workers.kept_blocks)
        assert kept_by_the_dead
        for pid in pids:  # the one on the call, and the one idle
            os.kill(pid, signal.SIGKILL)
        with pytest.raises(WorkerProcessError, match=r"died \(exit code -9\)"):
            request.result(timeout=60)
    assert call_blocks() == []
    wait_until(lambda: all(has_exited(pid) for pid in pids), "the killed workers did not exit")
    for seed in (8, 9):  # no request is given the worker that died idle
        assert processes.process(IMAGE, {"image": [noise_image(90, 60, seed=seed)]}).features
    assert not set(wait_for_workers(processes, 2)) & set(pids)
    assert not kept_by_the_dead & set(blocks_of_this_process())
    assert_only_live_workers_blocks(processes)


def test_a_worker_that_hangs_is_stopped_at_the_time_limit_and_replaced(
    processes: mmproc.Processor,
) -> None:
    pids = wait_for_workers(processes, 2)
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)  # they hang
    with pytest.raises(WorkerProcessError, match=r"took longer than 5 s.*worker_timeout_s"):
        processes.process(IMAGE, {"image": [noise_image(90, 60, seed=10)]})
    assert_only_live_workers_blocks(processes)  # the stopped worker's blocks went with it
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):  # the stopped one is gone
            os.kill(pid, signal.SIGCONT)
    replaced = wait_for_workers(processes, 2)
    assert len(set(replaced) - set(pids)) >= 1  # the one that timed out is a new process
    assert processes.process(IMAGE, {"image": [noise_image(90, 60, seed=11)]}).features


def test_a_worker_that_hangs_at_start_up_is_stopped_and_its_calls_fail_naming_the_model(
    tmp_path: Path,
) -> None:
    folder = tmp_path / "hangs"
    folder.mkdir()
    os.mkfifo(folder / "config.json")  # reading it waits for a writer that never comes
    workers = WorkerProcesses(
        WorkerSpec(str(folder), mmproc.get_processor),
        1,
        timeout_s=5,
        model="HangingModel",
        background=False,  # as with warm_up=True: construction waits for the start
        startup_timeout_s=2,
    )
    try:
        with pytest.raises(
            WorkerProcessError,
            match=r"^HangingModel: no worker process: .* did not start within 2 s",
        ):
            workers.call(None, IMAGE, {"image": [noise_image(90, 60, seed=12)]}, {})
        assert call_blocks() == []  # the items were never put in shared memory
        assert workers.kept_blocks == []
    finally:
        workers.close()


def test_workers_closed_while_they_start_are_stopped_before_close_returns(
    processes: mmproc.Processor, qwen_folder: Path
) -> None:
    others = set(wait_for_workers(processes, 2))
    workers = WorkerProcesses(
        WorkerSpec(str(qwen_folder), mmproc.get_processor), 2, timeout_s=5, model="Qwen2-VL"
    )
    wait_until(lambda: len(starting_workers(others)) == 2, "the workers never started")
    workers.close()  # they are still loading their processors
    assert starting_workers(others) == []
    assert call_blocks() == [] and workers.kept_blocks == []


def starting_workers(others: set[int]) -> list[int]:
    children = multiprocessing.active_children()
    return [p.pid for p in children if p.name.startswith("mmproc-worker") and p.pid not in others]


def mapped_blocks() -> set[str]:
    """The shared memory blocks this process has mapped, unlinked or not."""
    maps = Path("/proc/self/maps").read_text().splitlines()
    return {line.split("/dev/shm/")[1].split()[0] for line in maps if "/dev/shm/mmproc_" in line}


def is_a_view(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a view of memory it was lent (torch.frombuffer), not a copy of it."""
    return not tensor.untyped_storage().resizable()


def test_outputs_are_read_without_a_copy_and_their_block_is_lent_again_once_they_are_gone(
    qwen_folder: Path, threads: mmproc.Processor
) -> None:
    images = [noise_image(160, 120, seed=40 + i) for i in range(2 + LENDABLE_BLOCKS)]
    with mmproc.get_processor(
        qwen_folder, worker_kind="process", workers=1, warm_up=True, cache_bytes=0
    ) as processor:
        workers = processor._processes
        assert workers is not None
        held = [processor.process(IMAGE, {"image": [image]}) for image in images]
        # The first call's outputs size a block for the next; each later call is lent one, until
        # every block is lent and the last call's outputs are copied out.
        assert workers.lent_blocks == LENDABLE_BLOCKS
        pixels = [got.features[0].data["pixel_values"] for got in held]
        assert [is_a_view(p) for p in pixels] == [False] + [True] * LENDABLE_BLOCKS + [False]
        for image, got in zip(images, held):  # nothing was written over while they were held
            assert_same(got, threads.process(IMAGE, {"image": [image]}))
        kept = set(workers.kept_blocks)
        del held, pixels, got
        gc.collect()
        assert workers.lent_blocks == 0
        again = processor.process(IMAGE, {"image": [images[1]]})
        assert is_a_view(again.features[0].data["pixel_values"])
        assert workers.lent_blocks == 1
        assert set(workers.kept_blocks) == kept  # lent again, not made again
        assert_same(again, threads.process(IMAGE, {"image": [images[1]]}))


def test_outputs_lent_a_block_outlive_their_workers_and_unmap_it_when_they_go(
    qwen_folder: Path, threads: mmproc.Processor
) -> None:
    images = [noise_image(100, 80, seed=50), noise_image(120, 90, seed=51)]
    before = set(blocks_of_this_process())
    processor = mmproc.get_processor(
        qwen_folder, worker_kind="process", workers=1, warm_up=True, cache_bytes=0
    )
    held = [processor.process(IMAGE, {"image": [image]}) for image in images]
    assert is_a_view(held[1].features[0].data["pixel_values"])
    lent = set(processor._processes.kept_blocks) - before  # type: ignore[union-attr]
    processor.close()
    assert set(blocks_of_this_process()) <= before  # unlinked with the workers
    for image, got in zip(images, held):  # still readable, and intact
        assert_same(got, threads.process(IMAGE, {"image": [image]}))
    assert lent & mapped_blocks()  # the lent block is mapped while its outputs live
    del held, got
    gc.collect()
    assert not lent & mapped_blocks()


def test_with_no_shared_memory_for_a_block_to_lend_the_outputs_are_copied(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import mmproc.lent_blocks
    import mmproc.shared_blocks

    blocks = LendableBlocks(97, count=1)
    try:
        assert blocks.take(0) is None  # no size known yet: nothing to lend
        with monkeypatch.context() as patched:

            def no_room(name: str, size: int) -> SharedMemory:
                raise WorkerProcessError(f"no shared memory block of {size:,} bytes")

            patched.setattr(mmproc.shared_blocks, "_allocated", no_room)
            assert blocks.take(4096) is None
        with monkeypatch.context() as patched:  # what is left must stay for the workers' own
            patched.setattr(mmproc.lent_blocks, "shared_memory_free", lambda: SHM_HEADROOM)
            assert blocks.take(4096) is None
        box = blocks.take(4096)
        assert box is not None and box.block is not None and box.block.size >= 4096
        buffer = blocks.lend(box)
        assert blocks.take(4096) is None  # its one block is lent
        assert blocks.lent == 1
        del buffer
        assert blocks.lent == 0 and blocks.take(4096) is box
        blocks.give_back(box)
    finally:
        blocks.close()
    assert blocks.names == []


def test_a_block_given_back_after_it_was_lent_is_never_lent_twice() -> None:
    blocks = LendableBlocks(95, count=2)
    try:
        box = blocks.take(4096)
        assert box is not None
        buffer = blocks.lend(box)
        blocks.give_back(box)  # as a call whose read failed after lend does
        del buffer
        again = blocks.take(4096)
        other = blocks.take(4096)  # a new block, not the same one a second time
        assert again is box and other is not None and other is not box
        blocks.give_back(again)
        blocks.give_back(other)
    finally:
        blocks.close()
    assert blocks.names == []


def test_lent_blocks_keep_to_their_budget_and_one_too_small_is_dropped() -> None:
    blocks = LendableBlocks(96, budget=10_100)  # one block of 5,120 bytes, or one of 10,000
    try:
        first = blocks.take(4096)  # 5,120 bytes
        assert first is not None and first.block is not None
        assert blocks.take(4096) is None  # a second would pass the budget
        small = first.block.name
        blocks.give_back(first)
        larger = blocks.take(8000)  # the free one is too small: dropped, and a larger made
        assert larger is not None and larger.block is not None and larger.block.size >= 8000
        assert blocks.forgotten() == [small] and blocks.forgotten() == []
        assert not Path(f"/dev/shm/{small}").exists()
        blocks.give_back(larger)
    finally:
        blocks.close()
    assert blocks.names == []


def test_items_cross_in_shared_memory_as_they_were_given() -> None:
    from mmproc.media.items import AudioItem, VideoItem, VideoMetadata
    from PIL import Image

    several_blocks = Image.new("RGB", (4000, 3000), (1, 2, 3))  # Pillow holds it in pieces
    several_blocks.putpixel((3999, 2999), (9, 8, 7))
    frames = np.random.default_rng(17).integers(0, 256, (3, 20, 30, 3), dtype=np.uint8)
    metadata = VideoMetadata(
        fps=10.0,
        duration_s=0.3,
        total_frames=3,
        frame_indices=(0, 1, 2),
        timestamps_s=(0.0, 0.1, 0.2),
        width=30,
        height=20,
    )
    items = {
        "image": [
            noise_image(31, 17, seed=18),
            several_blocks,
            noise_image(8, 9, seed=19, mode="L"),
            noise_image(5, 6, seed=20, mode="RGBA"),
            noise_image(7, 7, seed=21, mode="P"),  # pickled
        ],
        "video": [VideoItem(frames, metadata)],
        "audio": [AudioItem(np.linspace(-1, 1, 1001, dtype=np.float32), 16000)],
    }
    inbox = KeptBlock(99, "in")
    try:
        at, described = write_items(items, inbox, call_block_names()[0])
        assert at is not None and at[1]  # in the worker's kept block
        copied = read_items(AttachedBlocks(), at, described)
        borrowed: list[int] = []
        lent = read_items(AttachedBlocks(), at, described, borrowed)
        # The RGB, L and RGBA images in one block are the block's memory; the rest are copies.
        assert len(borrowed) == 3 and all(map(still_borrowed, borrowed))
        assert [image.readonly for image in lent["image"]] == [1, 0, 1, 1, 0]
        for back in (copied, lent):
            for given, got in zip(items["image"], back["image"]):
                assert (got.mode, got.size) == (given.mode, given.size)
                assert np.array_equal(np.asarray(got), np.asarray(given))
            assert np.array_equal(back["video"][0].frames, frames)
            assert back["video"][0].metadata == metadata
            assert np.array_equal(back["audio"][0].waveform, items["audio"][0].waveform)
            assert back["audio"][0].sample_rate == 16000
        del lent, back, got  # the images made over the block go with the last reference
        assert not any(map(still_borrowed, borrowed))
    finally:
        inbox.drop()


def processor_keeping_its_items(model: str, **options: object) -> mmproc.Processor:
    """``get_processor``, with a ``process_mm_data`` that keeps every image it is given, the
    mistake a plugin may make, and fails a call if an image it kept has changed since."""
    processor = mmproc.get_processor(model, **options)  # type: ignore[arg-type]
    hooks, kept = processor.model, []

    def process_mm_data(*args: object) -> object:
        for image, pixels in kept:
            assert np.array_equal(np.asarray(image), pixels), "a kept image changed"
        kept.extend((image, np.asarray(image).copy()) for image in args[3]["image"])  # type: ignore[index]
        return original(*args)

    original, hooks.process_mm_data = hooks.process_mm_data, process_mm_data  # type: ignore[method-assign]
    return processor


def test_a_plugin_that_keeps_its_items_gets_a_new_items_block_each_call_and_they_never_change(
    qwen_folder: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from mmproc.context import ProcessingMode

    workers = WorkerProcesses(
        WorkerSpec(str(qwen_folder), processor_keeping_its_items),
        1,
        timeout_s=60,
        model="Keeper",
        background=False,
    )
    try:
        for seed in (23, 24, 25):  # each call checks that the images it kept are unchanged
            mode = ProcessingMode(media_only=True, raw_pixels=False)
            workers.call(mode, IMAGE, {"image": [noise_image(56, 56, seed=seed)]}, {})
            # The worker's items block was given up: the next call gets a new one.
            assert not [name for name in workers.kept_blocks if name.endswith("_in")]
    finally:
        workers.close()
    warnings = [
        r.getMessage() for r in caplog.records if "kept a reference to its items" in r.getMessage()
    ]
    assert len(warnings) == 1 and warnings[0].startswith("Keeper: process_mm_data kept")


def test_a_call_that_kept_its_items_is_told_apart_from_one_that_let_them_go() -> None:
    inbox = KeptBlock(98, "in")
    try:
        at, described = write_items({"image": [noise_image(9, 7, seed=22)]}, inbox, "unused")
        borrowed: list[int] = []
        items = read_items(AttachedBlocks(), at, described, borrowed)
        kept = items["image"][0]
        del items
        assert _items_kept(borrowed)  # the serving process must not write that block again
        cycle: list[object] = [kept]
        cycle.append(cycle)
        del kept, cycle  # only a cycle holds it now: the check collects it
        assert not _items_kept(borrowed)
    finally:
        inbox.drop()


def test_outputs_of_every_size_and_dtype_come_back_bit_for_bit() -> None:
    outputs = {
        "image": [
            {
                "pixel_values": torch.arange(12, dtype=torch.uint8).reshape(3, 4),
                "empty": torch.zeros(0, 5, dtype=torch.float32),
                "halves": torch.tensor([1.5, -2.25], dtype=torch.bfloat16),
                "scalar": torch.tensor(7, dtype=torch.int64),
                "grid": [1, 2, 3],
            }
        ]
    }
    _, name = call_block_names()
    at, layout = write_outputs(outputs, name)
    assert at is not None and not at[1]  # no kept block given: one of the call's own
    block = SharedMemory(name=at[0])
    try:
        back = read_outputs(block, layout)
    finally:
        block.close()
        release_block(name)
    for key, value in outputs["image"][0].items():
        got = back["image"][0][key]
        if isinstance(value, torch.Tensor):
            assert got.dtype == value.dtype and got.shape == value.shape, key
            assert torch.equal(got, value), key
        else:
            assert got == value
    assert call_blocks() == []


@contextlib.contextmanager
def made_in_an_outbox(
    size: int,
) -> Iterator[tuple[AttachedBlocks, tuple[str, int], dict, OutputArena]]:
    """A worker's outputs block of ``size`` bytes or more (its name and size: the outbox), patches
    made in it with ``output_tensor`` while it is the call's arena, and outputs holding those
    patches and a tensor made elsewhere; the block unmapped and unlinked afterwards."""
    kept = KeptBlock(97, "out")
    block = kept.fitted(size)
    assert block is not None
    attached = AttachedBlocks()
    try:
        with outputs_in(attached("out", block.name).buf) as arena:
            patches = output_tensor((6, 40))
            patches.copy_(torch.arange(240, dtype=torch.uint8).reshape(6, 40))
        assert arena is not None
        grid = torch.tensor([[1, 2, 3]], dtype=torch.int64)
        outputs = {
            "image": [
                {"pixel_values": patches[:2], "image_grid_thw": grid},
                {"pixel_values": patches[2:], "image_grid_thw": grid + 1},
            ]
        }
        yield attached, (block.name, block.size), outputs, arena
    finally:
        attached.forget([block.name])
        kept.drop()


def read_back(at: tuple[str, bool, int], layout: list, attached: AttachedBlocks) -> dict:
    block = attached("out", at[0]) if at[1] else SharedMemory(name=at[0])
    back = read_outputs(block, layout)
    copied = {
        modality: [{k: v.clone() for k, v in item.items()} for item in items]
        for modality, items in back.items()
    }
    del back
    if not at[1]:
        block.close()
        release_block(at[0])
    return copied


def test_outputs_made_in_the_outbox_stay_where_they_are_and_the_rest_go_after_them() -> None:
    with made_in_an_outbox(4096) as (attached, outbox, outputs, arena):
        assert arena.used == 240
        _, name = call_block_names()
        at, layout = write_outputs(outputs, name, attached=attached, outbox=outbox, arena=arena)
        assert at is not None and at[0] == outbox[0] and at[1]  # the outbox: no block of its own
        ((modality, entries),) = layout
        assert modality == "image"
        assert [entry["pixel_values"][3] for entry in entries] == [0, 80]  # where they were made
        grids = [entry["image_grid_thw"][3] for entry in entries]
        assert grids == [256, 320] and at[2] == 320 + 24  # after the arena, aligned
        back = read_back(at, layout, attached)
        for got, given in zip(back["image"], outputs["image"]):
            assert torch.equal(got["pixel_values"], given["pixel_values"])
            assert torch.equal(got["image_grid_thw"], given["image_grid_thw"])
        assert call_blocks() == []


def test_outputs_made_in_the_outbox_move_with_the_rest_when_the_rest_do_not_fit() -> None:
    with made_in_an_outbox(300) as (attached, outbox, outputs, arena):
        # No room left after them.
        outputs["image"][0]["mask"] = torch.ones(outbox[1], dtype=torch.bool)
        _, name = call_block_names()
        at, layout = write_outputs(outputs, name, attached=attached, outbox=outbox, arena=arena)
        assert at is not None and at[0] == name and not at[1]  # a block of the call's own
        assert layout[0][1][0]["pixel_values"][3] == 0  # placed again, from the start
        back = read_back(at, layout, attached)
        for got, given in zip(back["image"], outputs["image"]):
            assert set(got) == set(given)
            assert all(torch.equal(got[key], given[key]) for key in given)
        assert call_blocks() == []


def test_outputs_that_cannot_be_sent_back_are_answered_with_an_error_and_freed() -> None:
    worker_end, serving_end = multiprocessing.Pipe()
    _, outputs_name = call_block_names()
    outputs = {"image": [{"pixel_values": torch.ones(4, 3), "made_by": lambda: None}]}
    at, layout = write_outputs(outputs, outputs_name)
    assert call_blocks() == [outputs_name]
    answer = ("ok", (at, layout, None), False)
    assert _send_answer(worker_end, answer, outputs_name, "Tiny (plugin 'x')")
    status, detail, items_kept = serving_end.recv()
    assert (status, items_kept) == ("error", False)
    with pytest.raises(ProcessingError, match=r"^Tiny \(plugin 'x'\): the outputs cannot be sent"):
        raise pickle.loads(detail)
    assert call_blocks() == []


def test_a_media_item_error_from_a_worker_reaches_the_caller_with_its_item() -> None:
    error = pickle.loads(_portable(MediaItemError("video", 2, "its frames are empty")))
    assert type(error) is MediaItemError
    assert (error.modality, error.index, error.reason) == ("video", 2, "its frames are empty")
    assert str(error) == "video item 2: its frames are empty"


def test_an_error_the_caller_cannot_rebuild_comes_back_as_a_processing_error_naming_it() -> None:
    from mmproc_qwen_vl.image_fast_path import ImageSizeError  # its __init__ takes keywords

    error = pickle.loads(_portable(ImageSizeError("too wide", height=1, width=300)))
    assert type(error) is ProcessingError
    assert str(error) == "ImageSizeError: too wide"


ERRORS = [
    MmprocError("something"),
    ConfigurationError("workers must be positive"),
    PluginError("it broke", plugin="tiny"),
    PluginLoadError("tiny", distribution="mmproc-tiny", version="1.0", cause=ImportError("torch")),
    IncompatiblePluginError("targets API 9", plugin="tiny"),
    PluginSpecError("no such hook", plugin="tiny"),
    PluginConflictError("TinyArch", ["b", "a"]),
    UnknownArchitectureError("TinyArch", ["Other"], claimed_by_failed=["x"], not_loaded=["y"]),
    ProcessorLoadError("no tokenizer"),
    MediaItemError("image", 3, "too small"),
    PromptUpdateError("two placeholders, one image", modality="image", item_index=1),
    ChatRequestError("no such part", message_index=1, part_index=0, modality="image", item_index=2),
    ChatTemplateError("the template raised", message_index=0),
    FieldSpecError("no field for pixel_values"),
    ProcessingError("the processor failed"),
    WorkerProcessError("the worker died"),
    EncodeError("a set cannot go on the wire"),
    DecodeError("frame 2 is short"),
]


def test_the_pickling_examples_cover_every_error_class() -> None:
    assert {type(error).__name__ for error in ERRORS} == set(mmproc.errors.__all__)


@pytest.mark.parametrize("error", ERRORS, ids=lambda error: type(error).__name__)
def test_every_error_survives_pickling_with_its_message_and_attributes(error: MmprocError) -> None:
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is type(error)
    assert (str(copy), copy.args) == (str(error), error.args)
    assert {key: repr(value) for key, value in vars(copy).items()} == {
        key: repr(value) for key, value in vars(error).items()
    }


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
