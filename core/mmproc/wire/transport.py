"""ZMQ transport for engine requests: `RequestSender` (front end) and `RequestReceiver` (engine).

A DEALER socket on the front end, a ROUTER socket on the engine, ``ipc://`` or ``tcp://``. Each
request is one multipart message: a delivery envelope (`mmproc.wire.delivery`), frame 0 the msgpack
body, then one frame per large tensor. The sender hands ZMQ the tensors' own memory
(``copy=False``, tracked): nothing is copied in Python, the frames keep the tensors alive until ZMQ
has written them out, and `RequestSender.send` returns a ``zmq.MessageTracker`` that says when ZMQ
has. Frames under pyzmq's ``copy_threshold`` (64 KiB by default) are copied into ZMQ instead, as
pyzmq would do anyway, since for those a copy is cheaper than zero-copy bookkeeping; the sender
asks for that copy directly and tracks nothing for them, so a request made only of such frames
gets a tracker that is done at once. Frame 0 is never tracked: it is a ``bytes`` object of the
message's own that nothing else can modify (a large one still goes without a copy). Every larger
aux frame is tracked, the token ids of a long prompt (8k tokens and more) included, although that
array is the message's own. The receiver takes frames without copying and decodes tensors as
read-only views over them.

Delivery guarantee. The receiver acknowledges every request it hands to the engine (when `recv`
returns it, or when the engine calls `RequestReceiver.ack` with ``auto_ack=False``), on the same
connection, and answers a malformed one with a refusal that says why. The sender keeps each
request until one of those arrives; without one for ``ack_timeout`` seconds it sends the request
again (same sequence number, next attempt), and after ``max_attempts`` sends it gives up. Refused
and given-up requests are reported by `RequestSender.take_failures`, with their request ids, so no
request is lost silently: `RequestSender.flush` returns True only once every request sent has
been acknowledged. A receiver never hands the engine the same request twice: a copy it has
delivered before is dropped (and acknowledged again; it remembers what each sender has not
settled yet). That memory is bounded and defended (`mmproc.wire.delivery` has the rules): only
requests that decode are recorded, so malformed messages cannot push a sender out; a sender's
record is forgotten only once it is silent, fully acknowledged and past `DEDUP_HOLD`; and when
a flood of new senders leaves no record to forget, a new sender's request is turned away
unanswered (and re-sent) rather than risk a duplicate. A sender's ``window`` and its
``ack_timeout * max_attempts`` are bounded to fit (`DEDUP_ENTRIES_PER_SENDER`, `DEDUP_HOLD`).
That memory is the receiver process's own:
a receiver that is killed and restarted forgets it, so a request the old process had handed to
its engine but could not acknowledge before dying reaches the new one again, as a `Delivery` with
``attempt > 1`` -- the one way an engine can see a request twice. An engine that must not run a
request twice acknowledges only once it has recorded the request (``auto_ack=False``) and checks
the ids of such re-deliveries against its record. A request given up on (no acknowledgement) may
have reached an engine that died or stalled; re-sending it is the caller's call. With several
receivers behind one sender, a re-send may reach another receiver than the first attempt did,
which then counts as a restart: the guarantee above is per receiver. Re-sends, reading
acknowledgements and giving up happen inside the sender's calls (`send`, `flush`,
`unacknowledged`, `take_failures`, `stats`): a sender left idle does them on its next call (but
see below for requests sent by reference).

Items by reference (`mmproc.wire.items`). Each acknowledgement says which of the request's items
the receiver now keeps; the sender sends those items again as references while it takes them to
be kept (``item_cache_bytes``), and the receiver fills references in before a request is handed
out: the engine only ever sees whole requests. What the sender takes to be kept is a guess, and
the guarantee above does not rest on it: a request referring to an item the receiver does not
keep (it evicted it, it is a new process, it is another receiver, the item came from another
sender's request that it has since dropped) is answered as missing items -- not delivered, not
recorded, not refused -- and the sender sends it again at once with every item in full, which
cannot be answered so. That send comes on top of ``max_attempts`` if need be; it leaves while the
request is unsettled, within ``ack_timeout * max_attempts`` of its first send, so it stays inside
what a receiver remembers of the sender. While requests sent by reference are unsettled, a thread
of the sender's own reads the replies, so that this happens without waiting for the sender's next
call. The items a request is filled with are taken before its own items are kept, and stay with
it: an eviction meanwhile changes nothing. A sender's guesses are per sender, not per receiver:
with several receivers behind one sender they are often wrong (each costing a send in full), and
such a sender is better off with ``item_cache_bytes=0``.

Tensors must not be modified until their request is acknowledged, since a re-send reads them
again. Queues are bounded: by high-water marks (messages), and by the sender's ``window`` of
unsettled requests; a sender blocks (or times out) when the engine falls behind, instead of
buffering without limit. The receiver is the engine's attack surface: a message over the frame /
byte limits is drained and dropped without being kept, a malformed one is counted
(`RequestReceiver.bad_messages`), logged, refused and skipped, and the receiver keeps serving.
ZMQ's ``MAXMSGSIZE`` also makes libzmq itself drop a peer that sends a frame larger than the byte
limit.

Sockets are not thread-safe: a sender serialises its callers with a lock; a receiver belongs to the
one thread that reads from it (`RequestReceiver.stop` is the one call safe from another thread).
"""

from __future__ import annotations

import abc
import logging
import math
import select
import threading
import time
import weakref
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from types import TracebackType
from typing import Any, Final, Self

import zmq

from mmproc.errors import ConfigurationError, DecodeError, EncodeError
from mmproc.wire.codec import DEFAULT_LIMITS, DecodeLimits, Frame, zero_copy_threshold
from mmproc.wire.delivery import (
    ACK,
    DEDUP_ENTRIES_PER_SENDER,
    DEDUP_HOLD,
    MISSING,
    Delivery,
    DeliveryFailure,
    Envelope,
    Outstanding,
    ReceiverLedger,
    SenderLedger,
    pack_ack,
    pack_missing,
    pack_refusal,
    unpack_reply,
)
from mmproc.wire.items import (
    DEFAULT_ITEM_CACHE_BYTES,
    MIN_ITEM_BYTES,
    HeldItems,
    ItemCache,
    MissingItemsError,
    StandInsNotHeldError,
    check_cache_bytes,
    is_stand_in,
    item_key,
    item_nbytes,
)
from mmproc.wire.schema import EngineRequest, decode_request_keys, encode_request_refs
from mmproc.wire.stats import ReceiverStats, SenderStats

__all__ = [
    "DEFAULT_ACK_TIMEOUT",
    "DEFAULT_HWM",
    "DEFAULT_MAX_ATTEMPTS",
    "DEFAULT_WINDOW",
    "RequestReceiver",
    "RequestSender",
]

logger = logging.getLogger(__name__)

DEFAULT_HWM: Final = 64
"""Default high-water mark, in messages, of both ends' queues."""

DEFAULT_ACK_TIMEOUT: Final = 10.0
"""Default seconds a sender waits for an acknowledgement before sending a request again. A
request waits in both ends' queues before the engine takes it: keep this well above the time the
engine needs to drain them."""

DEFAULT_MAX_ATTEMPTS: Final = 3
"""Default number of times a sender sends a request (the first included) before giving up."""

DEFAULT_WINDOW: Final = 256
"""Default most requests a sender keeps unsettled (from the oldest to the newest)."""

_SCHEMES: Final = ("ipc://", "tcp://")

# A flood of bad messages must not become a flood of log lines: the first ones are all logged,
# after that one in this many (with the running count).
_LOG_FIRST: Final = 100
_LOG_EVERY: Final = 1000

# What `RequestSender.send` returns for a message ZMQ copied whole: done from the start.
_DONE: Final = zmq.MessageTracker()

# How long one wait for acknowledgements holds the sender's lock: other threads' sends get in
# between.
_WAIT_SLICE: Final = 0.05

# Replies waiting for a slow sender, per sender: past it the receiver drops them (the sender then
# re-sends, and the duplicate is acknowledged again).
_REPLY_HWM: Final = 16384


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


def _check_positive(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ConfigurationError(f"{name} must be > 0, got {value!r}")


def _check_count(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigurationError(f"{name} must be a positive int, got {value!r}")


class RequestSender(_Endpoint):
    """The front end's end: sends `EngineRequest`s to an engine over a ZMQ DEALER socket, and
    keeps each until the engine acknowledges it (see the delivery guarantee in this module).

    ``address`` is an ``ipc://`` or ``tcp://`` endpoint, connected to (default) or bound
    (``bind=True``). ``threshold`` is the zero-copy threshold (default: env
    ``MMPROC_ZERO_COPY_THRESHOLD``, else 256 bytes), resolved once here so that a bad setting fails
    at start-up. ``send_hwm`` bounds the outgoing queue in messages, ``window`` the requests not
    yet settled (at most `mmproc.wire.delivery.DEDUP_ENTRIES_PER_SENDER`). A request
    unacknowledged for ``ack_timeout`` seconds is sent again, up to ``max_attempts`` sends in
    all, then reported by `take_failures` (``ack_timeout * max_attempts`` at most
    `mmproc.wire.delivery.DEDUP_HOLD`, so that receivers remember the request as long as it may
    come again). ``linger`` is how long `close`
    lets queued messages drain, in seconds. A ``context`` passed in is shared and left running;
    otherwise the sender owns one and terminates it on `close`. Safe to use from several threads.

    ``item_cache_bytes`` (default `mmproc.wire.items.DEFAULT_ITEM_CACHE_BYTES`, 1 GiB; set it to
    the receiver's) is how many bytes of items the sender takes a receiver to keep: an item the
    receiver acknowledged holding goes again as a reference, not in full, while the items it
    holds fit in it (least recently sent first out). 0 sends every item in full. `stats` counts
    what went which way.

    While requests sent by reference are unsettled, a thread of the sender's own reads the
    replies (so that an item the receiver no longer holds is sent again in full at once, not at
    the caller's next call). ``watch_replies=False`` leaves that to the caller: for a thread that
    drives the sender and waits in `wait_for_replies`, which reads each reply as it comes. A
    watcher there would only take the socket's wake-ups from it.
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
        ack_timeout: float = DEFAULT_ACK_TIMEOUT,
        max_attempts: int = DEFAULT_MAX_ATTEMPTS,
        window: int = DEFAULT_WINDOW,
        item_cache_bytes: int = DEFAULT_ITEM_CACHE_BYTES,
        watch_replies: bool = True,
    ) -> None:
        _check_hwm("send_hwm", send_hwm)
        if linger < 0:
            raise ConfigurationError(f"linger must be >= 0 seconds, got {linger}")
        _check_positive("ack_timeout", ack_timeout)
        _check_count("max_attempts", max_attempts)
        _check_count("window", window)
        # What a receiver remembers of a sender must cover everything it may re-send, and for
        # as long as it may re-send it (mmproc.wire.delivery).
        if window > DEDUP_ENTRIES_PER_SENDER:
            raise ConfigurationError(
                f"window must be at most {DEDUP_ENTRIES_PER_SENDER} requests (what a receiver "
                f"remembers per sender, mmproc.wire.delivery.DEDUP_ENTRIES_PER_SENDER), got "
                f"{window}"
            )
        if ack_timeout * max_attempts > DEDUP_HOLD:
            raise ConfigurationError(
                f"ack_timeout * max_attempts must be at most {DEDUP_HOLD:g} s (how long a "
                "receiver keeps a silent sender's record, mmproc.wire.delivery.DEDUP_HOLD), got "
                f"{ack_timeout:g} s * {max_attempts}"
            )
        held_bytes = check_cache_bytes("RequestSender", item_cache_bytes)
        self._threshold = zero_copy_threshold(threshold)
        self._linger = linger
        self._window = window
        self._lock = threading.Lock()
        self._ledger = SenderLedger(float(ack_timeout), max_attempts)
        # What the receiver said it holds: a guess, which a missing-items reply corrects.
        self._held = HeldItems(held_bytes) if held_bytes else None
        self._counts = _SenderCounts()
        # Requests sent by reference and not settled yet, by sequence number; while there are
        # some, a thread of the sender's own reads the replies (`_watch_replies`).
        self._referring: set[int] = set()
        self._watch_replies = watch_replies
        self._watching = threading.Event()
        self._watcher: threading.Thread | None = None
        # Messages ZMQ may still be reading from: the tracker and the frames (which keep the
        # tensors alive; pyzmq holds them too, this makes the guarantee ours and lets flush wait).
        self._pending: deque[tuple[zmq.MessageTracker, list[Frame]]] = deque()
        super().__init__(
            address,
            zmq.DEALER,
            bind=bind,
            context=context,
            # IMMEDIATE: queue only to engines actually connected, so that "no engine" shows
            # as back-pressure (a send timeout) instead of messages piling up for nobody.
            # RCVHWM 0: replies are small and bounded by the window; none may be dropped here.
            options={
                zmq.SNDHWM: send_hwm,
                zmq.RCVHWM: 0,
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

    @property
    def unacknowledged(self) -> list[str]:
        """Ids of the requests sent and not settled yet (neither acknowledged nor given up on),
        oldest first. Reads the acknowledgements that have arrived first."""
        with self._lock:
            self._service()
            return [entry.request_id for entry in self._ledger.outstanding.values()]

    @property
    def acknowledged(self) -> int:
        """Requests acknowledged so far."""
        with self._lock:
            self._service()
            return self._ledger.acknowledged

    @property
    def resent(self) -> int:
        """Re-sends made so far (attempts after the first)."""
        return self._ledger.resent

    @property
    def item_cache_bytes(self) -> int:
        """Bytes of items this sender takes a receiver to keep (0: every item goes in full)."""
        return 0 if self._held is None else self._held.max_bytes

    @property
    def stats(self) -> SenderStats:
        """What this sender has sent so far and what became of it (a snapshot; reads the
        acknowledgements that have arrived first)."""
        with self._lock:
            if not self._closed:
                self._service()
            ledger, held = self._ledger, self._held
            return SenderStats(
                **asdict(self._counts),
                resent=ledger.resent,
                acknowledged=ledger.acknowledged,
                refused=ledger.refused,
                given_up=ledger.given_up,
                unsettled=len(ledger.outstanding),
                items_held=0 if held is None else len(held),
                held_bytes=0 if held is None else held.nbytes,
            )

    def take_failures(self) -> list[DeliveryFailure]:
        """The requests given up on since the last call, oldest first: refused by a receiver,
        or not acknowledged after ``max_attempts`` sends. Each is reported once."""
        with self._lock:
            self._service()
            failures = self._ledger.failures
            self._ledger.failures = []
            return failures

    def send(self, request: EngineRequest, *, timeout: float | None = None) -> zmq.MessageTracker:
        """Encode and send one request; returns a tracker that is ``done`` once ZMQ no longer
        reads the request's tensors. The sender keeps the request until it is acknowledged, and
        a re-send reads the tensors again: modify them only after that (`flush`).

        Blocks while the queue is at its high-water mark, the ``window`` of unsettled requests is
        full, or no engine is connected; with ``timeout`` (seconds) raises ``TimeoutError``
        instead, having sent nothing. Raises `mmproc.errors.EncodeError` for a request that cannot
        be encoded, and ``RuntimeError`` once closed.

        Items the receiver said it holds go as references (see ``item_cache_bytes``); should it
        no longer hold one, the request is sent again at once with every item in full.
        """
        if not isinstance(request, EngineRequest):
            raise TypeError(f"send takes an EngineRequest, got {type(request).__name__}")
        keys = sizes = refs = None
        if self._held is not None and request.features:
            keys, sizes = _item_keys(request)
            if keys is not None:
                with self._lock:
                    if self._closed:
                        raise RuntimeError(f"RequestSender for {self._address} is closed")
                    self._service()  # the latest acknowledgements say what the receiver holds
                    refs = self._held.choose(keys)
        references = 0 if refs is None else len(refs) - refs.count(None)
        if references < len(request.features):
            _check_no_stand_ins(request, refs)
        frames = encode_request_refs(request, self._threshold, refs if references else None)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            if self._closed:
                raise RuntimeError(f"RequestSender for {self._address} is closed")
            ledger = self._ledger
            # Replies are read in batches, once half the window is in use (they wait in the
            # socket meanwhile), and whenever a request is due to be sent again.
            if 2 * ledger.span() >= self._window or time.monotonic() >= ledger.next_due:
                self._service()
            while ledger.span() >= self._window:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(
                        f"{ledger.span()} requests to {self._address} are unsettled, the window "
                        f"of {self._window}: the engine has not acknowledged them within "
                        f"{timeout} s"
                    )
                self._await_replies(
                    _WAIT_SLICE if remaining is None else min(_WAIT_SLICE, remaining)
                )
            entry = ledger.add(request.request_id, frames)
            entry.features, entry.keys, entry.sizes = len(request.features), keys, sizes
            if references:
                entry.request, entry.references = request, references
            try:
                remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
                tracker = self._send_frames(entry, remaining, timeout)
            except BaseException:
                ledger.forget(entry)
                raise
            self._counts.requests += 1
            if references and self._watch_replies:
                self._watch(entry)
            return tracker

    def holds(self, request: EngineRequest) -> list[bool]:
        """Per feature of ``request``: whether this sender takes the receiver to hold that item
        now (it would go by reference). For a caller that then keeps only a stand-in of it
        (`mmproc.wire.items.is_stand_in`)."""
        if self._held is None or not request.features:
            return [False] * len(request.features)
        keys, _ = _item_keys(request)
        if keys is None:
            return [False] * len(request.features)
        with self._lock:
            return [key is not None and key in self._held for key in keys]

    def _watch(self, entry: Outstanding) -> None:
        """Have the replies read in the background until ``entry`` (sent by reference) is
        settled: should the receiver lack an item, the request goes again in full at once, not
        at this sender's next call. Called with the lock held."""
        self._referring.add(entry.sequence)
        self._watching.set()
        if self._watcher is None:
            self._watcher = threading.Thread(
                target=_watch_replies,
                args=(weakref.ref(self),),
                name=f"mmproc-sender-replies {self._address}",
                daemon=True,
            )
            self._watcher.start()

    def _still_referring(self) -> bool:
        """Whether a request sent by reference is still unsettled (and in need of the watcher).
        Called with the lock held."""
        outstanding = self._ledger.outstanding
        referring = self._referring
        for sequence in list(referring):
            entry = outstanding.get(sequence)
            if entry is None or entry.request is None:
                referring.discard(sequence)
        return bool(referring)

    def _send_frames(
        self, entry: Outstanding, wait: float | None, timeout: float | None
    ) -> zmq.MessageTracker:
        socket = self._socket
        if self._pending:
            self._prune()
        if wait is not None and not socket.poll(_milliseconds(wait), zmq.POLLOUT):
            raise TimeoutError(
                f"no engine at {self._address} accepted the request within {timeout} s "
                "(none connected, or its queue is full)"
            )
        return self._write(entry, 0)

    def _write(self, entry: Outstanding, first_flags: int) -> zmq.MessageTracker:
        """Put the envelope and the frames of ``entry`` on the socket. ZMQ delivers multipart
        messages atomically: once the first part is queued the others are accepted too, so only
        the first send can block (or, with ``first_flags`` NOBLOCK, fail)."""
        socket = self._socket
        socket.send(self._ledger.envelope(entry), first_flags | zmq.SNDMORE)
        # Below pyzmq's copy threshold a frame is copied whatever it is asked (a copy is
        # cheaper than the bookkeeping of a zero-copy frame), so ask for exactly that and skip
        # the tracking. Frame 0, the msgpack body, is a bytes object of this message alone:
        # it goes zero-copy when large, but nobody can modify it, so it is never tracked.
        # Only aux frames at or over the threshold, views of live tensors, are tracked.
        frames = entry.frames
        copy_below = socket.copy_threshold
        last = len(frames) - 1
        trackers: list[zmq.MessageTracker] = []
        nbytes = _ENVELOPE_BYTES
        for index, frame in enumerate(frames):
            flags = zmq.SNDMORE if index < last else 0
            size = len(frame)
            nbytes += size
            if size < copy_below:
                socket.send(frame, flags)
            elif index == 0:
                socket.send(frame, flags, copy=False)
            else:
                trackers.append(socket.send(frame, flags, copy=False, track=True))
        counts = self._counts
        counts.messages += 1
        counts.frames += len(frames) + 1
        counts.bytes += nbytes
        counts.items_by_reference += entry.references
        counts.items_in_full += entry.features - entry.references
        if not trackers:
            return _DONE
        tracker = trackers[0] if len(trackers) == 1 else zmq.MessageTracker(*trackers)
        if not tracker.done:
            self._pending.append((tracker, frames))
        return tracker

    def _service(self) -> None:
        """Read the replies that have arrived, then re-send or give up on overdue requests.
        Called with the lock held."""
        socket = self._socket
        ledger = self._ledger
        while int(socket.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
            parts = socket.recv_multipart(flags=zmq.NOBLOCK)
            reply = unpack_reply(parts[0]) if len(parts) == 1 else None
            if reply is None:
                logger.warning("mmproc sender %s ignored a message that is no reply", self._address)
                continue
            entry = ledger.entry_for(reply)
            if entry is None:
                continue  # for a request settled already (a copy's answer)
            if reply.kind is MISSING:
                # A wrong guess of what the receiver holds. Answers to earlier copies of one
                # sent in full since then are left for the full one's own answer.
                if entry.request is not None:
                    self._send_in_full(entry, reply.reason)
                continue
            ledger.settle(entry, reply.kind is ACK, reply.reason)
            entry.request = None
            held = self._held
            if reply.held and held is not None and entry.keys is not None:
                sizes = entry.sizes or ()
                for position, key in enumerate(entry.keys):
                    if key is not None and reply.holds(position):
                        held.mark(key, sizes[position])
        now = time.monotonic()
        for entry in ledger.overdue(now):
            ledger.resending(entry, now)
            try:
                self._write(entry, zmq.NOBLOCK)
            except zmq.Again:
                pass  # no engine connected now: this attempt is spent all the same

    def _send_in_full(self, entry: Outstanding, reason: str) -> None:
        """Send ``entry`` again at once, every item in full: the receiver lacks one it referred
        to. Called with the lock held."""
        request = entry.request
        assert request is not None and self._held is not None
        entry.request, entry.references = None, 0
        # The answer to this send says again which of them the receiver holds.
        self._held.forget(entry.keys or ())
        if any(is_stand_in(feature) for feature in request.features):
            # No tensors to send them in full with: the caller makes them again.
            self._ledger.settle(entry, False, f"the engine lacks items: {reason}", missing=True)
            return
        logger.debug(
            "mmproc sender %s sends %r again in full: %s", self._address, entry.request_id, reason
        )
        try:
            entry.frames = encode_request_refs(request, self._threshold, None)
        except EncodeError as exc:  # it encoded before: only a request changed since gets here
            self._ledger.settle(entry, False, f"cannot send the request again in full: {exc}")
            return
        self._counts.resent_in_full += 1
        self._ledger.resending(entry, time.monotonic())
        try:
            self._write(entry, zmq.NOBLOCK)
        except zmq.Again:
            pass  # no engine connected now: the next re-send (after ack_timeout) goes in full

    def _await_replies(self, seconds: float) -> None:
        """Wait up to ``seconds`` for a reply (or an overdue request), then service. Called with
        the lock held; keep ``seconds`` short, other threads wait for it."""
        wait = min(seconds, max(0.0, self._ledger.next_due - time.monotonic()))
        self._socket.poll(_milliseconds(wait), zmq.POLLIN)
        self._service()

    def _prune(self) -> None:
        pending = self._pending
        while pending and pending[0][0].done:
            pending.popleft()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every request sent so far is settled and ZMQ has released every tensor
        frame; True if every one of them was acknowledged, False if some were given up on (see
        `take_failures`) or ``timeout`` (seconds) ran out first. Re-sends overdue requests while
        it waits."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._lock:
                if self._closed:
                    raise RuntimeError(f"RequestSender for {self._address} is closed")
                self._service()
                if not self._ledger.outstanding:
                    trackers = [tracker for tracker, _ in self._pending]
                    failed = bool(self._ledger.failures)
                    break
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                slice_ = _WAIT_SLICE if remaining is None else min(_WAIT_SLICE, remaining)
                self._await_replies(slice_)
        for tracker in trackers:
            remaining = -1.0 if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                tracker.wait(remaining)
            except zmq.NotDone:
                return False
        with self._lock:
            self._prune()
        return not failed

    def wait_for_replies(self, timeout: float, wake: int | None = None) -> None:
        """Wait until a reply may have arrived, a request is due to be sent again, the file
        descriptor ``wake`` is readable or ``timeout`` seconds have passed; then read the replies
        and re-send what is overdue, as every call does.

        For a thread that drives the sender (sends, then waits for what comes back): unlike the
        sender's other waits it does not hold the lock while it waits, so other threads' calls
        go on meanwhile. ``wake`` lets another thread end the wait (a pipe it writes to); it is
        not read here. Raises ``RuntimeError`` once closed.
        """
        with self._lock:
            if self._closed:
                raise RuntimeError(f"RequestSender for {self._address} is closed")
            self._service()
            # ZMQ's descriptor is edge-triggered: readable once something may have changed since
            # the socket's events were last read. They are read here, last (a re-send in
            # _service reads them too, and may have taken the edge of a reply that came).
            descriptor = int(self._socket.getsockopt(zmq.FD))
            wait = min(timeout, max(0.0, self._ledger.next_due - time.monotonic()))
            if int(self._socket.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                wait = 0.0
        if wait > 0:
            poller = select.poll()
            poller.register(descriptor, select.POLLIN)
            if wake is not None:
                poller.register(wake, select.POLLIN)
            try:
                poller.poll(math.ceil(wait * 1000))  # never 0 ms: a wait, not a spin
            except OSError:
                pass  # closed meanwhile: seen below
        with self._lock:
            if self._closed:
                raise RuntimeError(f"RequestSender for {self._address} is closed")
            self._service()

    def close(self) -> None:
        """Close the socket, letting queued messages drain for up to ``linger`` seconds; then the
        frames are released, and requests not yet acknowledged are forgotten (`flush` first to
        learn what became of them). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._shutdown(self._linger)
            self._pending.clear()
            self._ledger.outstanding.clear()
            if self._held is not None:
                self._held.clear()
            self._referring.clear()
            self._watching.set()  # the watcher, if any, sees the sender closed and ends


# How long the watcher waits for the socket's notification before it looks anyway: another
# thread's send can take the notification of a reply that it does not read.
_WATCH_SLICE: Final = 0.01


def _watch_replies(sender_ref: weakref.ReferenceType[RequestSender]) -> None:
    """A sender's background reader of replies, while requests it sent by reference are
    unsettled (`RequestSender._watch`). It holds the sender only weakly, and the lock only to
    read what has arrived; between reads it waits on the socket's file descriptor, which ZMQ
    makes readable when something may have arrived."""
    descriptor: int | None = None
    while True:
        sender = sender_ref()
        if sender is None or sender.closed:
            return
        wake = sender._watching
        del sender  # not kept alive by its own watcher
        if not wake.wait(1.0):
            continue
        sender = sender_ref()
        if sender is None:
            return
        with sender._lock:
            if sender._closed:
                return
            try:
                if descriptor is None:
                    descriptor = int(sender._socket.getsockopt(zmq.FD))
                sender._service()
            except Exception:
                # The sender's own calls still read replies; only the promptness is lost.
                logger.exception("mmproc sender %s stopped reading replies", sender.address)
                return
            idle = not sender._still_referring()
            if idle:
                wake.clear()  # under the lock: a send by reference sets it again under it
        del sender
        if not idle:
            try:
                select.select([descriptor], [], [], _WATCH_SLICE)
            except (OSError, ValueError):
                pass  # the socket was closed meanwhile: the next turn sees it


# The delivery envelope in front of every message (`mmproc.wire.delivery`), counted in the stats.
_ENVELOPE_BYTES: Final = 40


@dataclass(slots=True)
class _Counts:
    """Counters both ends keep (`SenderStats` and `ReceiverStats` say what each counts)."""

    messages: int = 0
    frames: int = 0
    bytes: int = 0
    items_in_full: int = 0
    items_by_reference: int = 0


@dataclass(slots=True)
class _SenderCounts(_Counts):
    """A sender's counters besides its ledger's."""

    requests: int = 0
    resent_in_full: int = 0


@dataclass(slots=True)
class _ReceiverCounts(_Counts):
    """A receiver's counters besides its attributes."""

    missing_items: int = 0


def _check_no_stand_ins(request: EngineRequest, refs: Sequence[bytes | None] | None) -> None:
    """Raise `StandInsNotHeldError` if a stand-in item of ``request`` would go in full."""
    lacking = [
        feature.hash
        for position, feature in enumerate(request.features)
        if (refs is None or refs[position] is None) and is_stand_in(feature)
    ]
    if lacking:
        raise StandInsNotHeldError(request.request_id, lacking)


def _item_keys(request: EngineRequest) -> tuple[list[bytes | None] | None, list[int]]:
    """Per feature, its item key (None for an item too small to go by reference) and its
    tensor bytes; keys None when no item can go by reference."""
    sizes = [item_nbytes(feature) for feature in request.features]
    if max(sizes) < MIN_ITEM_BYTES:
        return None, sizes
    try:
        keys = [
            item_key(feature) if size >= MIN_ITEM_BYTES else None
            for feature, size in zip(request.features, sizes, strict=True)
        ]
    except ValueError:
        return None, sizes  # a norm that cannot be packed: the encoder says what is wrong
    return keys, sizes


class RequestReceiver(_Endpoint):
    """The engine's end: receives and decodes `EngineRequest`s from a ZMQ ROUTER socket, and
    acknowledges each to its sender (see the delivery guarantee in this module).

    ``address`` is an ``ipc://`` or ``tcp://`` endpoint, bound (default) or connected to
    (``bind=False``). ``limits`` bound every message (`DecodeLimits`; its ``max_total_bytes``
    also becomes ZMQ's ``MAXMSGSIZE``). ``recv_hwm`` bounds the incoming queue in messages.
    ``poll_interval`` (seconds) is how often iteration checks for `stop`. With ``auto_ack`` (the
    default) a request is acknowledged as it is handed out; without, the engine calls `ack` once
    it has taken the request (until then, a copy the sender re-sends is dropped unanswered).

    Iterating yields decoded requests until `stop` or `close`. Decoded tensors are read-only views
    over the received frames. A malformed message is counted in `bad_messages`, kept in
    `last_error`, logged, refused to its sender, and skipped (it leaves no record of its sender);
    a copy of a request already handed out is counted in `duplicates` and skipped; a request
    from a new sender while every sender record is still needed is counted in `turned_away`,
    logged, and left unanswered (its sender sends it again).

    ``item_cache_bytes`` (default `mmproc.wire.items.DEFAULT_ITEM_CACHE_BYTES`, 1 GiB) bounds the
    tensor bytes of the items the receiver keeps from the requests it hands out (least recently
    used first out; an item larger than the bound is not kept), shared by all its senders: a
    sender refers to a kept item instead of sending it again, and the receiver fills the
    reference in before handing the request out, so the engine always gets whole requests. A
    request referring to an item not kept is answered as missing items (`stats`), and its sender
    sends it again in full. 0 keeps nothing.
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
        auto_ack: bool = True,
        item_cache_bytes: int = DEFAULT_ITEM_CACHE_BYTES,
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
        self._auto_ack = bool(auto_ack)
        self._ledger = ReceiverLedger()
        self._items = ItemCache(check_cache_bytes("RequestReceiver", item_cache_bytes))
        # Deliveries awaiting the engine's ack (auto_ack=False), by request (compared by
        # identity), with their items' keys (to say which are held when it comes).
        self._unacked: dict[EngineRequest, tuple[bytes, Envelope, list[bytes | None]]] = {}
        self._counts = _ReceiverCounts()
        self.received = 0
        """Requests decoded and handed out."""
        self.bad_messages = 0
        """Messages rejected as malformed or over the limits."""
        self.duplicates = 0
        """Copies of requests already handed out (re-sent by their sender), dropped."""
        self.turned_away = 0
        """Requests left unanswered, to be sent again, because every record of a sender was
        still needed (`mmproc.wire.delivery`: only a flood of new senders does this)."""
        self.last_error: DecodeError | None = None
        """Why the most recent bad message was rejected."""
        super().__init__(
            address,
            zmq.ROUTER,
            bind=bind,
            context=context,
            # LINGER: acknowledgements still queued at close get a moment to leave, so that a
            # clean shutdown does not make senders re-send what was taken.
            options={
                zmq.RCVHWM: recv_hwm,
                zmq.SNDHWM: _REPLY_HWM,
                zmq.MAXMSGSIZE: self._limits.max_total_bytes,
                zmq.LINGER: 1000,
            },
        )
        self._poller = zmq.Poller()
        self._poller.register(self._socket, zmq.POLLIN)

    @property
    def limits(self) -> DecodeLimits:
        """The bounds every received message is held to."""
        return self._limits

    @property
    def auto_ack(self) -> bool:
        """Whether requests are acknowledged as they are handed out."""
        return self._auto_ack

    @property
    def item_cache_bytes(self) -> int:
        """The bound on the tensor bytes of the items kept (0: none is kept)."""
        return self._items.max_bytes

    @property
    def stats(self) -> ReceiverStats:
        """What this receiver has received so far and what it did with it (a snapshot; may be
        taken from another thread, e.g. for ``/metrics``, with counters a message apart)."""
        items = self._items
        return ReceiverStats(
            **asdict(self._counts),
            received=self.received,
            bad_messages=self.bad_messages,
            duplicates=self.duplicates,
            turned_away=self.turned_away,
            items_cached=len(items),
            cached_bytes=items.nbytes,
            evictions=items.evictions,
        )

    def recv(self, timeout: float | None = None) -> EngineRequest | None:
        """The next well-formed request, or None when ``timeout`` (seconds) passes without one
        (None: wait as long as it takes). Bad messages and duplicates met meanwhile are counted
        and skipped."""
        taken = self._next(timeout)
        return None if taken is None else taken[0]

    def recv_delivery(self, timeout: float | None = None) -> Delivery | None:
        """Like `recv`, with the request's sender, sequence number and attempt."""
        taken = self._next(timeout)
        if taken is None:
            return None
        request, envelope = taken
        return Delivery(request, envelope.session.hex(), envelope.sequence, envelope.attempt)

    def _next(self, timeout: float | None) -> tuple[EngineRequest, Envelope] | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        socket = self._socket
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
            # The sender's identity (ROUTER's own frame) and the envelope are a few bytes each:
            # copied, cheaper than frames.
            peer = socket.recv()
            envelope = None
            counts = self._counts
            counts.messages += 1
            more = bool(socket.getsockopt(zmq.RCVMORE))
            if more:
                head = socket.recv()
                counts.frames += 1
                counts.bytes += len(head)
                envelope = Envelope.unpack(head)
                more = bool(socket.getsockopt(zmq.RCVMORE))
            if envelope is None:
                self._drain(more)
                self._reject(DecodeError("message has no mmproc delivery envelope"))
                continue
            ledger = self._ledger
            now = time.monotonic()
            seen = ledger.seen(envelope)
            if seen is not None:
                # Delivered before: the sender re-sent it, its acknowledgement may be what was
                # lost. One not acknowledged yet (the engine's ack is pending) is left unanswered.
                self._drain(more)
                ledger.heard_again(envelope, now)
                self.duplicates += 1
                if seen:
                    self._reply(peer, pack_ack(envelope.session, envelope.sequence))
                continue
            if not ledger.admits(envelope, now):
                # Every record belongs to a sender that may still send again: forgetting one
                # could hand the engine a request twice. Unanswered, this one is sent again.
                self._drain(more)
                self._turn_away()
                continue
            try:
                if not more:
                    raise DecodeError("message has a delivery envelope but no request frames")
                frames = self._rest_of_message(socket.recv(copy=False))
                request, keys = decode_request_keys(frames, self._limits, self._items)
            except MissingItemsError as exc:
                # Not malformed: the sender's guess of what is kept here was wrong (or this is
                # another receiver, or a new process); it sends the request again in full.
                counts.missing_items += 1
                logger.debug("mmproc receiver %s: %s", self._address, exc)
                self._reply(peer, pack_missing(envelope.session, envelope.sequence, str(exc)))
                continue
            except DecodeError as exc:
                self._reply(peer, pack_refusal(envelope.session, envelope.sequence, str(exc)))
                self._reject(exc)
                continue
            held = self._keep(request, keys)
            ledger.delivered(envelope, self._auto_ack, now)
            if self._auto_ack:
                self._reply(peer, pack_ack(envelope.session, envelope.sequence, held))
            else:
                self._unacked[request] = (peer, envelope, keys)
            self.received += 1
            return request, envelope

    def _keep(self, request: EngineRequest, keys: list[bytes | None]) -> list[bool]:
        """Keep the items ``request`` brought in full; per feature, whether its item is kept
        now. ``keys`` has the keys of those that came by reference, and gets the others'."""
        counts = self._counts
        features = request.features
        references = len(keys) - keys.count(None)
        counts.items_by_reference += references
        counts.items_in_full += len(features) - references
        items = self._items
        if not features or not items.max_bytes:
            return []
        for position, feature in enumerate(features):
            if keys[position] is None:
                size = item_nbytes(feature)
                if size >= MIN_ITEM_BYTES:
                    key = keys[position] = item_key(feature)
                    items.keep(key, feature, size)
        # After every item is stored: one stored late may have pushed out one filled in earlier.
        return [key is not None and key in items for key in keys]

    def ack(self, request: EngineRequest | Delivery) -> None:
        """Acknowledge a request handed out by a receiver with ``auto_ack=False``: the engine has
        taken it, its sender may forget it. Idempotent; call from the thread that reads."""
        if isinstance(request, Delivery):
            request = request.request
        entry = self._unacked.pop(request, None)
        if entry is None or self._closed:
            return
        peer, envelope, keys = entry
        self._ledger.acknowledged(envelope)
        items = self._items
        held = [key is not None and key in items for key in keys]
        self._reply(peer, pack_ack(envelope.session, envelope.sequence, held))

    def _reply(self, peer: bytes, payload: bytes) -> None:
        try:
            # A ROUTER drops a reply for a peer that is gone or whose queue is full, and never
            # blocks; a lost acknowledgement only makes the sender re-send.
            socket = self._socket
            socket.send(peer, zmq.SNDMORE | zmq.NOBLOCK)
            socket.send(payload, zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            logger.debug("mmproc receiver %s could not reply: %s", self._address, exc)

    def _drain(self, more: bool) -> None:
        counts = self._counts
        while more:
            frame = self._socket.recv(copy=False)
            counts.frames += 1
            counts.bytes += len(frame)
            more = frame.more

    def _rest_of_message(self, first: zmq.Frame) -> Sequence[zmq.Frame]:
        """Collect the parts of one multipart message, dropping (but draining) one over the
        limits so that neither a frame count nor a byte total can grow without bound here."""
        limits = self._limits
        frames = [first]
        total = len(first)
        fault: str | None = None
        more = first.more  # set by recv(copy=False): cheaper than asking the socket
        counts = self._counts
        counts.frames += 1
        counts.bytes += total
        while more:
            # The rest of a multipart message is already here: ZMQ delivers it atomically.
            frame = self._socket.recv(copy=False)
            more = frame.more
            counts.frames += 1
            counts.bytes += len(frame)
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

    def _turn_away(self) -> None:
        self.turned_away += 1
        count = self.turned_away
        if count <= _LOG_FIRST or count % _LOG_EVERY == 0:
            logger.warning(
                "mmproc receiver %s turned away a request from a new sender (%d so far): its "
                "records of %d senders all belong to senders that may still send again "
                "(mmproc.wire.delivery.DEDUP_HOLD)",
                self._address,
                count,
                len(self._ledger.sessions),
            )

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
        thread that reads, after iteration has ended. Tensors already decoded stay valid;
        requests not acknowledged yet will be re-sent by their senders."""
        if self._closed:
            return
        self._stop.set()
        self._unacked.clear()
        self._items.clear()
        self._shutdown(1.0)
