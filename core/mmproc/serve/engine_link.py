"""The native path to the engine: rendered requests sent over mmproc's wire, each HTTP request
answered once the engine has acknowledged its request (or refused it, or never did).

:class:`EngineLink` owns one :class:`mmproc.wire.RequestSender` (zero-copy tensor frames,
acknowledged delivery with re-sends). A thread of its own keeps the sender serviced (reading
acknowledgements, re-sending what is overdue) and settles the future of each request: done
when acknowledged, failed with :class:`EngineRefused` when the receiver refused it or every
attempt went unacknowledged. An HTTP request is never answered with a success the engine did
not acknowledge.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from mmproc.wire import EngineRequest, RequestSender

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


class EngineLink:
    """Sends `EngineRequest`s to the engine at ``address`` and settles each one's future."""

    def __init__(self, address: str, **sender_options: Any) -> None:
        self.address = address
        self._sender = RequestSender(address, **sender_options)
        self._lock = threading.Lock()
        self._waiting: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = {}
        self._failed: dict[str, Any] = {}  # DeliveryFailure by id, until its request settles
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

    async def send(self, request: EngineRequest, *, timeout: float | None = None) -> None:
        """Send ``request`` and wait until the engine acknowledges it.

        Raises:
            EngineRefused: the receiver refused it, or it went unacknowledged.
            TimeoutError: it could not be sent within ``timeout`` (no engine connected, or the
                window of unsettled requests is full).
        """
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        await loop.run_in_executor(None, lambda: self._sender.send(request, timeout=timeout))
        # Registered once the sender's ledger holds it: from here on it is outstanding until
        # acknowledged, and a failure that came first is kept in _failed.
        with self._lock:
            self._waiting[request.request_id] = (loop, future)
        self._wake.set()
        await future

    def _service(self) -> None:
        while not self._stopping:
            if not self._waiting:
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            try:
                self._sender.flush(timeout=_SERVICE_SLICE)
                failures = self._sender.take_failures()
                outstanding = set(self._sender.unacknowledged)
            except RuntimeError:
                return  # closed
            with self._lock:
                self._failed.update((f.request_id, f) for f in failures)
                settled = [
                    (request_id, loop, future, self._failed.pop(request_id, None))
                    for request_id, (loop, future) in list(self._waiting.items())
                    if request_id in self._failed or request_id not in outstanding
                ]
                for request_id, _, _, _ in settled:
                    del self._waiting[request_id]
                if len(self._failed) > 4096:  # failures of requests whose HTTP side went away
                    self._failed.clear()
            for request_id, loop, future, failure in settled:
                if failure is None:
                    loop.call_soon_threadsafe(_settle, future, None)
                else:
                    error = EngineRefused(request_id, failure.reason, refused=failure.refused)
                    loop.call_soon_threadsafe(_settle, future, error)

    def close(self) -> None:
        """Stop servicing and close the sender (requests still waiting fail)."""
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout=5)
        with self._lock:
            waiting, self._waiting = self._waiting, {}
        for request_id, (loop, future) in waiting.items():
            error = EngineRefused(request_id, "the server is shutting down", refused=False)
            loop.call_soon_threadsafe(_settle, future, error)
        self._sender.close()


def _settle(future: asyncio.Future[None], error: BaseException | None) -> None:
    if future.done():
        return  # its HTTP request went away (timed out, cancelled)
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)
