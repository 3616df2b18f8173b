"""The worker pool: per-thread clones, fallback, async, shutdown, torch intra-op threads.

Every test that needs real concurrency makes it happen with barriers and events, never with
sleeps or timing assertions: a test that would deadlock fails on a generous timeout instead.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import threading
import types
import weakref

import _qwen_processor as qwen
import pytest
from mmproc.errors import ConfigurationError
from mmproc.executor import ProcessorPool, create_io_pool, intra_op_threads_for
from mmproc.worker_count import IO_WORKERS_ENV

TIMEOUT = 30  # seconds a barrier or event may wait before the test is declared hung


@pytest.fixture(scope="module")
def small_image():
    return qwen.make_image(64, 48)


@pytest.fixture
def processor():
    # Function-scoped: several tests customise it.
    return qwen.make_qwen2_vl_processor("pil")


def preprocess(image, *, processor):
    """What the request pipeline's task does: run the HF processor with dummy text."""
    return processor(text=qwen.dummy_text(1), images=[image], return_tensors="pt")


class Uncopyable:
    """A processor member that refuses deep copies, like one holding a lock or a handle."""

    def __deepcopy__(self, memo):
        raise TypeError("cannot deep-copy this member")


# --- clones and isolation -----------------------------------------------------------------------


def test_each_thread_calls_its_own_clone_under_real_concurrency(processor, small_image):
    seen: list[tuple[int, object]] = []
    lock = threading.Lock()
    pair = threading.Barrier(2, timeout=TIMEOUT)

    def task(image, *, processor):
        me = threading.current_thread().name
        # Mark this thread's clone, then wait until the other worker has marked its own: both
        # calls are in flight together, and each must still see only its own mark.
        processor.image_processor.owner = me
        pair.wait()
        out = preprocess(image, processor=processor)
        assert processor.image_processor.owner == me
        with lock:
            seen.append((threading.get_ident(), processor))
        return out["image_grid_thw"].tolist()

    with ProcessorPool(lambda: processor, 2) as pool:
        futures = [pool.submit(task, small_image) for _ in range(6)]
        grids = [f.result(timeout=TIMEOUT) for f in futures]

    assert grids == [[[1, 4, 4]]] * 6
    by_thread: dict[int, set[int]] = {}
    for ident, clone in seen:
        by_thread.setdefault(ident, set()).add(id(clone))
    assert len(by_thread) == 2, "two worker threads ran the calls"
    assert all(len(ids) == 1 for ids in by_thread.values()), "a thread always gets one clone"
    clones = {ident: clone for ident, clone in seen}
    first, second = clones.values()
    assert first is not second
    for clone in (first, second):
        assert clone is not processor
        # A complete copy: the tokenizer too (see the module docs of mmproc.executor).
        assert clone.tokenizer is not processor.tokenizer
        assert clone.image_processor is not processor.image_processor
    assert not hasattr(processor.image_processor, "owner"), "the original was never touched"


def _install_bound_filter(image_processor, calls: list) -> None:
    """Sarashina2-style kwarg filter bound with types.MethodType: deepcopy rebinds it."""
    unfiltered = type(image_processor)._preprocess

    def _preprocess(self, *args, **kwargs):
        calls.append(self)
        return unfiltered(self, *args, **kwargs)

    image_processor._preprocess = types.MethodType(_preprocess, image_processor)


def _install_closure_filter(image_processor, calls: list) -> None:
    """The same filter as a closure over the original: deepcopy keeps pointing at the original."""
    unfiltered = type(image_processor)._preprocess

    def _preprocess(*args, **kwargs):
        calls.append(image_processor)
        return unfiltered(image_processor, *args, **kwargs)

    image_processor._preprocess = _preprocess


@pytest.mark.parametrize("binding", ["method", "closure"])
def test_deepcopy_rebinds_a_bound_method_but_not_a_closure(processor, small_image, binding):
    calls: list = []
    install = _install_bound_filter if binding == "method" else _install_closure_filter
    install(processor.image_processor, calls)
    pair = threading.Barrier(2, timeout=TIMEOUT)

    def task(image, *, processor):
        pair.wait()  # both workers in flight together
        preprocess(image, processor=processor)
        return processor.image_processor

    with ProcessorPool(lambda: processor, 2) as pool:
        futures = [pool.submit(task, small_image) for _ in range(2)]
        clones = [f.result(timeout=TIMEOUT) for f in futures]

    assert len(calls) == 2 and clones[0] is not clones[1]
    if binding == "method":
        # Each worker's call ran on its own clone's image processor.
        assert {id(c) for c in calls} == {id(c) for c in clones}
        assert all(c is not processor.image_processor for c in calls)
    else:
        # The closure routed both workers' calls to the one original: shared, not isolated.
        assert all(c is processor.image_processor for c in calls)


def test_customisation_after_construction_reaches_every_clone(small_image):
    calls: list = []

    class Owner:
        """Builds its pool first and customises the processor afterwards, as a subclass would
        after ``super().__init__()``."""

        def __init__(self) -> None:
            self.processor = qwen.make_qwen2_vl_processor("pil")
            self.pool = ProcessorPool(lambda: self.processor, 2)
            _install_bound_filter(self.processor.image_processor, calls)
            self.processor.image_processor.customised = True

    owner = Owner()
    pair = threading.Barrier(2, timeout=TIMEOUT)

    def task(image, *, processor):
        pair.wait()
        preprocess(image, processor=processor)
        return processor.image_processor

    with owner.pool as pool:
        clones = [f.result(TIMEOUT) for f in [pool.submit(task, small_image) for _ in range(2)]]
    assert all(getattr(c, "customised", False) for c in clones)
    assert {id(c) for c in calls} == {id(c) for c in clones}


def test_warm_up_makes_every_clone_before_the_first_request(processor, small_image):
    resolved = []

    def resolve():
        resolved.append(1)
        return processor

    with ProcessorPool(resolve, 2) as pool:
        assert pool.clones_made == 1  # the probe
        pool.warm_up()
        assert pool.clones_made == 3 and len(resolved) == 3
        pair = threading.Barrier(2, timeout=TIMEOUT)

        def task(image, *, processor):
            pair.wait()
            return preprocess(image, processor=processor)

        for f in [pool.submit(task, small_image) for _ in range(4)]:
            f.result(TIMEOUT)
        assert pool.clones_made == 3, "requests made no clone"


def test_warm_up_at_construction_replaces_the_probe(processor):
    with ProcessorPool(lambda: processor, 2, warm_up=True) as pool:
        assert pool.clones_made == 2
    with ProcessorPool(lambda: processor, 2) as pool:
        future = pool.warm_up(wait=False)
        assert future.result(TIMEOUT) is None
        assert pool.clones_made == 3


def test_lazy_clones_are_made_only_for_threads_that_run(processor, small_image):
    with ProcessorPool(lambda: processor, 2) as pool:
        assert pool.clones_made == 1  # the probe
        pool.run(preprocess, small_image)
        assert pool.clones_made == 2, "one task ran: one worker thread made its clone"


def test_a_fast_tokenizer_keeps_call_settings_on_itself(processor):
    """Why clones do not share the tokenizer: a call's truncation stays on the Rust object,
    where a concurrent caller of a shared tokenizer would pick it up."""
    tokenizer = processor.tokenizer
    assert tokenizer.backend_tokenizer.truncation is None
    tokenizer("hello world the image", truncation=True, max_length=2)
    assert tokenizer.backend_tokenizer.truncation is not None


# --- fallback -----------------------------------------------------------------------------------


def test_an_uncopyable_processor_falls_back_to_synchronous_processing(
    processor, small_image, caplog
):
    processor.image_processor.handle = Uncopyable()
    with caplog.at_level(logging.WARNING, logger="mmproc.executor"):
        pool = ProcessorPool(lambda: processor, 2, model="Qwen2-VL-test")
    with pool:
        assert pool.synchronous
        [record] = [r for r in caplog.records if r.name == "mmproc.executor"]
        assert "Qwen2-VL-test" in record.getMessage()
        assert "cannot deep-copy this member" in record.getMessage()

        def task(image, *, processor):
            preprocess(image, processor=processor)
            return processor, threading.get_ident()

        used, ident = pool.run(task, small_image)
        assert used is processor and ident == threading.get_ident(), "inline, on the original"
        used, ident = pool.submit(task, small_image).result()
        assert used is processor and ident == threading.get_ident()
        used, ident = asyncio.run(pool.run_async(task, small_image))
        assert used is processor
        pool.warm_up()  # nothing to warm: a no-op
        assert pool.clones_made == 0


def test_a_clone_that_fails_later_falls_back_too(processor, small_image, caplog):
    pool = ProcessorPool(lambda: processor, 2)
    # Customised after construction in a way that breaks copying: the probe could not see it.
    processor.image_processor.handle = Uncopyable()
    with pool, caplog.at_level(logging.WARNING, logger="mmproc.executor"):
        out = pool.run(lambda *, processor: processor)
        assert out is processor
        assert pool.synchronous
        assert "falls back to synchronous" in caplog.text
        assert pool.run(preprocess, small_image)["image_grid_thw"].tolist() == [[1, 4, 4]]


# --- errors, async, shutdown --------------------------------------------------------------------


def test_an_exception_reaches_its_own_caller_only(processor, small_image):
    both = threading.Barrier(2, timeout=TIMEOUT)

    def bad(*, processor):
        both.wait()
        raise ValueError("bad request")

    def good(image, *, processor):
        both.wait()
        return preprocess(image, processor=processor)

    with ProcessorPool(lambda: processor, 2) as pool:
        failing = pool.submit(bad)
        working = pool.submit(good, small_image)
        with pytest.raises(ValueError, match="bad request"):
            failing.result(TIMEOUT)
        assert working.result(TIMEOUT)["image_grid_thw"].tolist() == [[1, 4, 4]]
        # The pool still serves, sync and async.
        for _ in range(3):
            assert pool.run(preprocess, small_image)["pixel_values"].shape[0] == 16
        with pytest.raises(ZeroDivisionError):
            asyncio.run(pool.run_async(lambda *, processor: 1 / 0))
        assert asyncio.run(pool.run_async(preprocess, small_image))["pixel_values"].shape[0] == 16


@pytest.mark.parametrize("workers", [1, 2])
def test_the_event_loop_keeps_ticking_while_a_slow_preprocessing_runs(
    processor, small_image, workers
):
    ticked_enough = threading.Event()

    def slow(image, *, processor):
        out = preprocess(image, processor=processor)
        # Stands for a long preprocessing: it finishes only once the loop has ticked ten times,
        # which a blocked loop never does (the wait would then time out and the test fail).
        return ticked_enough.wait(TIMEOUT), out

    async def main() -> tuple[bool, int]:
        ticks = 0

        async def heartbeat() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.001)
                ticks += 1
                if ticks >= 10:
                    ticked_enough.set()

        beat = asyncio.create_task(heartbeat())
        finished, _ = await pool.run_async(slow, small_image)
        beat.cancel()
        return finished, ticks

    with ProcessorPool(lambda: processor, workers) as pool:
        finished, ticks = asyncio.run(main())
    assert finished and ticks >= 10


def test_concurrent_async_calls_use_both_workers(processor, small_image):
    pair = threading.Barrier(2, timeout=TIMEOUT)

    def task(image, *, processor):
        pair.wait()  # returns only if both calls run at once
        preprocess(image, processor=processor)
        return processor

    async def main():
        return await asyncio.gather(*(pool.run_async(task, small_image) for _ in range(2)))

    with ProcessorPool(lambda: processor, 2) as pool:
        first, second = asyncio.run(main())
    assert first is not second


def test_many_sync_callers_share_two_clones(processor, small_image):
    results: list = []
    lock = threading.Lock()

    with ProcessorPool(lambda: processor, 2) as pool:

        def caller() -> None:
            used = pool.run(
                lambda image, *, processor: (preprocess(image, processor=processor), processor)[1],
                small_image,
            )
            with lock:
                results.append(used)

        threads = [threading.Thread(target=caller) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(TIMEOUT)
    assert len(results) == 8
    assert 1 <= len({id(r) for r in results}) <= 2
    assert all(r is not processor for r in results)


def test_a_task_calling_back_into_its_pool_runs_inline(processor):
    def inner(*, processor):
        return processor

    def outer(*, processor):
        # With one worker, queueing this would deadlock: it runs on this thread, same clone.
        return processor, pool.run(inner), pool.submit(inner).result(TIMEOUT)

    with ProcessorPool(lambda: processor, 1) as pool:
        mine, again, submitted = pool.run(outer)
    assert mine is again is submitted
    assert mine is not processor


def test_shutdown_finishes_queued_work_then_refuses_more(processor):
    release = threading.Event()

    def blocked(*, processor):
        return release.wait(TIMEOUT)

    pool = ProcessorPool(lambda: processor, 1)
    futures = [pool.submit(blocked) for _ in range(3)]
    release.set()
    pool.shutdown()
    assert all(f.result(TIMEOUT) for f in futures)
    assert pool.closed
    with pytest.raises(RuntimeError, match="shut down"):
        pool.submit(blocked)
    with pytest.raises(RuntimeError, match="shut down"):
        pool.run(blocked)
    with pytest.raises(RuntimeError, match="shut down"):
        asyncio.run(pool.run_async(blocked))
    pool.shutdown()  # again: a no-op


def test_shutdown_can_cancel_pending_work(processor):
    started, release = threading.Event(), threading.Event()

    def blocked(*, processor):
        started.set()
        return release.wait(TIMEOUT)

    pool = ProcessorPool(lambda: processor, 1)
    running = pool.submit(blocked)
    started.wait(TIMEOUT)
    pending = pool.submit(blocked)
    # Cancelled while the only worker is still busy, so it cannot have started.
    pool.shutdown(wait=False, cancel_pending=True)
    release.set()
    assert running.result(TIMEOUT)
    assert pending.cancelled()


def test_an_abandoned_pool_is_collected(processor):
    pool = ProcessorPool(lambda: processor, 2)
    pool.run(lambda *, processor: None)
    ref = weakref.ref(pool)
    del pool
    gc.collect()
    assert ref() is None


def test_passing_a_processor_is_refused_at_the_call(processor):
    with ProcessorPool(lambda: processor, 2) as pool:
        for call in (pool.submit, pool.run):
            with pytest.raises(TypeError, match="processor"):
                call(lambda *, processor: None, processor=processor)
        with pytest.raises(TypeError, match="processor"):
            asyncio.run(pool.run_async(lambda *, processor: None, processor=processor))


@pytest.mark.parametrize("bad", [0, -1, True, 1.5])
def test_bad_worker_counts_are_configuration_errors(processor, bad):
    with pytest.raises(ConfigurationError):
        ProcessorPool(lambda: processor, bad)


@pytest.mark.parametrize("bad", [0, "all", 2.0])
def test_bad_intra_op_settings_are_configuration_errors(processor, bad):
    with pytest.raises(ConfigurationError):
        ProcessorPool(lambda: processor, 2, intra_op_threads=bad)


# --- torch intra-op threads ---------------------------------------------------------------------


def _threads_in_worker(pool: ProcessorPool) -> int:
    import torch

    return pool.run(lambda *, processor: torch.get_num_threads())


def test_workers_times_intra_op_threads_fit_the_cores(processor):
    torch = pytest.importorskip("torch")
    before = torch.get_num_threads()
    expected = min(intra_op_threads_for(2), before)
    with ProcessorPool(lambda: processor, 2) as pool:
        assert pool.intra_op_threads == expected
        assert _threads_in_worker(pool) == expected
    assert torch.get_num_threads() == before, "restored on shutdown"


def test_one_worker_leaves_torch_alone_unless_told(processor):
    torch = pytest.importorskip("torch")
    before = torch.get_num_threads()
    with ProcessorPool(lambda: processor, 1) as pool:
        assert pool.intra_op_threads is None
        assert torch.get_num_threads() == before
    with ProcessorPool(lambda: processor, 1, intra_op_threads=1) as pool:
        assert pool.intra_op_threads == 1
        assert _threads_in_worker(pool) == 1
    assert torch.get_num_threads() == before
    with ProcessorPool(lambda: processor, 2, intra_op_threads=None) as pool:
        assert pool.intra_op_threads is None
        assert torch.get_num_threads() == before


def test_overlapping_pools_restore_only_after_the_last(processor):
    torch = pytest.importorskip("torch")
    before = torch.get_num_threads()
    first = ProcessorPool(lambda: processor, 1, intra_op_threads=1)
    second = ProcessorPool(lambda: processor, 1, intra_op_threads=1)
    first.shutdown()
    assert torch.get_num_threads() == 1, "the second pool still needs it"
    second.shutdown()
    assert torch.get_num_threads() == before


def test_intra_op_threads_for():
    assert intra_op_threads_for(2, cores=2) == 1
    assert intra_op_threads_for(2, cores=16) == 8
    assert intra_op_threads_for(3, cores=16) == 5
    assert intra_op_threads_for(4, cores=2) == 1
    assert intra_op_threads_for(1, cores=8) == 8


# --- the IO pool --------------------------------------------------------------------------------


def _thread_count(pool, n: int) -> int:
    """How many threads ``pool`` runs ``n`` tasks on at once (each waits for all the others)."""
    gate = threading.Barrier(n, timeout=TIMEOUT)
    names = [
        pool.submit(lambda: (gate.wait(), threading.current_thread().name)[1]) for _ in range(n)
    ]
    return len({f.result(TIMEOUT) for f in names})


def test_io_pool_has_four_threads_by_default(monkeypatch):
    monkeypatch.delenv(IO_WORKERS_ENV, raising=False)
    pool = create_io_pool()
    try:
        assert _thread_count(pool, 4) == 4
        name = pool.submit(lambda: threading.current_thread().name).result(TIMEOUT)
        assert name.startswith("mmproc-io")
    finally:
        pool.shutdown()


def test_io_pool_count_from_option_env_and_hint(monkeypatch):
    monkeypatch.setenv(IO_WORKERS_ENV, "3")
    for pool, expected in ((create_io_pool(), 3), (create_io_pool(2), 2)):
        try:
            assert pool._max_workers == expected
        finally:
            pool.shutdown()
    monkeypatch.delenv(IO_WORKERS_ENV)
    pool = create_io_pool(hint=6)
    assert pool._max_workers == 6
    pool.shutdown()
    with pytest.raises(ConfigurationError):
        create_io_pool(0)
