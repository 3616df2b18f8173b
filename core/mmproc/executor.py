"""The worker pool: preprocessing on threads that each own a deep copy of the HF processor.

Worker count
    :func:`mmproc.worker_count.resolve_worker_count` and
    :func:`~mmproc.worker_count.preprocessing_path` decide how many workers a model gets: 2 on
    the CPU path, 1 when a fast image processor runs on the serving device, an explicit request
    over both, 1 for a model that opts out of concurrency.

Clones
    Each worker thread deep-copies the processor on its first task, one clone at a time under a
    lock, from a *resolver* callable rather than an object captured at construction: the pool is
    built while its owner is still customising the processor (a plugin's ``load_hf_processor``
    may patch it afterwards), and a clone taken then would miss those changes. Every call gets
    its thread's clone as ``processor=``; no two threads ever share one, so HF processors, which
    keep per-call state on themselves, need not be thread-safe. Deep copy rebinds a
    ``types.MethodType`` method to the clone (``__self__`` is copied through the memo) but leaves
    a closure pointing at the original, so customisations must be bound methods.

Clone scope (what the clone shares)
    Everything is deep-copied, the tokenizer included, though the tokenizer is nearly all of a
    clone's cost (``benchmarks/workers.py`` prints it): a fast tokenizer is not read-only.
    ``set_truncation_and_padding`` stores truncation and padding on the Rust tokenizer and leaves
    them there, so with one tokenizer shared by two threads, a call with ``truncation=True`` can
    silently truncate another thread's call made with the defaults (or, with tokenizers versions
    that hold the Rust borrow across the encode, fail it with "Already borrowed"). A worker
    cannot know that no request's ``hf_kwargs`` ever passes truncation or padding, so isolation
    wins, and the cost is moved off the requests instead: :meth:`ProcessorPool.warm_up` makes
    every worker's clone ahead of the first request.

Probe and fallback
    One probe clone at construction (discarded: the processor may still change). A processor
    that cannot be deep-copied makes the pool synchronous, with a warning: every call then runs
    on the caller's thread, one at a time under a lock, with the original processor. A clone that
    fails later (a customisation made after construction broke copying) switches to the same
    fallback.

One worker, sync and async callers
    Calls always run on the pool's threads, also with one worker, and :meth:`run` waits for the
    result: the thread hop is microseconds against milliseconds of preprocessing, it keeps one
    code path and one clone per worker, and it lets :meth:`run_async` keep the event loop free
    whatever the count. Only the synchronous fallback runs inline, and there :meth:`run_async`
    blocks the loop for the duration of the call, as a one-worker engine without a pool would.

Intra-op threads
    torch's own intra-op thread pool competes with the workers for the cores. With more than one
    worker the pool lowers torch's intra-op threads to ``cores // workers`` (at least 1; never
    raising what was set) in every worker thread, and restores the previous value when the last
    pool using it shuts down; ``intra_op_threads=`` overrides (an int) or disables (``None``)
    this. The setting is process-wide in torch, so while a pool runs, other torch work in the
    process sees it too. It keeps ``workers x threads`` within the cores, which matters where
    torch's default is one thread per core in every worker (``benchmarks/workers.py`` compares).

Errors
    An exception raised by a task goes to that task's caller only; the pool keeps serving.

Media loading uses its own small IO pool, :func:`create_io_pool` (4 threads by default).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import itertools
import logging
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, Literal, TypeVar

from mmproc.errors import ConfigurationError
from mmproc.worker_count import (
    IO_WORKERS_ENV,
    requested_worker_count,
    resolve_io_worker_count,
)

__all__ = ["ProcessorPool", "create_io_pool", "intra_op_threads_for"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

# How long a warm-up task waits for the other workers to pick up theirs. Only a safety net: the
# barrier is what puts one warm-up task on each thread, and a thread still busy with a long task
# delays it; past this the remaining clones are simply made on first use.
_WARM_UP_BARRIER_TIMEOUT_S = 120.0


def _available_cores() -> int:
    """Cores this process may run on (affinity and cpusets respected where the OS tells)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not on Linux
        return max(1, os.cpu_count() or 1)


def intra_op_threads_for(workers: int, cores: int | None = None) -> int:
    """torch intra-op threads per worker so that ``workers x threads`` fits in ``cores``.

    ``cores`` defaults to the cores this process may run on; the result is at least 1.
    """
    cores = _available_cores() if cores is None else cores
    return max(1, cores // max(1, workers))


def _torch_or_none() -> Any | None:
    """torch, imported on first need only; ``None`` where it is not installed."""
    torch = sys.modules.get("torch")
    if torch is not None:
        return torch
    try:
        import torch
    except ImportError:
        return None
    return torch


class _IntraOpThreads:
    """torch's intra-op thread count, shared by every live pool in the process.

    torch keeps one process-wide setting, so pools claim a value and the smallest claim applies;
    the value found before the first claim comes back when the last claim is released, unless
    someone else changed the setting in between (theirs is then left alone).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._claims: dict[int, int] = {}
        self._tokens = itertools.count()
        self._original: int | None = None
        self._applied: int | None = None

    def claim(self, threads: int | Literal["auto"], workers: int) -> int | None:
        """Register a pool's wish; returns a token for :meth:`release`, None without torch."""
        torch = _torch_or_none()
        if torch is None:
            return None
        with self._lock:
            if not self._claims:
                self._original = torch.get_num_threads()
            # "auto" lowers only: a process that already runs fewer threads chose that.
            count = (
                min(intra_op_threads_for(workers), self._original or 1)
                if threads == "auto"
                else threads
            )
            token = next(self._tokens)
            self._claims[token] = count
            self._apply(torch)
            return token

    def current(self) -> int | None:
        """The value in force for the pools' workers, or None when no pool claims one."""
        with self._lock:
            return self._applied

    def release(self, token: int | None) -> None:
        """Drop a claim; the last one restores the original setting."""
        if token is None:
            return
        torch = _torch_or_none()
        with self._lock:
            if self._claims.pop(token, None) is None or torch is None:
                return
            if self._claims:
                self._apply(torch)
                return
            if torch.get_num_threads() == self._applied and self._original is not None:
                torch.set_num_threads(self._original)
            self._original = self._applied = None

    def _apply(self, torch: Any) -> None:
        target = min(self._claims.values())
        if torch.get_num_threads() != target:
            torch.set_num_threads(target)
        self._applied = target


_INTRA_OP = _IntraOpThreads()


def _done_future(result: Any = None) -> concurrent.futures.Future[Any]:
    future: concurrent.futures.Future[Any] = concurrent.futures.Future()
    future.set_result(result)
    return future


def _init_worker_thread(set_threads: bool) -> None:
    """Initializer of every worker thread: apply the pools' torch intra-op setting to it.

    torch's setting is partly thread-local (OpenMP and BLAS thread counts of a thread that did not
    set them itself stay at the old value: a matmul on a new thread still runs on every core
    after ``torch.set_num_threads(1)`` on the main thread), so each worker sets it itself.
    An initializer that raises breaks the whole executor, so this never raises.
    """
    threads = _INTRA_OP.current() if set_threads else None
    if threads is None:
        return
    try:
        torch = _torch_or_none()
        if torch is not None:
            torch.set_num_threads(threads)
    except Exception:
        logger.exception("could not set torch intra-op threads in a preprocessing worker")


def _release_resources(
    executor: concurrent.futures.ThreadPoolExecutor | None, token: int | None
) -> None:
    """Finaliser of a pool nobody shut down: stop its threads, give back the torch setting."""
    if executor is not None:
        executor.shutdown(wait=False)
    _INTRA_OP.release(token)


class ProcessorPool:
    """A thread pool whose threads each call into their own deep copy of the HF processor.

    Args:
        resolve_processor: returns the processor to clone, called at every clone (never stored),
            so that changes made to the processor after the pool was built reach every clone.
        workers: number of worker threads (>= 1); see :func:`resolve_worker_count`.
        intra_op_threads: torch intra-op threads for the workers while the pool runs: ``"auto"``
            (``cores // workers`` with more than one worker, else untouched), an int, or ``None``
            to leave torch alone.
        warm_up: make every worker's clone now, in place of the probe clone: ``True`` waits
            for them, ``"background"`` returns at once (a clone failure still switches to the
            synchronous fallback). Only when the processor is final; otherwise call
            :meth:`warm_up` once it is.
        name: prefix of the worker threads' names.
        model: the model's name, used in log messages.

    A task is ``fn(*args, processor=<this thread's clone>, **kwargs)``; its exception reaches its
    own caller only. Use as a context manager, or call :meth:`shutdown`.
    """

    def __init__(
        self,
        resolve_processor: Callable[[], Any],
        workers: int,
        *,
        intra_op_threads: int | Literal["auto"] | None = "auto",
        warm_up: bool | Literal["background"] = False,
        name: str = "mmproc-preprocess",
        model: str | None = None,
    ) -> None:
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ConfigurationError(f"workers must be an integer >= 1, got {workers!r}")
        if intra_op_threads not in (None, "auto") and (
            isinstance(intra_op_threads, bool)
            or not isinstance(intra_op_threads, int)
            or intra_op_threads < 1
        ):
            raise ConfigurationError(
                f"intra_op_threads must be 'auto', None or an integer >= 1, "
                f"got {intra_op_threads!r}"
            )
        self._resolve_processor = resolve_processor
        self._workers = workers
        self._name = name
        self._model = model or "the model"
        # Clones read the shared original; one at a time keeps them from racing each other on
        # it and bounds the memory spike of a big clone to one at once.
        self._clone_lock = threading.Lock()
        # Serialises calls on the original processor once the pool has fallen back.
        self._fallback_lock = threading.RLock()
        self._state_lock = threading.Lock()
        self._local = threading.local()
        self._fallback_reason: str | None = None
        self._closed = False
        self._clones_made = 0
        self._threads_token: int | None = None
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None

        if not warm_up:
            try:
                self._clone()
            except Exception as exc:  # any failure to copy means: do not copy
                self._fall_back(exc, when="at start-up")
                self._finalizer = weakref.finalize(self, _release_resources, None, None)
                return

        if intra_op_threads is not None and (intra_op_threads != "auto" or workers > 1):
            self._threads_token = _INTRA_OP.claim(intra_op_threads, workers)
        # The initializer is a plain function, not a bound method: the executor's threads keep
        # it, and a reference back to the pool would keep an abandoned pool alive forever.
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=workers,
            thread_name_prefix=name,
            initializer=_init_worker_thread,
            initargs=(self._threads_token is not None,),
        )
        self._finalizer = weakref.finalize(
            self, _release_resources, self._executor, self._threads_token
        )
        if warm_up:
            self.warm_up(wait=warm_up is True)

    # --- public API -------------------------------------------------------------------------

    @property
    def original_lock(self) -> threading.RLock:
        """The lock the synchronous fallback's calls on the original processor hold: whoever
        else uses the original (or its tokenizer) holds it too."""
        return self._fallback_lock

    @property
    def workers(self) -> int:
        """Worker threads the pool was built with (the fallback runs inline regardless)."""
        return self._workers

    @property
    def synchronous(self) -> bool:
        """Whether the pool fell back to synchronous processing on the original processor."""
        return self._fallback_reason is not None

    @property
    def closed(self) -> bool:
        """Whether :meth:`shutdown` was called."""
        return self._closed

    @property
    def clones_made(self) -> int:
        """Processor clones made so far, the probe included."""
        return self._clones_made

    @property
    def intra_op_threads(self) -> int | None:
        """torch intra-op threads in force for the workers, or None when the pool sets none."""
        return None if self._threads_token is None else _INTRA_OP.current()

    def submit(
        self, fn: Callable[..., T], /, *args: Any, **kwargs: Any
    ) -> concurrent.futures.Future[T]:
        """Schedule ``fn(*args, processor=<clone>, **kwargs)``; returns its future.

        Synchronous fallback, or a call from inside a task: runs now on the calling thread and
        returns a finished future.

        Raises:
            RuntimeError: the pool was shut down.
            TypeError: ``processor`` was passed (the pool supplies it).
        """
        self._check_call(kwargs)
        if self._runs_inline():
            future: concurrent.futures.Future[T] = concurrent.futures.Future()
            try:
                future.set_result(self._call_inline(fn, args, kwargs))
            except Exception as exc:
                future.set_exception(exc)
            return future
        assert self._executor is not None  # not inline means an executor exists
        try:
            return self._executor.submit(self._call_in_worker, fn, args, kwargs)
        except RuntimeError:
            # A shutdown raced with this submit: ours (say it the pool's way) or the fallback's
            # (then the call runs inline like every call after it).
            self._check_call(kwargs)
            if self._fallback_reason is not None:
                return self.submit(fn, *args, **kwargs)
            raise

    def run(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        """Call ``fn(*args, processor=<clone>, **kwargs)`` on a worker and wait for its result.

        Raises:
            RuntimeError: the pool was shut down.
            TypeError: ``processor`` was passed (the pool supplies it).
            Exception: whatever ``fn`` raised.
        """
        self._check_call(kwargs)
        if self._runs_inline():
            return self._call_inline(fn, args, kwargs)
        return self.submit(fn, *args, **kwargs).result()

    async def run_async(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        """Await ``fn(*args, processor=<clone>, **kwargs)`` run on a worker thread.

        The event loop stays free while the call runs, whatever the worker count; only the
        synchronous fallback runs the call inline and blocks the loop for its duration.
        Cancelling the awaiting task cancels a call that has not started yet.
        """
        self._check_call(kwargs)
        if self._runs_inline():
            return self._call_inline(fn, args, kwargs)
        return await asyncio.wrap_future(self.submit(fn, *args, **kwargs))

    def warm_up(self, *, wait: bool = True) -> concurrent.futures.Future[None]:
        """Make every worker thread's clone now, so that no request pays for one.

        Call it once the processor is final (customisations done). One task per worker, held at
        a barrier until all are running, so each lands on its own thread; requests submitted
        meanwhile queue behind them. With ``wait=False`` returns at once; the future completes
        when the clones exist. A clone that fails switches the pool to the synchronous fallback.
        """
        self._check_call({})
        if self._runs_inline():
            return _done_future()
        assert self._executor is not None
        barrier = threading.Barrier(self._workers)
        tasks = [self._executor.submit(self._warm_up_thread, barrier) for _ in range(self._workers)]
        done: concurrent.futures.Future[None] = concurrent.futures.Future()
        pending = [len(tasks)]
        pending_lock = threading.Lock()

        def _one_done(task: concurrent.futures.Future[None]) -> None:
            with pending_lock:
                pending[0] -= 1
                last = pending[0] == 0
            if not last:
                return
            errors = [t.exception() for t in tasks if not t.cancelled() and t.exception()]
            if errors:
                done.set_exception(errors[0])
            else:
                done.set_result(None)

        for task in tasks:
            task.add_done_callback(_one_done)
        if wait:
            done.result()
        return done

    def shutdown(self, *, wait: bool = True, cancel_pending: bool = False) -> None:
        """Stop the pool: no new tasks; finish (or, with ``cancel_pending``, cancel) queued ones.

        With ``wait`` the call returns once the worker threads have exited. Restores torch's
        intra-op threads when this was the last pool setting them. Calling it again is a no-op.
        """
        with self._state_lock:
            if self._closed:
                return
            self._closed = True
        if self._executor is not None:
            self._executor.shutdown(wait=wait, cancel_futures=cancel_pending)
        _INTRA_OP.release(self._threads_token)
        self._finalizer.detach()

    def __enter__(self) -> ProcessorPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "synchronous" if self.synchronous else "running"
        return f"<ProcessorPool {self._name!r} workers={self._workers} {state}>"

    # --- internals --------------------------------------------------------------------------

    def _check_call(self, kwargs: dict[str, Any]) -> None:
        if self._closed:
            raise RuntimeError(f"{self!r} is shut down")
        if "processor" in kwargs:
            # Said here, at the call, rather than as a TypeError from inside a worker.
            raise TypeError("the pool passes processor= itself; do not pass one")

    def _runs_inline(self) -> bool:
        # A task that calls back into its own pool runs on its thread: queueing it would
        # deadlock once every worker waits on such a call.
        return self._fallback_reason is not None or getattr(self._local, "in_worker", False)

    def _clone(self) -> Any:
        """One deep copy of the resolved processor."""
        with self._clone_lock:
            start = time.perf_counter()
            clone = copy.deepcopy(self._resolve_processor())
            self._clones_made += 1
        logger.debug(
            "cloned the processor of %s for %s in %.1f ms",
            self._model,
            threading.current_thread().name,
            (time.perf_counter() - start) * 1e3,
        )
        return clone

    def _fall_back(self, exc: BaseException, *, when: str) -> None:
        with self._state_lock:
            if self._fallback_reason is not None:
                return
            self._fallback_reason = f"{type(exc).__name__}: {exc}"
        logger.warning(
            "the processor of %s cannot be deep-copied (%s) %s: preprocessing falls back to "
            "synchronous processing on the original processor, one request at a time",
            self._model,
            self._fallback_reason,
            when,
        )
        if self._executor is not None:
            # Queued tasks still run (on the original, under the fallback lock); the idle
            # threads go away.
            self._executor.shutdown(wait=False)

    def _worker_clone(self) -> Any | None:
        """This thread's clone, made on first use; None once the pool has fallen back."""
        clone = getattr(self._local, "processor", None)
        if clone is None and self._fallback_reason is None:
            try:
                clone = self._clone()
            except Exception as exc:
                self._fall_back(exc, when=f"in worker {threading.current_thread().name}")
                return None
            self._local.processor = clone
        return clone if self._fallback_reason is None else None

    def _call_in_worker(
        self, fn: Callable[..., T], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> T:
        clone = self._worker_clone()
        if clone is None:
            return self._call_on_original(fn, args, kwargs)
        self._local.in_worker = True
        try:
            return fn(*args, processor=clone, **kwargs)
        finally:
            self._local.in_worker = False

    def _call_inline(
        self, fn: Callable[..., T], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> T:
        if getattr(self._local, "in_worker", False):
            return fn(*args, processor=self._local.processor, **kwargs)
        return self._call_on_original(fn, args, kwargs)

    def _call_on_original(
        self, fn: Callable[..., T], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> T:
        with self._fallback_lock:
            return fn(*args, processor=self._resolve_processor(), **kwargs)

    def _warm_up_thread(self, barrier: threading.Barrier) -> None:
        self._worker_clone()
        try:
            barrier.wait(timeout=_WARM_UP_BARRIER_TIMEOUT_S)
        except threading.BrokenBarrierError:
            logger.info("warm-up of %s timed out waiting for a busy worker", self._model)


def create_io_pool(
    workers: int | None = None, *, hint: int | None = None, name: str = "mmproc-io"
) -> concurrent.futures.ThreadPoolExecutor:
    """A plain thread pool for media loading (decoding, file and URL reads): 4 threads by default.

    ``workers`` (the ``io_workers=`` option) wins over ``MMPROC_IO_WORKERS``, then the model's
    ``hint``, then 4. Loading needs no processor clone, so this is an ordinary executor; the
    caller shuts it down.

    Raises:
        ConfigurationError: the count is not an integer >= 1.
    """
    count = resolve_io_worker_count(
        requested=requested_worker_count(workers, env=IO_WORKERS_ENV), hint=hint
    )
    return concurrent.futures.ThreadPoolExecutor(max_workers=count, thread_name_prefix=name)
