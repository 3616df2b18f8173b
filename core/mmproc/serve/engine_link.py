"""The native path to the engine: rendered requests sent over mmproc's wire, each HTTP request
answered once the engine has acknowledged its request (or refused it, or never did).

:class:`EngineLink` owns one :class:`mmproc.wire.RequestSender` (zero-copy tensor frames,
acknowledged delivery with re-sends) and one thread that drives it: the thread sends each
request handed to it, then waits for what comes back (`RequestSender.wait_for_replies`: woken
by a reply, a re-send coming due, or a new request) and settles the future of each request:
done when acknowledged, failed with :class:`EngineRefused` when the receiver refused it or every
attempt went unacknowledged. An HTTP request is never answered with a success the engine did
not acknowledge. One thread doing all of it, woken only when something happened, keeps the
link's cost per request to one send and one wake-up; a sender shared by the event loop's
executor threads and a thread polling for replies handed the GIL back and forth many times.

A request may carry stand-ins of items the engine holds (`mmproc.wire.items.is_stand_in`: the
server keeps only their metadata); when the engine turns out to lack one, the request fails with
:class:`EngineLacksItems`, and its caller makes the items again and sends it anew.

Requests go to the engine under ids of the link's own (:meth:`EngineLink.new_request_id`: the
client's id and a suffix no other request of this server has), since clients choose theirs and
two requests in flight under one id could not be told apart.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import secrets
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from mmproc.errors import EncodeError
from mmproc.wire import (
    DeliveryFailure,
    EngineRequest,
    RequestSender,
    SenderStats,
    StandInsNotHeldError,
)

__all__ = ["EngineLacksItems", "EngineLink", "EngineRefused"]

logger = logging.getLogger(__name__)

# Seconds one attempt to send waits for room (an engine connected, a place in the window or the
# queue): the link's thread reads replies and settles requests between attempts.
_SEND_SLICE = 0.05
# The longest wait for replies: requests in flight, then none. Replies wake the wait as they
# come (no other thread reads the socket: the sender's watcher is off), so these are only a
# safeguard should a wake-up ever be missed, not the pace of the link.
_BUSY_WAIT = 0.02
_IDLE_WAIT = 0.5


class EngineRefused(Exception):
    """The engine did not take a request: ``refused`` (malformed, never reached it) or not
    acknowledged after every attempt (``reason`` says which)."""

    def __init__(self, request_id: str, reason: str, *, refused: bool) -> None:
        super().__init__(f"engine request {request_id}: {reason}")
        self.request_id = request_id
        self.reason = reason
        self.refused = refused


class EngineLacksItems(EngineRefused):
    """The request holds stand-ins of items the engine does not hold (any more): nothing of it
    reached the engine. Send it again with those items' tensors."""

    def __init__(self, request_id: str, reason: str) -> None:
        super().__init__(request_id, reason, refused=False)


@dataclass(slots=True, eq=False)
class _Waiting:
    """An HTTP request waiting for the engine's answer to its engine request."""

    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[None]
    request: EngineRequest | None  # until it is sent
    timeout: float | None
    deadline: float | None = field(init=False)
    sent: bool = False  # the sender's ledger holds it (its send returned)
    abandoned: bool = False  # its HTTP side went away: not sent if not sent yet
    failure: DeliveryFailure | None = None

    def __post_init__(self) -> None:
        self.deadline = None if self.timeout is None else time.monotonic() + self.timeout


class EngineLink:
    """Sends `EngineRequest`s to the engine at ``address`` and settles each one's future."""

    def __init__(self, address: str, **sender_options: Any) -> None:
        self.address = address
        # This link's thread reads every reply as it comes (`wait_for_replies`): the sender's own
        # watcher would take the socket's wake-ups from it, and each reply would wait for a timeout.
        self._sender = RequestSender(address, **sender_options, watch_replies=False)
        self._lock = threading.Lock()
        self._waiting: dict[str, _Waiting] = {}  # by engine request id
        self._queue: deque[_Waiting] = deque()  # handed over, not sent yet
        self._tag = secrets.token_hex(4)  # this link's, so that ids differ across restarts too
        self._numbers = itertools.count(1)
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_read, False)
        os.set_blocking(self._wake_write, False)
        self._signalled = False  # a byte is in the pipe (or about to be)
        self._stopping = False
        self._stats = self._sender.stats
        self._thread = threading.Thread(target=self._run, name="mmproc-engine-link", daemon=True)
        self._thread.start()

    @property
    def sender(self) -> RequestSender:
        """The wire sender (driven by the link's thread; read its counters through `stats`)."""
        return self._sender

    @property
    def stats(self) -> SenderStats:
        """The sender's counters as the link's thread last read them: after every send, reply
        and settled request, so never older than the answers already given."""
        return self._stats

    def holds(self, request: EngineRequest) -> list[bool]:
        """Per feature of ``request``: whether the engine holds that item now, as far as its
        acknowledgements tell (`RequestSender.holds`)."""
        return self._sender.holds(request)

    def new_request_id(self, request_id: str) -> str:
        """An id to send a request under: ``request_id`` with a suffix that no other id this
        link has made has."""
        return f"{request_id}-{self._tag}{next(self._numbers)}"

    async def send(self, request: EngineRequest, *, timeout: float | None = None) -> None:
        """Send ``request`` (its id one of :meth:`new_request_id`'s) and wait until the engine
        acknowledges it.

        Raises:
            EngineLacksItems: it holds stand-ins of items the engine does not hold.
            EngineRefused: the receiver refused it, or it went unacknowledged, or the link is
                closing.
            TimeoutError: it could not be sent within ``timeout`` (no engine connected, or the
                window of unsettled requests is full).
            EncodeError: the request cannot be encoded.
            ValueError: a request with that id is in flight already.
        """
        loop = asyncio.get_running_loop()
        waiting = _Waiting(loop, loop.create_future(), request, timeout)
        request_id = request.request_id
        with self._lock:
            if self._stopping:
                raise EngineRefused(request_id, "the server is shutting down", refused=False)
            if request_id in self._waiting:
                raise ValueError(f"engine request {request_id!r} is in flight already")
            # Registered before it is sent, so that a refusal read meanwhile is kept for it.
            self._waiting[request_id] = waiting
            self._queue.append(waiting)
            wake = not self._signalled
            self._signalled = True
        if wake:
            self._wake()
        try:
            await waiting.future
        finally:
            with self._lock:
                waiting.abandoned = True
                waiting.request = None
                if self._waiting.get(request_id) is waiting:
                    del self._waiting[request_id]

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):  # full: it is awake already
            os.write(self._wake_write, b"\0")

    def _run(self) -> None:
        sender = self._sender
        while True:
            # Emptied before the queue is taken: a request queued after this is woken for.
            with contextlib.suppress(BlockingIOError, OSError):
                while os.read(self._wake_read, 4096):
                    pass
            with self._lock:
                if self._stopping:
                    return
                queued = list(self._queue)
                self._queue.clear()
                self._signalled = False
            try:
                unsent = self._send_all(queued)
                self._settle_sent()
                busy = bool(self._waiting)
                wait = 0.0 if unsent else _BUSY_WAIT if busy else _IDLE_WAIT
                sender.wait_for_replies(wait, self._wake_read)
            except RuntimeError:
                return  # closed

    def _send_all(self, queued: list[_Waiting]) -> bool:
        """Send the requests handed over, in order; those that find no room within a slice go
        back to the front of the queue. Returns whether some did."""
        for index, waiting in enumerate(queued):
            with self._lock:
                request = None if waiting.abandoned else waiting.request
            if request is None:
                continue
            now = time.monotonic()
            remaining = None if waiting.deadline is None else waiting.deadline - now
            try:
                self._sender.send(
                    request,
                    timeout=_SEND_SLICE
                    if remaining is None
                    else max(0.0, min(_SEND_SLICE, remaining)),
                )
            except TimeoutError:
                if remaining is not None and remaining <= _SEND_SLICE:
                    self._fail(
                        waiting,
                        TimeoutError(
                            f"engine request {request.request_id} was not sent within "
                            f"{waiting.timeout:g} s: no engine at {self.address} took it (none "
                            "connected, or its queue or the window of unacknowledged requests full)"
                        ),
                    )
                    continue
                with self._lock:
                    self._queue.extendleft(reversed(queued[index:]))
                return True
            except StandInsNotHeldError as exc:
                self._fail(waiting, EngineLacksItems(request.request_id, exc.reason))
                continue
            except (EncodeError, ValueError, TypeError) as exc:
                self._fail(waiting, exc)
                continue
            except RuntimeError:
                raise  # the sender is closed: the link stops
            except Exception as exc:
                # Whatever else one send raises fails that request alone: the thread carries
                # every other request, and must not end with it.
                logger.exception("engine request %s could not be sent", request.request_id)
                self._fail(waiting, EngineRefused(request.request_id, repr(exc), refused=False))
                continue
            with self._lock:
                waiting.sent = True
                waiting.request = None
        return False

    def _settle_sent(self) -> None:
        sender = self._sender
        with self._lock:
            # Only requests the ledger held before the snapshot below can be judged by it.
            sent = [(rid, w) for rid, w in self._waiting.items() if w.sent]
        if not sent:
            self._stats = sender.stats
            return
        # Outstanding first, failures second: a request that left the ledger before the
        # snapshot has its failure, if it had one, among those taken after it.
        outstanding = set(sender.unacknowledged)
        failures = sender.take_failures()
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
        # Before the answers: a client that reads /metrics after its answer sees it counted.
        self._stats = sender.stats
        for request_id, waiting in settled:
            error: EngineRefused | None = None
            if waiting.failure is not None:
                failure = waiting.failure
                if failure.missing:
                    error = EngineLacksItems(request_id, failure.reason)
                else:
                    error = EngineRefused(request_id, failure.reason, refused=failure.refused)
            self._settle(waiting, error)

    def _fail(self, waiting: _Waiting, error: BaseException) -> None:
        with self._lock:
            request_id = None if waiting.request is None else waiting.request.request_id
            waiting.request = None
            if request_id is not None and self._waiting.get(request_id) is waiting:
                del self._waiting[request_id]
        self._settle(waiting, error)

    @staticmethod
    def _settle(waiting: _Waiting, error: BaseException | None) -> None:
        with contextlib.suppress(RuntimeError):  # its loop is closed: nobody waits any more
            waiting.loop.call_soon_threadsafe(_settle, waiting.future, error)

    def close(self) -> None:
        """Stop the link's thread and close the sender (requests still waiting fail); idempotent
        (its pipe's descriptors are closed once: a second close could close others' files)."""
        with self._lock:
            if self._stopping:
                return
            self._stopping = True
        self._wake()
        self._thread.join(timeout=5)
        with self._lock:
            waiting, self._waiting = self._waiting, {}
            self._queue.clear()
        for request_id, entry in waiting.items():
            error = EngineRefused(request_id, "the server is shutting down", refused=False)
            self._settle(entry, error)
        self._sender.close()
        for descriptor in (self._wake_read, self._wake_write):
            with contextlib.suppress(OSError):
                os.close(descriptor)


def _settle(future: asyncio.Future[None], error: BaseException | None) -> None:
    if future.done():
        return  # its HTTP request went away (timed out, cancelled)
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)
