"""ZMQ transport for engine requests: `RequestSender` (front end) and `RequestReceiver` (engine).

A PUSH socket on the front end, a PULL socket on the engine, ``ipc://`` or ``tcp://``. Each request
is one multipart message: frame 0 the msgpack body, then one frame per large tensor. The sender
hands ZMQ the tensors' own memory (``copy=False``, tracked): nothing is copied in Python, the
frames keep the tensors alive until ZMQ has written them out, and `RequestSender.send` returns a
``zmq.MessageTracker`` that says when the tensors may be modified again. Frames under pyzmq's
``copy_threshold`` (64 KiB by default) are copied into ZMQ instead, as pyzmq would do anyway, since
for those a copy is cheaper than zero-copy bookkeeping; the sender asks for that copy directly and
tracks nothing for them, so a request made only of such frames gets a tracker that is done at
once. Frame 0 is never tracked: it is a ``bytes`` object of the message's own that nothing else
can modify (a large one still goes without a copy). Every larger aux frame is tracked, the token
ids of a long prompt (8k tokens and more) included, although that array is the message's own.
The receiver takes frames without copying and decodes tensors as read-only views over them.

Queues are bounded by high-water marks (messages): a sender blocks (or times out) when the engine
falls behind, instead of buffering without limit. The receiver is the engine's attack surface: a
message over the frame / byte limits is drained and dropped without being kept, a malformed one is
counted (`RequestReceiver.bad_messages`), logged and skipped, and the receiver keeps serving. ZMQ's
``MAXMSGSIZE`` also makes libzmq itself drop a peer that sends a frame larger than the byte limit.

Sockets are not thread-safe: a sender serialises its callers with a lock; a receiver belongs to the
one thread that reads from it (`RequestReceiver.stop` is the one call safe from another thread).
"""

from __future__ import annotations

import abc
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from types import TracebackType
from typing import Any, Final, Self

import zmq

from mmproc.errors import ConfigurationError, DecodeError
from mmproc.wire.codec import DEFAULT_LIMITS, DecodeLimits, Frame, zero_copy_threshold
from mmproc.wire.schema import EngineRequest, decode_request, encode_request

__all__ = ["DEFAULT_HWM", "RequestReceiver", "RequestSender"]

logger = logging.getLogger(__name__)

DEFAULT_HWM: Final = 64
"""Default high-water mark, in messages, of both ends' queues."""

_SCHEMES: Final = ("ipc://", "tcp://")

# A flood of bad messages must not become a flood of log lines: the first ones are all logged,
# after that one in this many (with the running count).
_LOG_FIRST: Final = 100
_LOG_EVERY: Final = 1000

# What `RequestSender.send` returns for a message ZMQ copied whole: done from the start.
_DONE: Final = zmq.MessageTracker()


def _check_address(address: str) -> None:
    if not isinstance(address, str) or not address.startswith(_SCHEMES):
        raise ConfigurationError(
            f"address must be an ipc:// or tcp:// ZMQ endpoint, got {address!r}"
        )


def _check_hwm(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigurationError(f"{name} must be a positive int (messages), got {value!r}")


def _milliseconds(seconds: float | None) -> int | None:
    if seconds is None:
        return None
    if seconds < 0:
        raise ValueError(f"timeout must be >= 0 seconds or None, got {seconds}")
    return round(seconds * 1000)


class _Endpoint(abc.ABC):
    """Socket set-up and tear-down shared by both ends."""

    def __init__(
        self,
        address: str,
        kind: int,
        *,
        bind: bool,
        context: zmq.Context[Any] | None,
        options: dict[int, int],
    ) -> None:
        _check_address(address)
        self._own_context = context is None
        self._context: zmq.Context[Any] = zmq.Context() if context is None else context
        self._socket: zmq.Socket[Any] = self._context.socket(kind)
        try:
            for option, value in options.items():
                self._socket.setsockopt(option, value)
            if bind:
                self._socket.bind(address)
                # tcp://host:* binds an ephemeral port; report the one actually bound.
                address = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
            else:
                self._socket.connect(address)
        except BaseException:
            self._socket.close(linger=0)
            if self._own_context:
                self._context.term()
            raise
        self._address = address
        self._closed = False

    @property
    def address(self) -> str:
        """The endpoint: as given when connecting, as bound (with the real port) when binding."""
        return self._address

    @property
    def closed(self) -> bool:
        """Whether `close` has run."""
        return self._closed

    def _shutdown(self, linger: float) -> None:
        self._closed = True
        self._socket.close(linger=_milliseconds(linger))
        if self._own_context:
            self._context.term()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    @abc.abstractmethod
    def close(self) -> None:
        """Close the endpoint; idempotent."""


class RequestSender(_Endpoint):
    """The front end's end: sends `EngineRequest`s to an engine over a ZMQ PUSH socket.

    ``address`` is an ``ipc://`` or ``tcp://`` endpoint, connected to (default) or bound
    (``bind=True``). ``threshold`` is the zero-copy threshold (default: env
    ``MMPROC_ZERO_COPY_THRESHOLD``, else 256 bytes), resolved once here so that a bad setting fails
    at start-up. ``send_hwm`` bounds the outgoing queue in messages. ``linger`` is how long `close`
    lets queued messages drain, in seconds. A ``context`` passed in is shared and left running;
    otherwise the sender owns one and terminates it on `close`. Safe to use from several threads.
    """

    def __init__(
        self,
        address: str,
        *,
        bind: bool = False,
        context: zmq.Context[Any] | None = None,
        threshold: int | None = None,
        send_hwm: int = DEFAULT_HWM,
        linger: float = 1.0,
    ) -> None:
        _check_hwm("send_hwm", send_hwm)
        if linger < 0:
            raise ConfigurationError(f"linger must be >= 0 seconds, got {linger}")
        self._threshold = zero_copy_threshold(threshold)
        self._linger = linger
        self._lock = threading.Lock()
        # Messages ZMQ may still be reading from: the tracker and the frames (which keep the
        # tensors alive; pyzmq holds them too, this makes the guarantee ours and lets flush wait).
        self._pending: deque[tuple[zmq.MessageTracker, list[Frame]]] = deque()
        super().__init__(
            address,
            zmq.PUSH,
            bind=bind,
            context=context,
            # IMMEDIATE: queue only to engines actually connected, so that "no engine" shows
            # as back-pressure (a send timeout) instead of messages piling up for nobody.
            options={
                zmq.SNDHWM: send_hwm,
                zmq.LINGER: _milliseconds(linger) or 0,
                zmq.IMMEDIATE: 1,
            },
        )

    @property
    def threshold(self) -> int:
        """The zero-copy threshold in bytes this sender encodes with."""
        return self._threshold

    @property
    def pending(self) -> int:
        """Messages whose tensor frames (zero-copy views) ZMQ has not released yet."""
        with self._lock:
            self._prune()
            return len(self._pending)

    def send(self, request: EngineRequest, *, timeout: float | None = None) -> zmq.MessageTracker:
        """Encode and send one request; returns a tracker that is ``done`` once ZMQ no longer
        reads the request's tensors (they must not be modified before).

        Blocks while the queue is at its high-water mark or no engine is connected; with
        ``timeout`` (seconds) raises ``TimeoutError`` instead, having sent nothing. Raises
        `mmproc.errors.EncodeError` for a request that cannot be encoded, and
        ``RuntimeError`` once closed.
        """
        frames = encode_request(request, threshold=self._threshold)
        return self._send_frames(frames, timeout)

    def _send_frames(self, frames: list[Frame], timeout: float | None) -> zmq.MessageTracker:
        with self._lock:
            if self._closed:
                raise RuntimeError(f"RequestSender for {self._address} is closed")
            socket = self._socket
            if self._pending:
                self._prune()
            if timeout is not None and not socket.poll(_milliseconds(timeout), zmq.POLLOUT):
                raise TimeoutError(
                    f"no engine at {self._address} accepted the request within {timeout} s "
                    "(none connected, or its queue is full)"
                )
            # Below pyzmq's copy threshold a frame is copied whatever it is asked (a copy is
            # cheaper than the bookkeeping of a zero-copy frame), so ask for exactly that and skip
            # the tracking. Frame 0, the msgpack body, is a bytes object of this message alone:
            # it goes zero-copy when large, but nobody can modify it, so it is never tracked.
            # Only aux frames at or over the threshold, views of live tensors, are tracked.
            copy_below = socket.copy_threshold
            last = len(frames) - 1
            trackers: list[zmq.MessageTracker] = []
            for index, frame in enumerate(frames):
                # ZMQ delivers multipart messages atomically: once the first part is queued the
                # others are accepted too, so only the first send can block.
                flags = zmq.SNDMORE if index < last else 0
                if len(frame) < copy_below:
                    socket.send(frame, flags)
                elif index == 0:
                    socket.send(frame, flags, copy=False)
                else:
                    trackers.append(socket.send(frame, flags, copy=False, track=True))
            if not trackers:
                return _DONE
            tracker = trackers[0] if len(trackers) == 1 else zmq.MessageTracker(*trackers)
            if not tracker.done:
                self._pending.append((tracker, frames))
            return tracker

    def _prune(self) -> None:
        pending = self._pending
        while pending and pending[0][0].done:
            pending.popleft()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until ZMQ has released every tensor frame sent so far (every frame that views a
        tensor's memory); False if ``timeout`` (seconds) ran out first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            trackers = [tracker for tracker, _ in self._pending]
        for tracker in trackers:
            remaining = -1.0 if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                tracker.wait(remaining)
            except zmq.NotDone:
                return False
        with self._lock:
            self._prune()
        return True

    def close(self) -> None:
        """Close the socket, letting queued messages drain for up to ``linger`` seconds; then the
        frames are released. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._shutdown(self._linger)
            self._pending.clear()


class RequestReceiver(_Endpoint):
    """The engine's end: receives and decodes `EngineRequest`s from a ZMQ PULL socket.

    ``address`` is an ``ipc://`` or ``tcp://`` endpoint, bound (default) or connected to
    (``bind=False``). ``limits`` bound every message (`DecodeLimits`; its ``max_total_bytes``
    also becomes ZMQ's ``MAXMSGSIZE``). ``recv_hwm`` bounds the incoming queue in messages.
    ``poll_interval`` (seconds) is how often iteration checks for `stop`.

    Iterating yields decoded requests until `stop` or `close`. Decoded tensors are read-only views
    over the received frames. A malformed message is counted in `bad_messages`, kept in
    `last_error`, logged, and skipped.
    """

    def __init__(
        self,
        address: str,
        *,
        bind: bool = True,
        context: zmq.Context[Any] | None = None,
        limits: DecodeLimits | None = None,
        recv_hwm: int = DEFAULT_HWM,
        poll_interval: float = 0.1,
    ) -> None:
        _check_hwm("recv_hwm", recv_hwm)
        if poll_interval <= 0:
            raise ConfigurationError(f"poll_interval must be > 0 seconds, got {poll_interval}")
        self._limits = DEFAULT_LIMITS if limits is None else limits
        if "<i8" not in self._limits.allowed_dtypes:
            raise ConfigurationError(
                "RequestReceiver limits must allow the '<i8' dtype: engine requests carry their "
                "prompt token ids in it (add it to DecodeLimits.allowed_dtypes)"
            )
        self._poll_ms = max(1, round(poll_interval * 1000))
        self._stop = threading.Event()
        self.received = 0
        """Requests decoded and handed out."""
        self.bad_messages = 0
        """Messages rejected as malformed or over the limits."""
        self.last_error: DecodeError | None = None
        """Why the most recent bad message was rejected."""
        super().__init__(
            address,
            zmq.PULL,
            bind=bind,
            context=context,
            options={
                zmq.RCVHWM: recv_hwm,
                zmq.MAXMSGSIZE: self._limits.max_total_bytes,
                zmq.LINGER: 0,
            },
        )
        self._poller = zmq.Poller()
        self._poller.register(self._socket, zmq.POLLIN)

    @property
    def limits(self) -> DecodeLimits:
        """The bounds every received message is held to."""
        return self._limits

    def recv(self, timeout: float | None = None) -> EngineRequest | None:
        """The next well-formed request, or None when ``timeout`` (seconds) passes without one
        (None: wait as long as it takes). Bad messages met meanwhile are counted and skipped."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self._closed:
                raise RuntimeError(f"RequestReceiver for {self._address} is closed")
            wait_ms = None
            if deadline is not None:
                wait_ms = max(0, math.ceil((deadline - time.monotonic()) * 1000))
            # A poller kept for the socket's lifetime: building one per call costs more than
            # the poll itself when messages are already queued.
            if not self._poller.poll(wait_ms):
                if deadline is not None and time.monotonic() >= deadline:
                    return None
                continue
            first = self._socket.recv(copy=False)
            try:
                request = decode_request(self._rest_of_message(first), limits=self._limits)
            except DecodeError as exc:
                self._reject(exc)
                continue
            self.received += 1
            return request

    def _rest_of_message(self, first: zmq.Frame) -> Sequence[zmq.Frame]:
        """Collect the parts of one multipart message, dropping (but draining) one over the
        limits so that neither a frame count nor a byte total can grow without bound here."""
        limits = self._limits
        frames = [first]
        total = len(first)
        fault: str | None = None
        more = first.more  # set by recv(copy=False): cheaper than asking the socket
        while more:
            # The rest of a multipart message is already here: ZMQ delivers it atomically.
            frame = self._socket.recv(copy=False)
            more = frame.more
            if fault is not None:
                continue
            frames.append(frame)
            total += len(frame)
            if len(frames) > limits.max_frames:
                fault = f"message has more than {limits.max_frames} frames"
            elif total > limits.max_total_bytes:
                fault = f"message is larger than the limit of {limits.max_total_bytes} bytes"
            if fault is not None:
                frames.clear()
        if fault is not None:
            raise DecodeError(fault)
        return frames

    def _reject(self, error: DecodeError) -> None:
        self.bad_messages += 1
        self.last_error = error
        count = self.bad_messages
        if count <= _LOG_FIRST or count % _LOG_EVERY == 0:
            logger.warning(
                "mmproc receiver %s dropped malformed message (%d so far): %s",
                self._address,
                count,
                error,
            )

    def __iter__(self) -> Iterator[EngineRequest]:
        """Yield requests as they arrive, until `stop` is called or the receiver is closed."""
        while not self._stop.is_set() and not self._closed:
            request = self.recv(timeout=self._poll_ms / 1000)
            if request is None:
                continue
            yield request
            # Drop this frame's reference before waiting for the next message: holding it would
            # pin the previous request's frames (megabytes) while the next ones are allocated.
            del request

    def stop(self) -> None:
        """Make iteration end within ``poll_interval``. Safe to call from any thread."""
        self._stop.set()

    def close(self) -> None:
        """Close the socket (and the context, if the receiver owns it); idempotent. Call from the
        thread that reads, after iteration has ended. Tensors already decoded stay valid."""
        if self._closed:
            return
        self._stop.set()
        self._shutdown(0)
