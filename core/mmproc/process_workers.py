"""Process workers: the HF processor calls in worker processes, past the GIL.

With ``worker_kind="process"``, each thread of the worker pool hands its HF processor calls to
a worker process of its own: the process runs the plugin's ``process_mm_data`` and
``get_mm_fields`` on a processor it loaded itself (the same plugin, folder and options), and
hands the per-item outputs back through one block of shared memory per call, not as pickled
tensors. Everything else stays in the serving process: the cache (one for all workers), single
flight, prompt updates, tokenising, so the outputs are those of the thread pool, bit for bit.

Workers are spawned (a fresh interpreter: no state forked from the server), side by side, each
loading its processor once; by default in the background at start-up, so that construction does
not wait (the first calls wait for their worker). A worker that dies (killed, a segfault, out of
memory) fails only the call it was running, with a :class:`~mmproc.errors.WorkerProcessError`
naming it and how it ended, and is replaced; a call that runs past ``worker_timeout_s`` has its
worker stopped and replaced the same way. The items go to a worker pickled (images, frames,
waveforms); the outputs come back in shared memory, copied out once into ordinary tensors and the
block released.

A worker process costs its own interpreter with torch and transformers imported and the
processor loaded (``benchmarks/workers.py`` prints start-up seconds and resident memory per
worker).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import pickle
import queue
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from multiprocessing import resource_tracker
from multiprocessing.connection import Connection
from multiprocessing.shared_memory import SharedMemory
from typing import Any

import numpy as np

from mmproc.errors import MmprocError, ProcessingError, WorkerProcessError

__all__ = ["WorkerProcesses", "WorkerSpec"]

logger = logging.getLogger(__name__)

_ALIGN = 64  # bytes: every tensor in the shared block starts on a cache line


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker process builds its processor from: the model folder, the plugin options
    and the core's options that shape the HF processor."""

    model: str
    options: Mapping[str, Any] = field(default_factory=dict)


# --- the worker's side ---------------------------------------------------------------------------


def _worker_main(conn: Connection, spec: WorkerSpec) -> None:
    """A worker process: build the processor, then answer calls until told to stop."""
    from mmproc.factory import get_processor
    from mmproc.fields import split_outputs

    try:
        processor = get_processor(
            spec.model, workers=1, warm_up=False, cache_bytes=0, **dict(spec.options)
        )
    except BaseException as exc:  # the parent says why the worker could not start
        conn.send(("failed", f"{type(exc).__name__}: {exc}"))
        return
    model, ctx, hf = processor.model, processor.ctx, processor.hf_processor
    conn.send(("ready", None))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return  # the serving process went away
        if message is None:
            processor.close()
            return
        mode, text, sent, kwargs = message
        try:
            items = _items_from(*sent)
            counts = {modality: len(values) for modality, values in items.items()}
            outputs = model.process_mm_data(ctx, mode, text, items, hf, kwargs)
            per_item = split_outputs(outputs, model.get_mm_fields(ctx, outputs), counts)
            ids = outputs.get("input_ids") if "input_ids" in outputs else None
            block, layout = _pack(per_item)
            conn.send(("ok", (block, layout, None if ids is None else _first_row(ids))))
        except BaseException as exc:
            conn.send(("error", _portable(exc)))


# --- items to the worker --------------------------------------------------------------------------

_ARRAY_MODES = frozenset({"RGB", "RGBA", "L"})


def _items_to(items: Mapping[str, list[Any]]) -> tuple[str | None, list[Any]]:
    """The items' pixels and samples in one shared block (an image as its array when that is
    all it is; anything else pickled), and how to rebuild each."""
    from PIL import Image

    from mmproc.media.items import AudioItem, VideoItem

    arrays: list[np.ndarray] = []
    described: list[Any] = []
    offset = 0

    def place(array: np.ndarray) -> tuple[str, tuple[int, ...], int]:
        nonlocal offset
        offset = -(-offset // _ALIGN) * _ALIGN
        arrays.append(np.ascontiguousarray(array))
        at = offset
        offset += array.nbytes
        return str(array.dtype), tuple(array.shape), at

    for modality, values in items.items():
        entries: list[tuple[Any, ...]] = []
        for value in values:
            if (
                isinstance(value, Image.Image)
                and value.mode in _ARRAY_MODES
                and not value.info.get("transparency")
            ):
                entries.append(("image", value.mode, *place(np.asarray(value))))
            elif isinstance(value, VideoItem):
                entries.append(("video", value.metadata, *place(value.frames)))
            elif isinstance(value, AudioItem):
                entries.append(("audio", value.sample_rate, *place(value.waveform)))
            else:
                entries.append(("pickle", pickle.dumps(value)))
        described.append((modality, entries))
    if not arrays:
        return None, described
    block = SharedMemory(create=True, size=max(offset, 1))
    resource_tracker.unregister(block._name, "shared_memory")  # type: ignore[attr-defined]
    try:
        position = 0
        for _, entries in described:
            for entry in entries:
                if entry[0] == "pickle":
                    continue
                _, _, dtype, shape, at = entry
                view = np.ndarray(shape, np.dtype(dtype), buffer=block.buf, offset=at)
                view[...] = arrays[position]
                position += 1
        return block.name, described
    finally:
        block.close()  # the worker unlinks it once it has read the items


def _items_from(name: str | None, described: list[Any]) -> dict[str, list[Any]]:
    """The items a worker was sent (copied out of the block, which is then released)."""
    from PIL import Image

    from mmproc.media.items import AudioItem, VideoItem

    block = SharedMemory(name=name) if name is not None else None
    try:
        items: dict[str, list[Any]] = {}
        for modality, entries in described:
            values = items.setdefault(modality, [])
            for entry in entries:
                if entry[0] == "pickle":
                    values.append(pickle.loads(entry[1]))
                    continue
                kind, extra, dtype, shape, at = entry
                assert block is not None  # items with arrays come with their block
                array = np.ndarray(shape, np.dtype(dtype), buffer=block.buf, offset=at).copy()
                if kind == "image":
                    values.append(Image.fromarray(array, mode=extra))
                elif kind == "video":
                    values.append(VideoItem(array, extra))
                else:
                    values.append(AudioItem(array, extra))
        return items
    finally:
        if block is not None:
            block.close()
            block.unlink()


def _first_row(ids: Any) -> list[int]:
    rows = ids.tolist() if hasattr(ids, "tolist") else list(ids)
    return list(rows[0]) if rows and isinstance(rows[0], list) else list(rows)


def _portable(exc: BaseException) -> Any:
    """``exc`` as the parent can raise it: itself when it pickles and unpickles, else a
    ProcessingError saying what it was."""
    try:
        data = pickle.dumps(exc)
        pickle.loads(data)
        return data
    except Exception:
        return pickle.dumps(ProcessingError(f"{type(exc).__name__}: {exc}"))


def _pack(per_item: Mapping[str, list[dict[str, Any]]]) -> tuple[str | None, list[Any]]:
    """Put every tensor of ``per_item`` into one shared memory block; the block's name and the
    layout: per modality, per item, key -> ("tensor", dtype, shape, offset) or ("value", v)."""
    import torch

    arrays: list[np.ndarray] = []
    layout: list[Any] = []
    offset = 0
    for modality, items in per_item.items():
        entries = []
        for item in items:
            described: dict[str, Any] = {}
            for key, value in item.items():
                if isinstance(value, torch.Tensor | np.ndarray):
                    tensor = torch.as_tensor(value).detach().cpu().contiguous()
                    as_bits = tensor.view(torch.int16) if tensor.dtype == torch.bfloat16 else tensor
                    array = as_bits.numpy()
                    offset = -(-offset // _ALIGN) * _ALIGN
                    described[key] = ("tensor", str(tensor.dtype), tuple(tensor.shape), offset)
                    arrays.append(array)
                    offset += array.nbytes
                else:
                    described[key] = ("value", value)
            entries.append(described)
        layout.append((modality, entries))
    if not arrays:
        return None, layout
    block = SharedMemory(create=True, size=max(offset, 1))
    # The serving process owns the block from here (it unlinks it): not this one's tracker.
    resource_tracker.unregister(block._name, "shared_memory")  # type: ignore[attr-defined]
    position = 0
    try:
        for entries_of in layout:
            for described in entries_of[1]:
                for entry in described.values():
                    if entry[0] != "tensor":
                        continue
                    array = arrays[position]
                    position += 1
                    start = entry[3]
                    view = np.ndarray(array.shape, array.dtype, buffer=block.buf, offset=start)
                    view[...] = array
        name = block.name
    finally:
        block.close()  # the parent unlinks it once it has copied the outputs out
    return name, layout


# --- the serving process's side -------------------------------------------------------------------


def _unpack(name: str | None, layout: list[Any]) -> dict[str, list[dict[str, Any]]]:
    """The per-item outputs from a worker's block (copied out; the block is then released)."""
    import torch

    block = SharedMemory(name=name) if name is not None else None
    try:
        per_item: dict[str, list[dict[str, Any]]] = {}
        for modality, entries in layout:
            items = per_item.setdefault(modality, [])
            for described in entries:
                item: dict[str, Any] = {}
                for key, entry in described.items():
                    if entry[0] == "value":
                        item[key] = entry[1]
                        continue
                    _, dtype_name, shape, offset = entry
                    assert block is not None  # a layout with tensors comes with its block
                    dtype = getattr(torch, dtype_name.removeprefix("torch."))
                    carrier = torch.int16 if dtype == torch.bfloat16 else dtype
                    count = int(np.prod(shape)) if shape else 1
                    raw = torch.frombuffer(
                        block.buf,
                        dtype=carrier,
                        count=count,
                        offset=offset,
                    )
                    tensor = raw.clone().view(shape)
                    item[key] = tensor.view(dtype) if carrier is not dtype else tensor
                items.append(item)
        return per_item
    finally:
        if block is not None:
            block.close()
            block.unlink()


def _release(name: str | None) -> None:
    """Unlink a shared block if it is still there."""
    if name is None:
        return
    with contextlib.suppress(FileNotFoundError):
        block = SharedMemory(name=name)
        block.close()
        block.unlink()


class _Worker:
    """One worker process and the pipe to it."""

    def __init__(self, spec: WorkerSpec, index: int) -> None:
        context = multiprocessing.get_context("spawn")
        self.conn, child = context.Pipe()
        self.process = context.Process(
            target=_worker_main, args=(child, spec), name=f"mmproc-worker-{index}", daemon=True
        )
        started = time.perf_counter()
        self.process.start()
        child.close()
        status, detail = self.conn.recv() if self._alive_recv() else ("failed", "it exited")
        if status != "ready":
            self.stop()
            raise ProcessingError(f"worker process {index} could not start: {detail}")
        self.startup_s = time.perf_counter() - started

    def _alive_recv(self) -> bool:
        while not self.conn.poll(0.1):
            if not self.process.is_alive():
                return False
        return True

    def stop(self, *, kill: bool = False) -> None:
        with contextlib.suppress(OSError, EOFError, BrokenPipeError):
            if not kill:
                self.conn.send(None)
        if kill or not _joined(self.process, 5):
            self.process.kill()
            _joined(self.process, 5)
        self.conn.close()


def _joined(process: Any, timeout: float) -> bool:
    process.join(timeout)
    return not process.is_alive()


class WorkerProcesses:
    """``count`` worker processes lent one per call: as many as the worker pool has threads, so
    a call never waits for one.

    Args:
        spec: What each worker builds its processor from.
        count: Workers (the pool's worker count).
        timeout_s: The longest one call may run before its worker is killed (None: no limit).
        model: How to name the model in errors.
        background: Start the workers in the background (the first calls wait for them).
    """

    def __init__(
        self,
        spec: WorkerSpec,
        count: int,
        *,
        timeout_s: float | None,
        model: str,
        background: bool = True,
    ) -> None:
        self._spec = spec
        self._timeout = timeout_s
        self._model = model
        self._idle: queue.Queue[_Worker | BaseException] = queue.Queue()
        self._all: list[_Worker] = []
        self._lock = threading.Lock()
        self._closed = False
        self._started = 0
        starter = threading.Thread(target=self._start, args=(count,), daemon=True)
        starter.start()
        if not background:
            starter.join()

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
            worker = _Worker(self._spec, index)
        except BaseException as exc:
            self._idle.put(exc)  # the call that takes it says why
            return
        with self._lock:
            if self._closed:
                worker.stop()
                return
            self._all.append(worker)
        self._idle.put(worker)

    @property
    def startup_seconds(self) -> list[float]:
        """How long each worker took to start and load its processor."""
        with self._lock:
            return [worker.startup_s for worker in self._all]

    @property
    def pids(self) -> list[int]:
        """The workers' process ids."""
        with self._lock:
            return [worker.process.pid for worker in self._all if worker.process.pid is not None]

    @contextlib.contextmanager
    def _lent(self) -> Iterator[_Worker]:
        found = self._idle.get()
        if isinstance(found, BaseException):
            threading.Thread(target=self._spawn, daemon=True).start()  # try again later
            raise ProcessingError(f"{self._model}: no worker process: {found}") from found
        worker = found
        healthy = True
        try:
            yield worker
        except WorkerProcessError:
            healthy = False
            raise
        finally:
            if healthy:
                self._idle.put(worker)
            else:
                with self._lock:
                    if worker in self._all:
                        self._all.remove(worker)
                worker.stop(kill=True)
                if not self._closed:
                    threading.Thread(target=self._spawn, daemon=True).start()

    def call(
        self, mode: Any, text: str, items: Mapping[str, list[Any]], kwargs: Mapping[str, Any]
    ) -> tuple[dict[str, list[dict[str, Any]]], list[int] | None]:
        """Run the HF processor on ``items`` in a worker: the per-item outputs, and the prompt's
        ids when the processor expanded ``text`` (else None).

        Raises:
            WorkerProcessError: the worker died or ran past the time limit (it is replaced).
            MmprocError: what the plugin's hook raised, as in a worker thread.
        """
        sent = _items_to(items)
        with self._lent() as worker:
            try:
                worker.conn.send((mode, text, sent, dict(kwargs)))
                deadline = None if self._timeout is None else time.monotonic() + self._timeout
                while not worker.conn.poll(0.05):
                    if not worker.process.is_alive():
                        raise EOFError
                    if deadline is not None and time.monotonic() > deadline:
                        _release(sent[0])
                        raise WorkerProcessError(
                            f"{self._model}: worker process {worker.process.name} took longer "
                            f"than {self._timeout:g} s (the worker_timeout_s option) on this "
                            "request's items: it was stopped, and is replaced"
                        )
                status, detail = worker.conn.recv()
            except (EOFError, OSError, BrokenPipeError):
                _release(sent[0])  # the items the dead worker may not have read
                worker.process.join(5)  # a dead process is reaped at once: its exit code says how
                code = worker.process.exitcode
                raise WorkerProcessError(
                    f"{self._model}: worker process {worker.process.name} died (exit code "
                    f"{code}) while processing this request's items; it is replaced"
                ) from None
        if status == "error":
            error = pickle.loads(detail)
            if isinstance(error, MmprocError):
                raise error
            raise ProcessingError(f"{self._model}: {type(error).__name__}: {error}")
        name, layout, ids = detail
        return _unpack(name, layout), ids

    def close(self) -> None:
        """Stop every worker (idempotent)."""
        with self._lock:
            self._closed = True
            workers, self._all = self._all, []
        for worker in workers:
            worker.stop()
