"""mmproc.inflight: one computation per key, waiters woken when it ends."""

from __future__ import annotations

import threading

from mmproc.inflight import InFlight


def test_nothing_in_flight_means_no_wait() -> None:
    flight = InFlight()
    assert flight.wait(["a", "b"]) is False
    assert len(flight) == 0


def test_claim_takes_only_free_keys_and_release_frees_them() -> None:
    flight = InFlight()
    assert flight.claim(["a", "b"]) == ["a", "b"]
    assert flight.claim(["b", "c"]) == ["c"]
    assert len(flight) == 3
    flight.release(["a", "b", "c"])
    flight.release(["a", "never-claimed"])  # idempotent, unknown keys ignored
    assert len(flight) == 0
    assert flight.claim(["a"]) == ["a"]


def test_waiters_wake_when_the_owner_releases() -> None:
    flight = InFlight()
    owned = flight.claim(["img"])
    started, waited = threading.Event(), []

    def waiter() -> None:
        started.set()
        waited.append(flight.wait(["img", "other"]))

    threads = [threading.Thread(target=waiter) for _ in range(3)]
    for thread in threads:
        thread.start()
    assert started.wait(10)
    for thread in threads:
        thread.join(0.05)
        assert thread.is_alive()  # held while the key is in flight
    flight.release(owned)
    for thread in threads:
        thread.join(10)
        assert not thread.is_alive()
    assert waited == [True, True, True]
