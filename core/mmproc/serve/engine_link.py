"""The native path to the engine: rendered requests sent over mmproc's wire, each HTTP request
answered once the engine has acknowledged its request (or refused it, or never did).

:class:`EngineLink` owns one :class:`mmproc.wire.RequestSender` (zero-copy tensor frames,
acknowledged delivery with re-sends). A thread of its own keeps the sender serviced (reading
acknowledgements, re-sending what is overdue) and settles the future of each request: done
when acknowledged, failed with :class:`EngineRefused` when the receiver refused it or every
attempt went unacknowledged. An HTTP request is never answered with a success the engine did
not acknowledge.

Requests go to the engine under ids of the link's own (:meth:`EngineLink.new_request_id`: the
client's id and a suffix no other request of this server has), since clients choose theirs and
two requests in flight under one id could not be told apart.
"""

from __future__ import annotations

import asyncio
import itertools
import secrets
import threading
from dataclasses import dataclass
from typing import Any

from mmproc.wire import DeliveryFailure, EngineRequest, RequestSender

__all__ = ["EngineLink", "EngineRefused"]

_SERVICE_SLICE = 0.002  # seconds the servicing thread waits for replies at a time


class EngineRefused(Exception):
    """The engine did not take a request: ``refused`` (malformed, never reached it) or not
    acknowledged after every attempt (``reason`` says which)."""

    def __init__(self, request_id: str, reason: str, *, refused: bool) -> None:
        super().__init__(f"engine request {request_id}: {reason}")
        self.request_id = request_id
        self.reason = reason
        self.refused = refused


@dataclass(slots=True)
class _Waiting:
    """An HTTP request waiting for the engine's answer to its engine request."""

    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[None]
    sent: bool = False  # the sender's ledger holds it (its send returned)
    failure: DeliveryFailure | None = None


class EngineLink:
    """Sends `EngineRequest`s to the engine at ``address`` and settles each one's future."""

    def __init__(self, address: str, **sender_options: Any) -> None:
        self.address = address
        self._sender = RequestSender(address, **sender_options)
        self._lock = threading.Lock()
        self._waiting: dict[str, _Waiting] = {}  # by engine request id
        self._tag = secrets.token_hex(4)  # this link's, so that ids differ across restarts too
        self._numbers = itertools.count(1)
        self._wake = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(
            target=self._service, name="mmproc-engine-link", daemon=True
        )
        self._thread.start()

    @property
    def sender(self) -> RequestSender:
        """The wire sender (its counters: ``acknowledged``, ``resent``, ...)."""
        return self._sender

    def new_request_id(self, request_id: str) -> str:
        """An id to send a request under: ``request_id`` with a suffix that no other id this
        link has made has."""
        return f"{request_id}-{self._tag}{next(self._numbers)}"

    async def send(self, request: EngineRequest, *, timeout: float | None = None) -> None:
        """Send ``request`` (its id one of :meth:`new_request_id`'s) and wait until the engine
        acknowledges it.

        Raises:
            EngineRefused: the receiver refused it, or it went unacknowledged.
            TimeoutError: it could not be sent within ``timeout`` (no engine connected, or the
                window of unsettled requests is full).
            ValueError: a request with that id is in flight already.
        """
        loop = asyncio.get_running_loop()
        waiting = _Waiting(loop, loop.create_future())
        request_id = request.request_id
        with self._lock:
            if request_id in self._waiting:
                raise ValueError(f"engine request {request_id!r} is in flight already")
            # Registered before it is sent, so that a refusal read meanwhile is kept for it.
            self._waiting[request_id] = waiting
        try:
            await loop.run_in_executor(None, lambda: self._sender.send(request, timeout=timeout))
            with self._lock:
                waiting.sent = True
            self._wake.set()
            await waiting.future
        finally:
            with self._lock:
                if self._waiting.get(request_id) is waiting:
                    del self._waiting[request_id]

    def _service(self) -> None:
        while not self._stopping:
            with self._lock:
                # Only requests the ledger held before the snapshot below can be judged by it.
                sent = [(rid, w) for rid, w in self._waiting.items() if w.sent]
            if not sent:
                self._wake.wait(0.05 if not self._waiting else _SERVICE_SLICE)
                self._wake.clear()
                continue
            try:
                self._sender.flush(timeout=_SERVICE_SLICE)
                # Outstanding first, failures second: a request that left the ledger before the
                # snapshot has its failure, if it had one, among those taken after it.
                outstanding = set(self._sender.unacknowledged)
                failures = self._sender.take_failures()
            except RuntimeError:
                return  # closed
            settled: list[tuple[str, _Waiting]] = []
            with self._lock:
                for failure in failures:
                    # A failure of no request waiting here (its HTTP side went away) is dropped.
                    found = self._waiting.get(failure.request_id)
                    if found is not None and found.failure is None:
                        found.failure = failure
                for request_id, waiting in sent:
                    # Settled: refused or given up on (a failure came), or acknowledged (it left
                    # the ledger, and the sender reports every request that leaves it unacked).
                    if waiting.failure is not None or request_id not in outstanding:
                        settled.append((request_id, waiting))
                        if self._waiting.get(request_id) is waiting:
                            del self._waiting[request_id]
            for request_id, waiting in settled:
                error = None
                if waiting.failure is not None:
                    failure = waiting.failure
                    error = EngineRefused(request_id, failure.reason, refused=failure.refused)
                waiting.loop.call_soon_threadsafe(_settle, waiting.future, error)

    def close(self) -> None:
        """Stop servicing and close the sender (requests still waiting fail)."""
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout=5)
        with self._lock:
            waiting, self._waiting = self._waiting, {}
        for request_id, entry in waiting.items():
            error = EngineRefused(request_id, "the server is shutting down", refused=False)
            entry.loop.call_soon_threadsafe(_settle, entry.future, error)
        self._sender.close()


def _settle(future: asyncio.Future[None], error: BaseException | None) -> None:
    if future.done():
        return  # its HTTP request went away (timed out, cancelled)
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)
