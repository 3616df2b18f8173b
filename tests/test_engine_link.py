"""The native path's link to the engine (`mmproc.serve.engine_link`): one thread sends what the
server hands it and settles each request by the engine's answer. Real sockets, a real
RequestReceiver."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Iterator

import pytest
import torch
from mmproc.serve.engine_link import EngineLacksItems, EngineLink, EngineRefused
from mmproc.wire import EngineRequest, RequestReceiver, WireFeature
from mmproc.wire.items import ITEM_ENTRY_BYTES

# Generous: only reached when something is broken, never a measure of speed.
WAIT = 10.0


def make_request(request_id: str) -> EngineRequest:
    pixels = torch.full((16, 12), len(request_id), dtype=torch.uint8)
    feature = WireFeature("image", 0, f"h-{request_id}", 0, 2, None, {"pixel_values": pixels})
    return EngineRequest(request_id, [1, 2, 3], [feature])


def receive_all(receiver: RequestReceiver, count: int, into: list[str]) -> threading.Thread:
    """A thread taking (and so acknowledging) ``count`` requests, their ids put ``into``."""

    def take() -> None:
        deadline = time.monotonic() + WAIT
        while len(into) < count and time.monotonic() < deadline:
            request = receiver.recv(timeout=0.1)
            if request is not None:
                into.append(request.request_id)

    thread = threading.Thread(target=take)
    thread.start()
    return thread


@pytest.fixture
def link(ipc_address: str) -> Iterator[EngineLink]:
    """A link to an engine at ``ipc_address`` (bound by the test, when it binds one)."""
    made = EngineLink(ipc_address)
    try:
        yield made
    finally:
        made.close()


def test_concurrent_requests_are_each_answered_once_the_engine_acknowledges_them(
    ipc_address: str, link: EngineLink
) -> None:
    taken: list[str] = []
    with RequestReceiver(ipc_address, bind=True) as receiver:
        ids = [link.new_request_id("chat") for _ in range(40)]
        engine = receive_all(receiver, len(ids), taken)

        async def send_all() -> None:
            await asyncio.gather(*(link.send(make_request(i), timeout=WAIT) for i in ids))

        asyncio.run(send_all())
        engine.join()
    assert sorted(taken) == sorted(ids)
    stats = link.stats  # read before the answers were given: counts every one
    assert stats.acknowledged == len(ids) and stats.requests == len(ids)
    assert stats.unsettled == 0


def test_a_request_waits_for_an_engine_that_binds_later_within_its_timeout(
    ipc_address: str, link: EngineLink
) -> None:
    taken: list[str] = []

    async def send_then_bind() -> None:
        sending = asyncio.ensure_future(link.send(make_request("early"), timeout=WAIT))
        await asyncio.sleep(0.3)  # no engine yet: the link keeps trying
        assert not sending.done()
        with RequestReceiver(ipc_address, bind=True) as receiver:
            engine = receive_all(receiver, 1, taken)
            await sending
            engine.join()

    asyncio.run(send_then_bind())
    assert taken == ["early"]


def test_no_engine_within_the_timeout_is_a_timeout_naming_the_address_and_the_link_goes_on(
    ipc_address: str, link: EngineLink
) -> None:
    with pytest.raises(TimeoutError, match=r"not sent within 0\.3 s: no engine at ipc://"):
        asyncio.run(link.send(make_request("lonely"), timeout=0.3))
    taken: list[str] = []
    with RequestReceiver(ipc_address, bind=True) as receiver:
        engine = receive_all(receiver, 1, taken)
        asyncio.run(link.send(make_request("later"), timeout=WAIT))
        engine.join()
    assert taken == ["later"]  # the one that timed out was never sent


def test_a_request_whose_caller_went_away_before_it_was_sent_is_never_sent(
    ipc_address: str, link: EngineLink
) -> None:
    async def give_up() -> None:
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(link.send(make_request("gone"), timeout=WAIT), 0.2)

    asyncio.run(give_up())
    with RequestReceiver(ipc_address, bind=True) as receiver:
        assert receiver.recv(timeout=1.0) is None


def test_closing_fails_the_requests_in_flight_refuses_new_ones_and_can_be_done_twice(
    ipc_address: str, link: EngineLink
) -> None:
    # An engine that takes requests but never acknowledges them.
    with RequestReceiver(ipc_address, bind=True, auto_ack=False) as receiver:

        async def close_under_a_request() -> None:
            sending = asyncio.ensure_future(link.send(make_request("held"), timeout=WAIT))
            delivery = await asyncio.to_thread(receiver.recv_delivery, WAIT)
            assert delivery is not None
            link.close()
            with pytest.raises(EngineRefused, match="shutting down"):
                await sending
            with pytest.raises(EngineRefused, match="shutting down"):
                await link.send(make_request("after"), timeout=WAIT)

        asyncio.run(close_under_a_request())
        # A second close (the fixture's) closes nothing of anyone else's: files opened since
        # may have the link's old descriptor numbers, as this pipe has.
        numbers = (link._wake_read, link._wake_write)
        read, write = os.pipe()
        for fd, number in zip((read, write), numbers, strict=True):
            os.dup2(fd, number)
        try:
            link.close()
            os.write(numbers[1], b"x")
            assert os.read(numbers[0], 1) == b"x"
        finally:
            for fd in {read, write, *numbers}:
                os.close(fd)


def test_a_request_id_in_flight_twice_is_refused(ipc_address: str, link: EngineLink) -> None:
    with RequestReceiver(ipc_address, bind=True, auto_ack=False) as receiver:

        async def twice() -> None:
            first = asyncio.ensure_future(link.send(make_request("dup"), timeout=WAIT))
            await asyncio.sleep(0)
            with pytest.raises(ValueError, match="in flight already"):
                await link.send(make_request("dup"), timeout=WAIT)
            delivery = await asyncio.to_thread(receiver.recv_delivery, WAIT)
            assert delivery is not None
            receiver.ack(delivery)
            await first

        asyncio.run(twice())


def test_a_repeated_item_goes_by_reference_and_only_the_link_s_thread_reads_the_replies(
    ipc_address: str, link: EngineLink
) -> None:
    taken: list[str] = []
    with RequestReceiver(ipc_address, bind=True) as receiver:
        engine = receive_all(receiver, 3, taken)

        async def the_same_item_three_times() -> None:
            for _ in range(3):
                # Big enough to be kept (mmproc.wire.items.MIN_ITEM_BYTES), the same content.
                pixels = torch.full((64, 128), 7, dtype=torch.uint8)
                feature = WireFeature("image", 0, "h-same", 0, 2, None, {"pixel_values": pixels})
                request = EngineRequest(link.new_request_id("turn"), [1, 2, 3], [feature])
                await link.send(request, timeout=WAIT)

        asyncio.run(the_same_item_three_times())
        engine.join()
    assert len(taken) == 3
    assert link.stats.items_by_reference == 2
    # A watcher of the sender's would take the socket's wake-ups from the link's thread.
    names = [thread.name for thread in threading.enumerate()]
    assert not [name for name in names if name.startswith("mmproc-sender-replies")]


def test_a_request_whose_send_fails_unexpectedly_fails_alone_and_the_next_is_sent(
    ipc_address: str, link: EngineLink, monkeypatch: pytest.MonkeyPatch
) -> None:
    taken: list[str] = []
    send = link.sender.send

    def fails_once(request: EngineRequest, **options: object) -> object:
        if request.request_id == "broken":
            raise OSError("the socket went away")
        return send(request, **options)  # type: ignore[arg-type]

    monkeypatch.setattr(link.sender, "send", fails_once)
    with RequestReceiver(ipc_address, bind=True) as receiver:
        engine = receive_all(receiver, 1, taken)

        async def one_broken_one_fine() -> None:
            # Bounded: a link whose thread died would never answer either.
            with pytest.raises(EngineRefused, match="the socket went away"):
                await asyncio.wait_for(link.send(make_request("broken"), timeout=WAIT), WAIT)
            await asyncio.wait_for(link.send(make_request("fine"), timeout=WAIT), WAIT)

        asyncio.run(one_broken_one_fine())
        engine.join()
    assert taken == ["fine"]


def item_request(link: EngineLink, name: str, *, stand_in: bool = False) -> EngineRequest:
    """A request with item ``name`` (8 KiB of pixels, enough to be kept by the engine), whole
    or as a stand-in (a meta tensor: what a server keeps of an item its engine holds)."""
    if stand_in:
        pixels = torch.empty((64, 128), dtype=torch.uint8, device="meta")
    else:
        pixels = torch.full((64, 128), len(name), dtype=torch.uint8)
    feature = WireFeature("image", 0, f"h-{name}", 0, 2, None, {"pixel_values": pixels})
    return EngineRequest(link.new_request_id(name), [1, 2, 3], [feature])


def test_a_stand_in_the_engine_was_never_known_to_hold_fails_as_lacking_and_is_not_sent(
    ipc_address: str, link: EngineLink
) -> None:
    with RequestReceiver(ipc_address, bind=True) as receiver:

        async def lone_stand_in() -> None:
            request = item_request(link, "never-sent", stand_in=True)
            with pytest.raises(EngineLacksItems, match="h-never-sent"):
                await asyncio.wait_for(link.send(request, timeout=WAIT), WAIT)

        asyncio.run(lone_stand_in())
        assert receiver.recv(timeout=0.2) is None
    assert link.stats.requests == 0


def test_a_stand_in_of_an_item_the_engine_evicted_fails_as_lacking_and_the_link_goes_on(
    ipc_address: str, link: EngineLink
) -> None:
    taken: list[str] = []
    room_for_one = 64 * 128 + ITEM_ENTRY_BYTES
    with RequestReceiver(ipc_address, bind=True, item_cache_bytes=room_for_one) as receiver:
        engine = receive_all(receiver, 3, taken)

        async def evicted_then_whole() -> None:
            for name in ("a", "b"):  # b evicts a
                await asyncio.wait_for(link.send(item_request(link, name), timeout=WAIT), WAIT)
            stand_in = item_request(link, "a", stand_in=True)
            assert link.holds(stand_in) == [True]  # the link's guess, now wrong
            with pytest.raises(EngineLacksItems, match="lacks items") as caught:
                await asyncio.wait_for(link.send(stand_in, timeout=WAIT), WAIT)
            assert not caught.value.refused
            await asyncio.wait_for(link.send(item_request(link, "a"), timeout=WAIT), WAIT)

        asyncio.run(evicted_then_whole())
        engine.join()
    assert [request_id.split("-")[0] for request_id in taken] == ["a", "b", "a"]
