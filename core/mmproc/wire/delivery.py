"""Delivery bookkeeping for the transport: what a sender still owes, what a receiver has taken.

The sender numbers its messages (a random 16-byte *session* per sender, then a sequence number
from 0) and puts a small envelope frame in front of each: session, sequence, the attempt number,
and its *base* -- the lowest sequence number it has not settled yet (every lower one has been
acknowledged or given up on). The receiver answers each message it takes with an acknowledgement
naming session and sequence (and which of the request's items it holds now: a bitmap over its
features, `mmproc.wire.items`), and each one it refuses (a malformed request) with a refusal that
says why. A request referring to items the receiver does not hold gets a third reply, *missing
items*: no refusal, since the same request with its items in full is fine, and the sender sends
it so at once. The sender keeps every request until it is settled: acknowledged, refused, or not
acknowledged after ``max_attempts`` sends ``ack_timeout`` apart (each re-send carries the same
session and sequence, and a higher attempt number; the send in full after missing items is one
more, beyond ``max_attempts`` if need be, so that a wrong guess never costs a request).

A receiver remembers, per session, which sequence numbers at or above the sender's base it has
delivered, and drops a message it has delivered before (acknowledging it again when it had been
acknowledged, since the first acknowledgement may be what was lost). Below the base nothing needs
remembering: the sender is done with those. It is a process's memory: a new receiver process
starts with none.

That memory is the receiver's to defend, since anyone who can connect can send envelopes:

* Only a request that decodes is recorded (and only then does its envelope move its session's
  base): a malformed message, whatever its envelope says, changes no record and makes none.
* It is bounded: `DEDUP_SENDERS` sessions, `DEDUP_ENTRIES_PER_SENDER` entries per session and
  `DEDUP_ENTRIES` in all. A `RequestSender`'s ``window`` is at most `DEDUP_ENTRIES_PER_SENDER`,
  so only a peer that breaks the window fills its own record (and then forgets its own oldest
  entries).
* A full table makes room only by forgetting a sender that cannot send again: the least
  recently heard-from session whose deliveries are all acknowledged and that has been silent
  for `DEDUP_HOLD` seconds (a `RequestSender` stops re-sending after ``ack_timeout *
  max_attempts``, which it keeps under `DEDUP_HOLD`). A live sender's record is never
  forgotten. When no record can go, a request from a new sender (or one that needs a new
  entry) is turned away unanswered, before it is decoded; its sender sends it again after
  ``ack_timeout`` and reports it (`DeliveryFailure`) if it is turned away every time. So a
  flood of valid-looking requests from many new sessions can delay new senders for up to
  `DEDUP_HOLD`, never make a request reach the engine twice.

This module holds the formats and both ledgers, and knows nothing of sockets.
"""

from __future__ import annotations

import os
import struct
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final, NamedTuple

from mmproc.wire.codec import Frame
from mmproc.wire.schema import EngineRequest

__all__ = [
    "DEDUP_ENTRIES",
    "DEDUP_ENTRIES_PER_SENDER",
    "DEDUP_HOLD",
    "DEDUP_SENDERS",
    "Delivery",
    "DeliveryFailure",
]

DEDUP_ENTRIES: Final = 1 << 16
"""Most (session, sequence) entries a receiver remembers over all senders. A healthy sender
needs about as many entries as it has requests in flight (its ``window`` at most)."""

DEDUP_SENDERS: Final = 4096
"""Most senders (sessions) a receiver keeps a record for."""

DEDUP_ENTRIES_PER_SENDER: Final = 4096
"""Most entries one sender's record holds; a `RequestSender`'s ``window`` may not exceed it."""

DEDUP_HOLD: Final = 300.0
"""Seconds a receiver keeps the record of a sender it has stopped hearing from before it may
forget it for a new sender; a `RequestSender`'s ``ack_timeout * max_attempts`` (the longest it
re-sends a request for) may not exceed it."""

# --- formats -------------------------------------------------------------------------------------

_ENVELOPE: Final = struct.Struct(">4s16sQQI")  # magic, session, sequence, base, attempt
_ENVELOPE_MAGIC: Final = b"MMD1"
# magic, session, sequence; then a reason (refusals, missing items) or a bitmap of the items held
# (acknowledgements: bit i of byte i // 8 for feature i, from the least significant bit)
_REPLY: Final = struct.Struct(">4s16sQ")
_ACK_MAGIC: Final = b"MMA1"
_REFUSAL_MAGIC: Final = b"MMR1"
_MISSING_MAGIC: Final = b"MMM1"
_MAX_REASON: Final = 1024
MAX_HELD_ITEMS: Final = 8 * _MAX_REASON
"""Most features of one request an acknowledgement says are held (the rest count as not)."""

ACK: Final = "ack"
REFUSED: Final = "refused"
MISSING: Final = "missing"


class Envelope(NamedTuple):
    """Internal: the delivery frame in front of every request."""

    session: bytes
    sequence: int
    base: int
    attempt: int

    def pack(self) -> bytes:
        return _ENVELOPE.pack(_ENVELOPE_MAGIC, self.session, self.sequence, self.base, self.attempt)

    @classmethod
    def unpack(cls, frame: bytes) -> Envelope | None:
        """The envelope in ``frame``, or None when it is not one."""
        if len(frame) != _ENVELOPE.size:
            return None
        magic, session, sequence, base, attempt = _ENVELOPE.unpack(frame)
        if magic != _ENVELOPE_MAGIC or attempt < 1:
            return None
        return cls(session, sequence, base, attempt)


def pack_ack(session: bytes, sequence: int, held: Sequence[bool] = ()) -> bytes:
    """Internal: the reply saying the request was handed to the engine; ``held`` says, per
    feature, whether the receiver holds its item now (trailing False need no bytes)."""
    bitmap = bytearray((min(len(held), MAX_HELD_ITEMS) + 7) // 8)
    for position, kept in enumerate(held[:MAX_HELD_ITEMS]):
        if kept:
            bitmap[position >> 3] |= 1 << (position & 7)
    return _REPLY.pack(_ACK_MAGIC, session, sequence) + bytes(bitmap).rstrip(b"\0")


def pack_refusal(session: bytes, sequence: int, reason: str) -> bytes:
    """Internal: the reply saying the request was refused, and why."""
    text = reason.encode("utf-8", "replace")[:_MAX_REASON]
    return _REPLY.pack(_REFUSAL_MAGIC, session, sequence) + text


def pack_missing(session: bytes, sequence: int, reason: str) -> bytes:
    """Internal: the reply saying the request refers to items the receiver does not hold."""
    text = reason.encode("utf-8", "replace")[:_MAX_REASON]
    return _REPLY.pack(_MISSING_MAGIC, session, sequence) + text


class Reply(NamedTuple):
    """Internal: one reply from a receiver."""

    kind: str
    """`ACK`, `REFUSED` or `MISSING`."""
    session: bytes
    sequence: int
    reason: str = ""
    """Why, for a refusal or missing items."""
    held: bytes = b""
    """For an acknowledgement: the bitmap of the request's features whose items are held."""

    def holds(self, position: int) -> bool:
        """Whether the acknowledgement says feature ``position``'s item is held."""
        byte = position >> 3
        return byte < len(self.held) and bool(self.held[byte] >> (position & 7) & 1)


_REPLY_KINDS: Final = {_ACK_MAGIC: ACK, _REFUSAL_MAGIC: REFUSED, _MISSING_MAGIC: MISSING}


def unpack_reply(frame: Any) -> Reply | None:
    """Internal: the reply in ``frame``, or None if it is none."""
    data = bytes(frame)
    if len(data) < _REPLY.size or len(data) > _REPLY.size + _MAX_REASON:
        return None
    magic, session, sequence = _REPLY.unpack_from(data)
    kind = _REPLY_KINDS.get(magic)
    if kind is None:
        return None
    rest = data[_REPLY.size :]
    if kind is ACK:
        return Reply(ACK, session, sequence, "", rest)
    return Reply(kind, session, sequence, rest.decode("utf-8", "replace"))


# --- what the two ends see -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True, eq=False)
class Delivery:
    """One request as a receiver took it, with where it came from (`RequestReceiver.recv_delivery`).

    ``eq=False``: it holds a request, which holds tensors.
    """

    request: EngineRequest
    """The request."""
    sender: str
    """The sending `RequestSender`'s session, in hex (one per sender object)."""
    sequence: int
    """The sender's number for this request (from 0, in the order they were sent)."""
    attempt: int
    """1 for a first send; more when the sender sent it again for want of an acknowledgement, so
    that a receiver process before this one may have taken it already (see the guarantee in
    `mmproc.wire.transport`), or in full after this receiver lacked an item it referred to."""


@dataclass(frozen=True, slots=True)
class DeliveryFailure:
    """A request the sender gave up on (`RequestSender.take_failures`)."""

    request_id: str
    """The request's id."""
    refused: bool
    """True: a receiver refused it (malformed; it never reached an engine, and re-sending the
    same request would be refused again). False: no acknowledgement came after every attempt;
    the engine may or may not have taken it."""
    reason: str
    """Why, in words: the receiver's error, or how long and how often it was sent."""
    attempts: int
    """How many times it was sent."""
    missing: bool = False
    """The receiver no longer holds items the request holds stand-ins of
    (`mmproc.wire.items.is_stand_in`), so it can be sent neither by reference nor in full: its
    caller must make those items again and send it anew (``refused`` is False)."""


# --- the sender's ledger -------------------------------------------------------------------------


@dataclass(slots=True)
class Outstanding:
    """Internal: one unsettled request: its frames (kept for re-sending) and when to act."""

    sequence: int
    request_id: str
    frames: list[Frame]
    attempt: int
    due: float
    request: EngineRequest | None = None
    """The request, while its frames refer to items (to send it again in full)."""
    features: int = 0
    """Features of the request."""
    references: int = 0
    """Features its frames send by reference (the others go in full)."""
    keys: list[bytes | None] | None = None
    """Per feature, its item key (None: not keyed); None when the sender keeps no items."""
    sizes: list[int] | None = None
    """Per feature, its tensor bytes (with ``keys``)."""


class SenderLedger:
    """Internal: the requests a sender has not settled, in sequence order, and its failures."""

    __slots__ = (
        "ack_timeout",
        "acknowledged",
        "failures",
        "given_up",
        "max_attempts",
        "next_due",
        "next_sequence",
        "outstanding",
        "refused",
        "resent",
        "session",
    )

    def __init__(self, ack_timeout: float, max_attempts: int) -> None:
        self.session = os.urandom(16)
        self.ack_timeout = ack_timeout
        self.max_attempts = max_attempts
        self.next_sequence = 0
        self.outstanding: OrderedDict[int, Outstanding] = OrderedDict()
        self.failures: list[DeliveryFailure] = []
        self.next_due = float("inf")
        self.acknowledged = 0
        self.resent = 0
        self.refused = 0
        self.given_up = 0

    @property
    def base(self) -> int:
        """The lowest sequence number not settled (the next one when all are)."""
        for sequence in self.outstanding:
            return sequence
        return self.next_sequence

    def span(self) -> int:
        """Sequence numbers from the base to the next one: what the window bounds."""
        return self.next_sequence - self.base

    def envelope(self, entry: Outstanding) -> bytes:
        """The envelope frame for the next send of ``entry``."""
        return _ENVELOPE.pack(
            _ENVELOPE_MAGIC, self.session, entry.sequence, self.base, entry.attempt
        )

    def add(self, request_id: str, frames: list[Frame]) -> Outstanding:
        """Record a new request (not sent yet); its first attempt is due to be acknowledged
        ``ack_timeout`` from now."""
        due = time.monotonic() + self.ack_timeout
        entry = Outstanding(self.next_sequence, request_id, frames, 1, due)
        self.outstanding[entry.sequence] = entry
        self.next_sequence += 1
        self.next_due = min(self.next_due, due)
        return entry

    def forget(self, entry: Outstanding) -> None:
        """Drop a request that was never sent (its send failed)."""
        self.outstanding.pop(entry.sequence, None)
        if entry.sequence == self.next_sequence - 1:
            self.next_sequence -= 1

    def entry_for(self, reply: Reply) -> Outstanding | None:
        """The unsettled request ``reply`` answers; None for other sessions or settled ones."""
        if reply.session != self.session:
            return None
        return self.outstanding.get(reply.sequence)

    def settle(
        self, entry: Outstanding, acknowledged: bool, reason: str, *, missing: bool = False
    ) -> None:
        """Settle ``entry``: acknowledged, or refused for ``reason`` (``missing``: not refused,
        but the receiver lacks items the sender has only stand-ins of)."""
        if self.outstanding.pop(entry.sequence, None) is None:
            return
        if acknowledged:
            self.acknowledged += 1
        else:
            self.refused += 1
            self.failures.append(
                DeliveryFailure(entry.request_id, not missing, reason, entry.attempt, missing)
            )

    def overdue(self, now: float) -> list[Outstanding]:
        """Requests whose last attempt went unacknowledged for ``ack_timeout``: the ones left
        with attempts are returned (to be sent again), the others become failures."""
        if now < self.next_due:
            return []
        again = []
        next_due = float("inf")
        for entry in list(self.outstanding.values()):
            if entry.due > now:
                next_due = min(next_due, entry.due)
            elif entry.attempt >= self.max_attempts:
                del self.outstanding[entry.sequence]
                self.given_up += 1
                self.failures.append(
                    DeliveryFailure(
                        entry.request_id,
                        False,
                        f"no acknowledgement after {entry.attempt} attempt(s), "
                        f"{self.ack_timeout} s apart",
                        entry.attempt,
                    )
                )
            else:
                again.append(entry)
        self.next_due = next_due
        return again

    def resending(self, entry: Outstanding, now: float) -> None:
        """Count the next attempt of ``entry``, about to be sent at ``now``."""
        entry.attempt += 1
        entry.due = now + self.ack_timeout
        self.next_due = min(self.next_due, entry.due)
        self.resent += 1


# --- the receiver's ledger -----------------------------------------------------------------------


class _Session:
    __slots__ = ("base", "delivered", "heard", "unacknowledged")

    def __init__(self) -> None:
        self.base = 0
        # sequence -> acknowledged yet (a manual acknowledgement may still be pending)
        self.delivered: OrderedDict[int, bool] = OrderedDict()
        self.heard = 0.0  # time.monotonic() of the last request or copy taken from it
        self.unacknowledged = 0  # entries of `delivered` that are False


class ReceiverLedger:
    """Internal: per sender session, which sequence numbers this receiver has delivered, within
    the bounds and by the eviction rule of the module docstring."""

    __slots__ = ("entries", "hold", "max_entries", "max_per_session", "max_sessions", "sessions")

    def __init__(
        self,
        max_entries: int = DEDUP_ENTRIES,
        max_sessions: int = DEDUP_SENDERS,
        max_per_session: int = DEDUP_ENTRIES_PER_SENDER,
        hold: float = DEDUP_HOLD,
    ) -> None:
        # Least recently heard-from first: every touch moves a session to the end.
        self.sessions: OrderedDict[bytes, _Session] = OrderedDict()
        self.entries = 0
        self.max_entries = max_entries
        self.max_sessions = max_sessions
        self.max_per_session = max_per_session
        self.hold = hold

    def seen(self, envelope: Envelope) -> bool | None:
        """None if the message is new; else whether its earlier delivery was acknowledged
        (False also for a message below the sender's base, which needs no answer). Changes
        nothing: the message has not been checked yet."""
        session = self.sessions.get(envelope.session)
        if session is None:
            return None
        if envelope.sequence < session.base:
            return False
        return session.delivered.get(envelope.sequence)

    def heard_again(self, envelope: Envelope, now: float) -> None:
        """A copy of a delivered request came from a known session: it is alive."""
        session = self.sessions.get(envelope.session)
        if session is not None:
            session.heard = now
            self.sessions.move_to_end(envelope.session)

    def admits(self, envelope: Envelope, now: float) -> bool:
        """Whether `delivered` could record ``envelope``'s request now without forgetting a
        sender that may still send again (see the module docstring)."""
        return self._victims(envelope, now) is not None

    def _victims(self, envelope: Envelope, now: float) -> list[bytes] | None:
        """The sessions to forget to record ``envelope``; None when room cannot be made."""
        session = self.sessions.get(envelope.session)
        if session is not None and (
            envelope.sequence in session.delivered
            or len(session.delivered) >= self.max_per_session  # it recycles its own entries
        ):
            return []
        over_sessions = len(self.sessions) + (session is None) - self.max_sessions
        over_entries = self.entries + 1 - self.max_entries
        victims: list[bytes] = []
        cutoff = now - self.hold
        for key, other in self.sessions.items():
            if over_sessions <= 0 and over_entries <= 0:
                break
            if other.heard > cutoff:
                break  # every later one was heard from later still
            if other.unacknowledged or key == envelope.session:
                continue
            victims.append(key)
            over_sessions -= 1
            over_entries -= len(other.delivered)
        if over_sessions > 0 or over_entries > 0:
            return None
        return victims

    def delivered(self, envelope: Envelope, acknowledged: bool, now: float) -> None:
        """Remember that ``envelope``'s request (decoded, and admitted by `admits`) was handed
        out, and whether it was acknowledged; apply the sender's base."""
        for key in self._victims(envelope, now) or ():
            self.entries -= len(self.sessions.pop(key).delivered)
        session = self.sessions.get(envelope.session)
        if session is None:
            session = self.sessions[envelope.session] = _Session()
        else:
            self.sessions.move_to_end(envelope.session)
        session.heard = now
        delivered = session.delivered
        if envelope.base > session.base:
            session.base = envelope.base
            while delivered:
                oldest = next(iter(delivered))
                if oldest >= session.base:
                    break
                self._drop(session, delivered.pop(oldest))
        if envelope.sequence < session.base:
            return  # the sender says it is settled: copies of it are dropped anyway
        if envelope.sequence in delivered:
            if not delivered[envelope.sequence] and acknowledged:
                session.unacknowledged -= 1
            delivered[envelope.sequence] = acknowledged or delivered[envelope.sequence]
            return
        if len(delivered) >= self.max_per_session:  # only a peer breaking the window gets here
            self._drop(session, delivered.popitem(last=False)[1])
        delivered[envelope.sequence] = acknowledged
        self.entries += 1
        if not acknowledged:
            session.unacknowledged += 1

    def _drop(self, session: _Session, acknowledged: bool) -> None:
        self.entries -= 1
        if not acknowledged:
            session.unacknowledged -= 1

    def acknowledged(self, envelope: Envelope) -> None:
        """Mark a delivered request as acknowledged."""
        session = self.sessions.get(envelope.session)
        if session is not None and session.delivered.get(envelope.sequence) is False:
            session.delivered[envelope.sequence] = True
            session.unacknowledged -= 1
