"""Delivery bookkeeping for the transport: what a sender still owes, what a receiver has taken.

The sender numbers its messages (a random 16-byte *session* per sender, then a sequence number
from 0) and puts a small envelope frame in front of each: session, sequence, the attempt number,
and its *base* -- the lowest sequence number it has not settled yet (every lower one has been
acknowledged or given up on). The receiver answers each message it takes with an acknowledgement
naming session and sequence, and each one it refuses (a malformed request) with a refusal that
says why. The sender keeps every request until it is settled: acknowledged, refused, or not
acknowledged after ``max_attempts`` sends ``ack_timeout`` apart (each re-send carries the same
session and sequence, and a higher attempt number).

A receiver remembers, per session, which sequence numbers at or above the sender's base it has
delivered, and drops a message it has delivered before (acknowledging it again when it had been
acknowledged, since the first acknowledgement may be what was lost). Below the base nothing needs
remembering: the sender is done with those. That memory is bounded (`DEDUP_ENTRIES`), and it is a
process's memory: a new receiver process starts with none.

This module holds the formats and both ledgers, and knows nothing of sockets.
"""

from __future__ import annotations

import os
import struct
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Final, NamedTuple

from mmproc.wire.codec import Frame
from mmproc.wire.schema import EngineRequest

__all__ = ["DEDUP_ENTRIES", "Delivery", "DeliveryFailure"]

DEDUP_ENTRIES: Final = 1 << 16
"""Most (session, sequence) entries a receiver remembers over all senders; past it the least
recently heard-from sender's entries go first. A healthy sender needs about as many entries as it
has requests in flight (its ``window`` at most)."""

_MAX_SESSIONS: Final = 4096

# --- formats -------------------------------------------------------------------------------------

_ENVELOPE: Final = struct.Struct(">4s16sQQI")  # magic, session, sequence, base, attempt
_ENVELOPE_MAGIC: Final = b"MMD1"
_REPLY: Final = struct.Struct(">4s16sQ")  # magic, session, sequence (+ a reason for refusals)
_ACK_MAGIC: Final = b"MMA1"
_REFUSAL_MAGIC: Final = b"MMR1"
_MAX_REASON: Final = 1024


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


def pack_ack(session: bytes, sequence: int) -> bytes:
    """Internal: the reply saying the request was handed to the engine."""
    return _REPLY.pack(_ACK_MAGIC, session, sequence)


def pack_refusal(session: bytes, sequence: int, reason: str) -> bytes:
    """Internal: the reply saying the request was refused, and why."""
    text = reason.encode("utf-8", "replace")[:_MAX_REASON]
    return _REPLY.pack(_REFUSAL_MAGIC, session, sequence) + text


def unpack_reply(frame: Any) -> tuple[bool, bytes, int, str] | None:
    """Internal: (acknowledged, session, sequence, reason) of a reply, or None if it is none."""
    data = bytes(frame)
    if len(data) < _REPLY.size or len(data) > _REPLY.size + _MAX_REASON:
        return None
    magic, session, sequence = _REPLY.unpack_from(data)
    if magic == _ACK_MAGIC and len(data) == _REPLY.size:
        return True, session, sequence, ""
    if magic == _REFUSAL_MAGIC:
        return False, session, sequence, data[_REPLY.size :].decode("utf-8", "replace")
    return None


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
    `mmproc.wire.transport`)."""


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


# --- the sender's ledger -------------------------------------------------------------------------


@dataclass(slots=True)
class Outstanding:
    """Internal: one unsettled request: its frames (kept for re-sending) and when to act."""

    sequence: int
    request_id: str
    frames: list[Frame]
    attempt: int
    due: float


class SenderLedger:
    """Internal: the requests a sender has not settled, in sequence order, and its failures."""

    __slots__ = (
        "ack_timeout",
        "acknowledged",
        "failures",
        "max_attempts",
        "next_due",
        "next_sequence",
        "outstanding",
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

    def settle(self, session: bytes, sequence: int, acknowledged: bool, reason: str) -> None:
        """Apply a reply; replies for other sessions or settled requests are ignored."""
        if session != self.session:
            return
        entry = self.outstanding.pop(sequence, None)
        if entry is None:
            return
        if acknowledged:
            self.acknowledged += 1
        else:
            self.failures.append(DeliveryFailure(entry.request_id, True, reason, entry.attempt))

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
    __slots__ = ("base", "delivered")

    def __init__(self) -> None:
        self.base = 0
        # sequence -> acknowledged yet (a manual acknowledgement may still be pending)
        self.delivered: OrderedDict[int, bool] = OrderedDict()


class ReceiverLedger:
    """Internal: per sender session, which sequence numbers this receiver has delivered."""

    __slots__ = ("entries", "max_entries", "sessions")

    def __init__(self, max_entries: int = DEDUP_ENTRIES) -> None:
        self.sessions: OrderedDict[bytes, _Session] = OrderedDict()
        self.entries = 0
        self.max_entries = max_entries

    def seen(self, envelope: Envelope) -> bool | None:
        """None if the message is new; else whether its earlier delivery was acknowledged
        (False also for a message below the sender's base, which needs no answer)."""
        session = self.sessions.get(envelope.session)
        if session is None:
            session = self.sessions[envelope.session] = _Session()
            if len(self.sessions) > _MAX_SESSIONS:
                _, dropped = self.sessions.popitem(last=False)
                self.entries -= len(dropped.delivered)
        else:
            self.sessions.move_to_end(envelope.session)
        if envelope.base > session.base:
            session.base = envelope.base
            delivered = session.delivered
            while delivered:
                oldest = next(iter(delivered))
                if oldest >= session.base:
                    break
                del delivered[oldest]
                self.entries -= 1
        if envelope.sequence < session.base:
            return False
        return session.delivered.get(envelope.sequence)

    def delivered(self, envelope: Envelope, acknowledged: bool) -> None:
        """Remember that ``envelope``'s request was handed out (and whether it was acked)."""
        session = self.sessions[envelope.session]
        if envelope.sequence not in session.delivered:
            self.entries += 1
        session.delivered[envelope.sequence] = acknowledged
        while self.entries > self.max_entries:
            oldest_session = next(iter(self.sessions.values()))
            if oldest_session.delivered:
                oldest_session.delivered.popitem(last=False)
                self.entries -= 1
            else:
                self.sessions.popitem(last=False)

    def acknowledged(self, envelope: Envelope) -> None:
        """Mark a delivered request as acknowledged."""
        session = self.sessions.get(envelope.session)
        if session is not None and envelope.sequence in session.delivered:
            session.delivered[envelope.sequence] = True
