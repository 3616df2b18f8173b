"""Single flight for cache misses: one computation per item, however many requests carry it.

When several requests miss the same item at once (a popular image, a shared system image), the
first one to reach a worker computes it and the others wait for that result in the cache instead
of computing it again.

Deadlock-free by construction: requests wait only while they are being prepared (on the caller's
or the prepare pool's thread), never on a worker, and never while they own a key; owners claim
keys on a worker and release them in a ``finally`` on that same worker call, whatever happens.
A waiter whose owner failed, or whose result did not reach the cache, simply computes the item
itself.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

__all__ = ["InFlight"]


class InFlight:
    """The cache keys being computed right now, each with an event set when it is done."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._events: dict[str, threading.Event] = {}

    def __len__(self) -> int:
        with self._lock:
            return len(self._events)

    def wait(self, keys: Iterable[str]) -> bool:
        """Wait until none of ``keys`` is being computed; whether there was anything to wait for.

        Never call this while owning keys (see `claim`): two requests waiting for each other's
        keys would wait forever."""
        with self._lock:
            events = [event for key in keys if (event := self._events.get(key)) is not None]
        for event in events:
            event.wait()
        return bool(events)

    def claim(self, keys: Iterable[str]) -> list[str]:
        """Take ownership of those ``keys`` nobody is computing; the keys now owned. Whoever
        claims must `release` them, in a ``finally``."""
        claimed = []
        with self._lock:
            for key in keys:
                if key not in self._events:
                    self._events[key] = threading.Event()
                    claimed.append(key)
        return claimed

    def release(self, keys: Iterable[str]) -> None:
        """Mark ``keys`` (owned by the caller) done, waking whoever waits for them."""
        with self._lock:
            events = [self._events.pop(key, None) for key in keys]
        for event in events:
            if event is not None:
                event.set()
