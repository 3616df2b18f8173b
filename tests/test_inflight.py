"""mmproc.inflight: one computation per key, waiters woken when it ends."""

from __future__ import annotations

import asyncio
import threading

from mmproc.inflight import InFlight


def test_nothing_claimed_means_no_wait() -> None:
    flight = InFlight()
    assert flight.wait(["a", "b"]) is False
    assert asyncio.run(flight.wait_async(["a"])) is False
    assert (len(flight), flight.waiting) == (0, 0)


def test_claim_takes_only_free_keys_and_release_frees_them() -> None:
    flight = InFlight()
    first = flight.claim(["a", "b"])
    second = flight.claim(["b", "c"])
    assert (set(first), set(second)) == ({"a", "b"}, {"c"})
    assert len(flight) == 3
    flight.release(first)
    flight.release(second)
    flight.release(first)  # twice: harmless
    assert len(flight) == 0
    assert set(flight.claim(["a"])) == {"a"}


def test_a_stale_release_leaves_another_requests_claim_alone() -> None:
    flight = InFlight()
    old = flight.claim(["img"])
    flight.release(old)
    new = flight.claim(["img"])  # another request claims the key again
    flight.release(old)  # the first one's late, second release
    assert len(flight) == 1  # the new claim stands...
    waited = threading.Thread(target=flight.wait, args=(["img"],))
    waited.start()
    waited.join(0.05)
    assert waited.is_alive()  # ...and is still waited for
    flight.release(new)
    waited.join(10)
    assert not waited.is_alive() and len(flight) == 0


def test_waiters_wake_when_the_owner_releases() -> None:
    flight = InFlight()
    owned = flight.claim(["img"])
    waited: list[bool] = []
    threads = [
        threading.Thread(target=lambda: waited.append(flight.wait(["img", "other"])))
        for _ in range(3)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(0.05)
        assert thread.is_alive()  # held while the key is claimed
    assert flight.waiting == 3
    flight.release(owned)
    for thread in threads:
        thread.join(10)
        assert not thread.is_alive()
    assert waited == [True, True, True]
    assert flight.waiting == 0


def test_async_waiters_hold_no_thread_and_wake_on_release() -> None:
    flight = InFlight()
    owned = flight.claim(["img"])

    async def main() -> list[bool]:
        waiters = [asyncio.ensure_future(flight.wait_async(["img"])) for _ in range(50)]
        await asyncio.sleep(0.05)
        assert not any(w.done() for w in waiters)
        assert flight.waiting == 50
        # released from another thread, as a worker does
        threading.Thread(target=flight.release, args=(owned,)).start()
        return await asyncio.wait_for(asyncio.gather(*waiters), timeout=10)

    assert asyncio.run(main()) == [True] * 50
    assert flight.waiting == 0


def test_a_cancelled_async_waiter_leaves_the_others_waiting() -> None:
    flight = InFlight()
    owned = flight.claim(["img"])
    sync_result: list[bool] = []
    sync_waiter = threading.Thread(target=lambda: sync_result.append(flight.wait(["img"])))
    sync_waiter.start()

    async def main() -> list[bool]:
        leaving = asyncio.ensure_future(flight.wait_async(["img"]))
        staying = asyncio.ensure_future(flight.wait_async(["img"]))
        await asyncio.sleep(0.05)
        leaving.cancel()  # its client went away
        await asyncio.sleep(0.05)
        assert leaving.cancelled() and not staying.done()
        threading.Thread(target=flight.release, args=(owned,)).start()
        return [await asyncio.wait_for(staying, timeout=10)]

    assert asyncio.run(main()) == [True]
    sync_waiter.join(10)
    assert sync_result == [True]
    assert flight.waiting == 0
