"""What each end of the wire has done so far: `SenderStats` and `ReceiverStats`.

Snapshots, taken by `RequestSender.stats` and `RequestReceiver.stats`: frozen, every counter
since the endpoint was made, cheap to take (for a ``/metrics`` endpoint). Bytes and frames are
those of whole messages as ZMQ carries them, the delivery envelope included (not the ROUTER's
peer identity); items are media items (features), counted in every message that carried them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

__all__ = ["ReceiverStats", "SenderStats"]


@dataclass(frozen=True, slots=True)
class SenderStats:
    """What a `RequestSender` has sent and what became of it (`RequestSender.stats`)."""

    requests: int
    """Requests accepted by ``send``."""
    messages: int
    """Messages written: every request's first send, and every re-send."""
    frames: int
    """Frames in those messages."""
    bytes: int
    """Bytes in those messages: what crossed the wire."""
    items_in_full: int
    """Media items sent with their tensors, over all messages."""
    items_by_reference: int
    """Media items sent as a reference to what the receiver holds, over all messages."""
    resent: int
    """Re-sends: attempts after a request's first (for want of an acknowledgement, or in full
    after missing items)."""
    resent_in_full: int
    """Re-sends in full because the receiver did not hold an item the request referred to (each
    also counts in ``resent``): what wrong guesses cost."""
    acknowledged: int
    """Requests acknowledged."""
    refused: int
    """Requests refused as malformed, or missing items the sender had only stand-ins of
    (reported by ``take_failures``)."""
    given_up: int
    """Requests not acknowledged after ``max_attempts`` sends (reported by ``take_failures``)."""
    unsettled: int
    """Requests sent and not settled yet."""
    items_held: int
    """Items the sender now takes the receiver to hold (it refers to these)."""
    held_bytes: int
    """Their bytes, within the sender's ``item_cache_bytes``."""

    def as_dict(self) -> dict[str, int]:
        """The counters by name (for a metrics exporter)."""
        return asdict(self)


@dataclass(frozen=True, slots=True)
class ReceiverStats:
    """What a `RequestReceiver` has received and what it did with it (`RequestReceiver.stats`)."""

    received: int
    """Requests decoded and handed out."""
    messages: int
    """Messages read, whatever became of them."""
    frames: int
    """Frames in those messages."""
    bytes: int
    """Bytes in those messages (a message over the limits is counted as far as it was read)."""
    items_in_full: int
    """Media items of handed-out requests that came with their tensors."""
    items_by_reference: int
    """Media items of handed-out requests filled in from what the receiver holds."""
    missing_items: int
    """Requests answered as missing items (they referred to items not held; their senders send
    them again in full)."""
    bad_messages: int
    """Messages refused as malformed or over the limits."""
    duplicates: int
    """Copies of requests already handed out, dropped."""
    turned_away: int
    """Requests left unanswered because every sender record was still needed."""
    items_cached: int
    """Items held now."""
    cached_bytes: int
    """Bytes charged for them, within ``item_cache_bytes``."""
    evictions: int
    """Items dropped to make room for newer ones."""

    def as_dict(self) -> dict[str, int]:
        """The counters by name (for a metrics exporter)."""
        return asdict(self)
