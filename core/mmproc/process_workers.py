"""Process workers: the HF processor calls in worker processes, past the GIL.

With ``worker_kind="process"``, the serving process keeps as many worker processes as its worker
pool has threads, the idle ones in one queue: each HF call a worker thread makes is lent the next
idle process for the length of the call. The process runs the plugin's ``process_mm_data`` and
``get_mm_fields`` on a processor it loaded itself (the same plugin, folder and options).
Everything else stays in the serving process: the cache (one for all workers), single flight,
prompt updates, tokenising, so the outputs are those of the thread pool, bit for bit.

A call's items go to the worker, and its per-item outputs come back, through shared memory
(:mod:`mmproc.shared_blocks`): two blocks each worker keeps from call to call, the serving
process's to make, grow and unlink, and blocks of a call's own for what does not fit them. Both
sides read without a copy where they can: the worker's images are made over the items block
(a plugin that keeps one past its call gets a new block for the next), and the outputs are read
out of a block lent to them until they are gone (:mod:`mmproc.lent_blocks`).

Workers are spawned (a fresh interpreter: no state forked from the server), side by side, each
loading its processor once; by default in the background at start-up, so that construction does
not wait (the first calls wait for their worker). A worker that cannot start, or does not within
``startup_timeout_s``, is stopped: the call that would have had it fails with a
:class:`~mmproc.errors.WorkerProcessError` saying why, and another is started. A worker that dies
(killed, a segfault, out of memory) fails only the call it was running, with a
``WorkerProcessError`` naming it and how it ended, and is replaced; one found dead while idle is
replaced before it is lent; a call that runs past ``worker_timeout_s`` has its worker stopped and
replaced the same way.

A worker process costs its own interpreter with torch and transformers imported and the
processor loaded (``benchmarks/workers.py`` prints start-up seconds and resident memory per
worker).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import multiprocessing
import pickle
import queue
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler
from multiprocessing.shared_memory import SharedMemory
from typing import Any

from mmproc.errors import MmprocError, ProcessingError, WorkerProcessError
from mmproc.executor import intra_op_threads_for
from mmproc.lent_blocks import LENDABLE_BLOCKS, LendableBlocks
from mmproc.media.pillow_pixels import still_borrowed
from mmproc.shared_blocks import (
    AttachedBlocks,
    KeptBlock,
    Where,
    call_block_names,
    drop_block,
    read_items,
    read_outputs,
    release_block,
    write_items,
    write_outputs,
)

__all__ = ["WorkerProcesses", "WorkerSpec"]

logger = logging.getLogger(__name__)

_STOP_GRACE_S = 5.0  # how long a worker told to stop, or killed, is waited for at each step


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker process builds its processor from: the model folder; ``build``, the
    function that builds it (``mmproc.factory.get_processor``, given by the factory, so that
    this module need not import the factory that imports it); the plugin options and the core's
    options that shape the HF processor."""

    model: str
    build: Callable[..., Any]
    options: Mapping[str, Any] = field(default_factory=dict)


# --- the worker's side ---------------------------------------------------------------------------


def _worker_main(conn: Connection, spec: WorkerSpec, torch_threads: int) -> None:
    """A worker process: build the processor, then answer calls until told to stop.
    ``torch_threads``: torch's intra-op threads, so that the workers together fit the cores as
    the thread pool's do."""
    from mmproc.malloc_settings import keep_freed_memory

    # The process is mmproc's own: each call's megabyte buffers are kept for the next, not
    # faulted in again (a host process's allocator is not the library's to change).
    keep_freed_memory()

    with contextlib.suppress(ImportError):
        import torch

        torch.set_num_threads(torch_threads)
    try:
        processor = spec.build(
            spec.model, workers=1, warm_up=False, cache_bytes=0, **dict(spec.options)
        )
    except BaseException as exc:  # the parent says why the worker could not start
        conn.send(("failed", f"{type(exc).__name__}: {exc}"))
        return
    named = f"{processor.ctx.architecture} (plugin {processor.ctx.plugin!r})"
    attached = AttachedBlocks(outputs=1 + LENDABLE_BLOCKS)
    conn.send(("ready", None))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return  # the serving process went away
        if message is None:
            processor.close()
            return
        mode, text, items_at, described, kwargs, outbox, call_outputs, forget = message
        attached.forget(forget)
        borrowed: list[int] = []  # the images made over the items block's memory
        call = (mode, text, items_at, described, kwargs, outbox, call_outputs)
        answer = _answer_call(processor, attached, call, named, borrowed)
        # The call's items are gone with _answer_call's frame, unless the plugin kept them.
        if not _send_answer(conn, (*answer, _items_kept(borrowed)), call_outputs, named):
            return


def _answer_call(
    processor: Any, attached: AttachedBlocks, call: tuple[Any, ...], named: str, borrowed: list[int]
) -> tuple[str, Any]:
    """Run one call: ``("ok", (where the outputs lie, their layout, the prompt's ids))``, or
    ``("error", the exception pickled)``. ``borrowed``: see :func:`read_items`."""
    from mmproc.fields import prompt_ids_row, split_outputs
    from mmproc.output_memory import outputs_in

    model, ctx, hf = processor.model, processor.ctx, processor.hf_processor
    mode, text, items_at, described, kwargs, outbox, call_outputs = call
    try:
        items = read_items(attached, items_at, described, borrowed)
        counts = {modality: len(values) for modality, values in items.items()}
        # Outputs the plugin makes with output_tensor go straight into the outputs block.
        box = None if outbox is None else attached("out", outbox[0]).buf
        with outputs_in(box) as arena:
            outputs = model.process_mm_data(ctx, mode, text, items, hf, kwargs)
            per_item = split_outputs(outputs, model.get_mm_fields(ctx, outputs), counts)
            ids = outputs.get("input_ids") if "input_ids" in outputs else None
            at, layout = write_outputs(
                per_item, call_outputs, attached=attached, outbox=outbox, arena=arena
            )
            # Views of the block held past the call would keep a block the serving process
            # drops from being unmapped here.
            del outputs, per_item, items
        del arena, box
        return "ok", (at, layout, None if ids is None else prompt_ids_row(ids))
    except BaseException as exc:
        release_block(call_outputs)  # write_outputs may have made it before the failure
        if isinstance(exc, WorkerProcessError):  # no shared memory: say whose request
            exc = WorkerProcessError(f"{named}: this request's outputs: {exc}")
        return "error", _portable(exc)


def _items_kept(borrowed: list[int]) -> bool:
    """Whether an image of the call's items is still alive after the call (the plugin kept it):
    the serving process must then give the worker a new items block, not write this one."""
    if not any(map(still_borrowed, borrowed)):
        return False
    gc.collect()  # a traceback's frames may hold them in a cycle
    return any(map(still_borrowed, borrowed))


def _send_answer(
    conn: Connection, answer: tuple[str, Any, bool], outputs_name: str, named: str
) -> bool:
    """Send a call's answer (its status, what it gave, whether it kept its items); False when
    the serving process is gone. Outputs that cannot be sent (a value that does not pickle) have
    their block released and are answered with the error."""
    try:
        conn.send(answer)
        return True
    except OSError:  # the pipe is closed: nobody will read the block
        release_block(outputs_name)
        return False
    except Exception as exc:  # pickling fails before anything is written: the pipe is intact
        release_block(outputs_name)
        error = ProcessingError(
            f"{named}: the outputs cannot be sent back from the worker process: "
            f"{type(exc).__name__}: {exc}"
        )
        conn.send(("error", pickle.dumps(error), answer[2]))
        return True


# --- errors from the worker ----------------------------------------------------------------------


def _portable(exc: BaseException) -> bytes:
    """``exc`` pickled as the parent can raise it: itself when it pickles and unpickles, else a
    ProcessingError saying what it was."""
    try:
        data = pickle.dumps(exc)
        pickle.loads(data)
        return data
    except Exception:
        return pickle.dumps(ProcessingError(f"{type(exc).__name__}: {exc}"))


# --- the serving process's side -------------------------------------------------------------------


class _Worker:
    """One worker process and the pipe to it.

    Raises:
        WorkerProcessError: the process could not start, or did not within ``startup_timeout_s``
            (it is stopped).
    """

    def __init__(
        self,
        spec: WorkerSpec,
        index: int,
        *,
        startup_timeout_s: float,
        torch_threads: int,
        abandoned: threading.Event,
    ) -> None:
        context = multiprocessing.get_context("spawn")
        self.conn, child = context.Pipe()
        self.process = context.Process(
            target=_worker_main,
            args=(child, spec, torch_threads),
            name=f"mmproc-worker-{index}",
            daemon=True,
        )
        self.inbox = KeptBlock(index, "in")
        self.outbox = KeptBlock(index, "out")  # the outputs copied out, when none can be lent
        self.lendable = LendableBlocks(index)
        self.outputs_bytes = 0  # the last call's: the size of the next block lent
        self.forget: list[str] = []  # outputs blocks dropped that the worker still maps
        if abandoned.is_set():
            raise WorkerProcessError(f"worker process {self.process.name} was not started: closed")
        started = time.perf_counter()
        self.process.start()
        child.close()
        status, detail = self._first_answer(startup_timeout_s, abandoned)
        if status != "ready":
            self.stop(kill=status == "late")
            raise WorkerProcessError(f"worker process {self.process.name} {detail}")
        self.startup_s = time.perf_counter() - started

    def _first_answer(self, timeout_s: float, abandoned: threading.Event) -> tuple[str, str | None]:
        """``("ready", None)``, or why not: ``("failed", …)``, ``("late", …)`` (too slow, or no
        longer wanted: the workers were closed while it started)."""
        deadline = time.monotonic() + timeout_s
        while not self.conn.poll(0.1):
            if not self.process.is_alive():
                break
            if abandoned.is_set():
                return "late", "was stopped while it started: the workers were closed"
            if time.monotonic() > deadline:
                return "late", f"did not start within {timeout_s:g} s; it was stopped"
        try:
            status, detail = self.conn.recv()
        except (EOFError, OSError):
            self.process.join(_STOP_GRACE_S)
            return "failed", f"could not start: it exited (exit code {self.process.exitcode})"
        return status, None if status == "ready" else f"could not start: {detail}"

    def stop(self, *, kill: bool = False) -> None:
        with contextlib.suppress(OSError, EOFError, BrokenPipeError):
            if not kill:
                self.conn.send(None)
        if kill or not _joined(self.process, _STOP_GRACE_S):
            self.process.kill()
            _joined(self.process, _STOP_GRACE_S)
        self.conn.close()
        self.inbox.drop()
        self.outbox.drop()
        self.lendable.close()


def _joined(process: Any, timeout: float) -> bool:
    process.join(timeout)
    return not process.is_alive()


@dataclass
class _Lease:
    """A worker lent to one call. ``busy``: the call was sent and is not answered yet, so the
    worker's state is unknown should the call end there (it is then stopped, not lent again)."""

    worker: _Worker
    busy: bool = False


def _pipe_closed(worker: _Worker) -> bool:
    """Whether an idle worker's pipe says it is gone. An idle worker writes nothing, so anything
    to read is the end of its pipe: its death seen even where ``is_alive`` cannot see it (a
    process reaped by another ``waitpid`` reads as alive to multiprocessing)."""
    try:
        return bool(worker.conn.poll(0))
    except (OSError, ValueError):
        return True


class WorkerProcesses:
    """``count`` worker processes lent one per call: as many as the worker pool has threads, so
    a call never waits for one.

    Args:
        spec: What each worker builds its processor from.
        count: Workers (the pool's worker count).
        timeout_s: The longest one call may run before its worker is killed (None: no limit).
        model: How to name the model in errors.
        background: Start the workers in the background (the first calls wait for them).
        startup_timeout_s: The longest a worker may take to start and load its processor.
    """

    def __init__(
        self,
        spec: WorkerSpec,
        count: int,
        *,
        timeout_s: float | None,
        model: str,
        background: bool = True,
        startup_timeout_s: float = 300.0,
    ) -> None:
        self._spec = spec
        self._timeout = timeout_s
        self._startup_timeout = startup_timeout_s
        self._torch_threads = intra_op_threads_for(count)
        self._model = model
        # Every worker not idle is starting (it, or why it failed, is queued within the start-up
        # timeout) or on a call (back, or stopped and restarted, within the call timeout).
        self._wait_s = (
            None if timeout_s is None else timeout_s + 2 * _STOP_GRACE_S + startup_timeout_s
        )
        self._idle: queue.Queue[_Worker | BaseException] = queue.Queue()
        self._all: list[_Worker] = []
        self._lock = threading.Lock()
        self._closed = False
        self._warned_kept_items = False
        self._started = 0
        self._in_flight = 0
        # Set by close: a worker still starting is stopped, and close waits for that, so that
        # no interpreter is left half started (it would report its lost parent on stderr).
        self._closing = threading.Event()
        self._starters: list[threading.Thread] = []
        self._starting(self._start, count)
        if not background:
            self._starters[0].join()

    def _starting(self, target: Callable[..., None], *args: Any) -> None:
        starter = threading.Thread(target=target, args=args, daemon=True)
        with self._lock:
            if self._closing.is_set():  # close() has taken its list of starters
                return
            self._starters = [t for t in self._starters if t.is_alive()] + [starter]
            starter.start()

    def _start(self, count: int) -> None:
        starters = [threading.Thread(target=self._spawn, daemon=True) for _ in range(count)]
        for starter in starters:  # the interpreters start side by side
            starter.start()
        for starter in starters:
            starter.join()

    def _spawn(self) -> None:
        with self._lock:
            index = self._started
            self._started += 1
        try:
            worker = _Worker(
                self._spec,
                index,
                startup_timeout_s=self._startup_timeout,
                torch_threads=self._torch_threads,
                abandoned=self._closing,
            )
        except BaseException as exc:
            self._idle.put(exc)  # the call that takes it says why
            return
        with self._lock:
            if self._closed:
                worker.stop()
                return
            self._all.append(worker)
        self._idle.put(worker)

    def _respawn(self) -> None:
        if not self._closed:
            self._starting(self._spawn)

    def _retire(self, worker: _Worker) -> None:
        """Stop ``worker`` for good (killed: its state is unknown) and start another."""
        with self._lock:
            if worker in self._all:
                self._all.remove(worker)
        worker.stop(kill=True)
        self._respawn()

    @property
    def startup_seconds(self) -> list[float]:
        """How long each worker took to start and load its processor."""
        with self._lock:
            return [worker.startup_s for worker in self._all]

    @property
    def kept_blocks(self) -> list[str]:
        """The names of the shared blocks the live workers keep from call to call."""
        with self._lock:
            blocks = [box.block for w in self._all for box in (w.inbox, w.outbox)]
            lendable = [name for w in self._all for name in w.lendable.names]
        return sorted([block.name for block in blocks if block is not None] + lendable)

    @property
    def lent_blocks(self) -> int:
        """Blocks of the live workers that outputs read without a copy still hold."""
        with self._lock:
            return sum(worker.lendable.lent for worker in self._all)

    @property
    def calls_in_flight(self) -> int:
        """Calls sent to a worker and not answered yet."""
        return self._in_flight

    def _count_in_flight(self, change: int) -> None:
        with self._lock:
            self._in_flight += change

    @property
    def pids(self) -> list[int]:
        """The workers' process ids."""
        with self._lock:
            return [worker.process.pid for worker in self._all if worker.process.pid is not None]

    def _take(self) -> _Worker:
        """The next idle worker that is alive: one that died while idle is replaced, and the
        next one taken."""
        while True:
            if self._closed:
                raise ProcessingError(f"{self._model}: the worker processes are closed")
            try:
                found = self._idle.get(timeout=self._wait_s)
            except queue.Empty:
                raise WorkerProcessError(
                    f"{self._model}: no worker process came free within {self._wait_s:g} s"
                ) from None
            if isinstance(found, BaseException):
                self._respawn()  # try again for the calls to come
                raise WorkerProcessError(
                    f"{self._model}: no worker process: {found}; another is being started"
                ) from found
            if found.process.is_alive() and not _pipe_closed(found):
                return found
            logger.warning(
                "%s: worker process %s died while idle (exit code %s); it is replaced",
                self._model,
                found.process.name,
                found.process.exitcode,
            )
            self._retire(found)

    @contextlib.contextmanager
    def _leased(self) -> Iterator[_Lease]:
        lease = _Lease(self._take())
        try:
            yield lease
        finally:
            if lease.busy:
                self._retire(lease.worker)
            else:
                self._idle.put(lease.worker)

    def call(
        self, mode: Any, text: str, items: Mapping[str, list[Any]], kwargs: Mapping[str, Any]
    ) -> tuple[dict[str, list[dict[str, Any]]], list[int] | None]:
        """Run the HF processor on ``items`` in a worker: the per-item outputs, and the prompt's
        ids when the processor expanded ``text`` (else None).

        Raises:
            WorkerProcessError: no worker could start, or the worker died or ran past the time
                limit (it is replaced).
            ProcessingError: the items or ``kwargs`` cannot be sent to a worker process.
            MmprocError: what the plugin's hook raised, as in a worker thread.
        """
        items_name, outputs_name = call_block_names()
        items_own = answered = False
        try:
            with self._leased() as lease:
                worker = lease.worker
                lendable = worker.lendable.take(worker.outputs_bytes)
                try:
                    message, items_own = self._message(
                        worker, mode, text, items, kwargs, items_name, outputs_name, lendable
                    )
                    lease.busy = True
                    self._count_in_flight(+1)
                    try:
                        answer = self._exchange(worker, message)
                    finally:
                        self._count_in_flight(-1)
                    lease.busy = False
                    status, detail, items_kept = pickle.loads(answer)
                    answered = True  # the worker left no block of this call but what it says
                    if items_kept:
                        self._items_block_kept(worker)
                    if status == "ok":  # read before the worker's blocks are written again
                        at, layout, ids = detail
                        outputs, lendable = self._outputs(worker, at, layout, lendable)
                        return outputs, ids
                finally:
                    if lendable is not None:  # not lent to this call's outputs
                        worker.lendable.give_back(lendable)
        finally:
            # The call's own blocks are ours to unlink: the items', if they went in one, and
            # whatever a worker that never answered may have made.
            if items_own or not answered:
                release_block(items_name)
            if not answered:
                release_block(outputs_name)
        error = pickle.loads(detail)
        if isinstance(error, MmprocError):
            raise error
        raise ProcessingError(f"{self._model}: {type(error).__name__}: {error}")

    def _items_block_kept(self, worker: _Worker) -> None:
        """The plugin kept an image of the items past its call, and the image is the items
        block's memory: the worker gets a new block next time, and keeps that one mapped until
        the image is gone."""
        worker.inbox.drop()
        if not self._warned_kept_items:
            self._warned_kept_items = True
            logger.warning(
                "%s: process_mm_data kept a reference to its items after it returned; with "
                "worker_kind='process' each such call costs a new shared memory block",
                self._model,
            )

    def _outputs(
        self, worker: _Worker, at: Where, layout: list[Any], lendable: KeptBlock | None
    ) -> tuple[dict[str, list[dict[str, Any]]], KeptBlock | None]:
        """The outputs of a call, and ``lendable`` unless they were lent it: views of the block
        lent to them, or copied out of the worker's block or the call's own (unlinked once
        read); after the call's own, the worker's block is made large enough for outputs of
        that size."""
        if at is None:
            return read_outputs(None, layout), lendable
        name, kept, size = at
        worker.outputs_bytes = size
        if kept and lendable is not None and lendable.block is not None:
            if lendable.block.name == name:
                lent = worker.lendable.lend(lendable)
                return read_outputs(lendable.block, layout, shared=lent), None
        if kept:
            block = worker.outbox.block
            if block is None or block.name != name:  # dropped: close() stopped the worker
                raise ProcessingError(f"{self._model}: the worker processes were closed")
            return read_outputs(block, layout), lendable
        try:
            block = SharedMemory(name=name)
        except OSError:
            release_block(name)
            raise
        try:
            outputs = read_outputs(block, layout)
        finally:
            drop_block(block)
        replaced = worker.outbox.block
        with contextlib.suppress(WorkerProcessError):  # no room to keep that: the next spills
            worker.outbox.fitted(size)
        if replaced is not None and replaced is not worker.outbox.block:
            worker.forget.append(replaced.name)
        return outputs, lendable

    def _message(
        self,
        worker: _Worker,
        mode: Any,
        text: str,
        items: Mapping[str, list[Any]],
        kwargs: Mapping[str, Any],
        items_name: str,
        outputs_name: str,
        lendable: KeptBlock | None,
    ) -> tuple[bytes, bool]:
        """The call as ``worker`` receives it, its items written to shared memory (pickled
        here, so a value that cannot go to a worker fails before the worker is sent anything),
        and whether the items went in a block of the call's own. Its outputs go in
        ``lendable`` when there is one, else in the worker's outputs block."""
        try:
            items_at, described = write_items(items, worker.inbox, items_name)
            outbox = worker.outbox.block if lendable is None else lendable.block
            kept_out = None if outbox is None else (outbox.name, outbox.size)
            forget, worker.forget = worker.forget + worker.lendable.forgotten(), []
            message = ForkingPickler.dumps(
                (mode, text, items_at, described, dict(kwargs), kept_out, outputs_name, forget)
            )
            return bytes(message), items_at is not None and not items_at[1]
        except WorkerProcessError as exc:
            raise WorkerProcessError(f"{self._model}: this request's items: {exc}") from exc
        except Exception as exc:
            raise ProcessingError(
                f"{self._model}: the items or hf_kwargs cannot be sent to a worker process "
                f"(worker_kind='process' pickles them): {type(exc).__name__}: {exc}"
            ) from exc

    def _exchange(self, worker: _Worker, message: bytes) -> bytes:
        """Send ``message`` to ``worker`` and wait for its answer (pickled)."""
        try:
            worker.conn.send_bytes(message)
            deadline = None if self._timeout is None else time.monotonic() + self._timeout
            while not worker.conn.poll(0.05):
                if not worker.process.is_alive():
                    raise EOFError
                if deadline is not None and time.monotonic() > deadline:
                    raise WorkerProcessError(
                        f"{self._model}: worker process {worker.process.name} took longer "
                        f"than {self._timeout:g} s (the worker_timeout_s option) on this "
                        "request's items: it was stopped, and is replaced"
                    )
            return worker.conn.recv_bytes()
        except (EOFError, OSError):
            worker.process.join(_STOP_GRACE_S)  # a dead process is reaped at once: its exit code
            raise WorkerProcessError(
                f"{self._model}: worker process {worker.process.name} died (exit code "
                f"{worker.process.exitcode}) while processing this request's items; it is "
                "replaced"
            ) from None

    def close(self) -> None:
        """Stop every worker (idempotent)."""
        self._closing.set()
        with self._lock:
            self._closed = True
            workers, self._all = self._all, []
            starters = list(self._starters)
        for worker in workers:
            worker.stop()
        for starter in starters:
            if starter is not threading.current_thread():
                starter.join(2 * _STOP_GRACE_S)
