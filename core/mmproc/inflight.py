"""Single flight for cache misses: a request that misses an item another request is computing
right now waits for that result instead of computing the item again.

Who waits for whom: a request *claims* the items it is about to compute when it reaches a worker,
and *releases* them once their outputs are in the cache (or the computation failed). A request
that finds one of its items claimed before it goes to a worker waits for the release, then looks
the item up again. Requests that were already past their wait when the claim was made compute the
item too (at most one per worker, since a worker looks the cache up again before claiming), and so
does a waiter whose item the cache did not keep: single flight covers the requests that arrive
while an item is being computed, which is when duplicates pile up (a burst of requests carrying
one popular image).

No deadlock: requests wait before reaching a worker, never on one (a request made from inside a
worker's own call skips the wait), and never while they own claims. Claims are made and released
within one worker call, in a ``finally``. No head-of-line blocking: async requests wait on the
event loop (`wait_async`), holding no thread. A waiter whose owner failed, or whose result did not
fit the cache, computes the item itself. A waiter given the item encoded decodes it only then.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterable, Mapping
from concurrent.futures import CancelledError, Future

__all__ = ["InFlight"]


class InFlight:
    """The cache keys being computed right now, each with a future completed on release."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._futures: dict[str, Future[None]] = {}
        self._waiting = 0

    def __len__(self) -> int:
        """Keys claimed right now."""
        with self._lock:
            return len(self._futures)

    @property
    def waiting(self) -> int:
        """Requests waiting for a release right now."""
        with self._lock:
            return self._waiting

    def claimed(self, keys: Iterable[str]) -> set[str]:
        """Those of ``keys`` claimed right now (a request about to wait for them need not
        decode their media: see ``Processor._prepare``)."""
        with self._lock:
            return {key for key in keys if key in self._futures}

    def _pending(self, keys: Iterable[str]) -> list[Future[None]]:
        with self._lock:
            futures = [f for key in keys if (f := self._futures.get(key)) is not None]
            if futures:
                self._waiting += 1
            return futures

    def _done_waiting(self) -> None:
        with self._lock:
            self._waiting -= 1

    def wait(self, keys: Iterable[str]) -> bool:
        """Block until none of ``keys`` is claimed; whether any was. Never call it while owning
        claims, nor on a worker thread (see the module docs)."""
        futures = self._pending(keys)
        if not futures:
            return False
        try:
            for future in futures:
                try:
                    future.result()
                except CancelledError:  # not expected (see wait_async); a release all the same
                    pass
        finally:
            self._done_waiting()
        return True

    async def wait_async(self, keys: Iterable[str]) -> bool:
        """`wait`, on the event loop: no thread is held while waiting."""
        futures = self._pending(keys)
        if not futures:
            return False
        try:
            for future in futures:
                # shield: a waiter cancelled (its client went away) must not cancel the shared
                # future, which would fail every other request waiting for the same item.
                await asyncio.shield(asyncio.wrap_future(future))
        finally:
            self._done_waiting()
        return True

    def claim(self, keys: Iterable[str]) -> dict[str, Future[None]]:
        """Take the claim on those ``keys`` nobody has claimed. Returns the claims now owned (key
        to claim), which the owner must `release`, in a ``finally``."""
        claimed: dict[str, Future[None]] = {}
        with self._lock:
            for key in keys:
                if key not in self._futures:
                    self._futures[key] = claimed[key] = Future()
        return claimed

    def release(self, claims: Mapping[str, Future[None]]) -> None:
        """End ``claims`` (as `claim` returned them), waking whoever waits for them. Only the
        caller's own claims end: a key released already, and claimed again since by another
        request, keeps that request's claim. Releasing twice is harmless."""
        with self._lock:
            for key, claim in claims.items():
                if self._futures.get(key) is claim:
                    del self._futures[key]
        for claim in claims.values():
            if not claim.done():
                claim.set_result(None)
