"""Delivery between RequestSender and RequestReceiver: acknowledgements, re-sends, duplicates,
refusals, and a receiver process killed mid-stream. Real sockets, real processes."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from pathlib import Path

import pytest
import torch
import zmq
from mmproc.errors import ConfigurationError
from mmproc.wire import (
    DecodeLimits,
    Delivery,
    DeliveryFailure,
    EngineRequest,
    RequestReceiver,
    RequestSender,
    WireFeature,
    encode_request,
)
from mmproc.wire.delivery import Envelope, unpack_reply

# Generous: only reached when something is broken, never a measure of speed.
WAIT = 10.0


@pytest.fixture
def ipc_address(tmp_path: Path) -> str:
    return f"ipc://{tmp_path}/engine.sock"


def make_request(request_id: str, tokens: int = 4) -> EngineRequest:
    pixels = torch.full((8, 12), len(request_id), dtype=torch.uint8)
    feature = WireFeature("image", 0, "h", 0, 2, None, {"pixel_values": pixels})
    return EngineRequest(request_id, list(range(tokens)), [feature])


def test_every_request_taken_is_acknowledged_and_flush_says_so(ipc_address: str) -> None:
    with RequestReceiver(ipc_address) as receiver, RequestSender(ipc_address) as sender:
        for index in range(20):
            sender.send(make_request(f"r{index}"), timeout=WAIT)
        got = [receiver.recv(timeout=WAIT) for _ in range(20)]
        assert [request.request_id for request in got if request] == [f"r{i}" for i in range(20)]
        assert sender.flush(WAIT)
        assert sender.unacknowledged == [] and sender.acknowledged == 20
        assert sender.take_failures() == [] and sender.resent == 0


def test_flush_waits_for_the_engine_to_take_the_requests(ipc_address: str) -> None:
    with RequestReceiver(ipc_address) as receiver, RequestSender(ipc_address) as sender:
        sender.send(make_request("waiting"), timeout=WAIT)
        assert not sender.flush(timeout=0.2)  # queued at the engine, not taken by it yet
        assert sender.unacknowledged == ["waiting"]
        assert receiver.recv(timeout=WAIT) is not None
        assert sender.flush(WAIT) and sender.unacknowledged == []


def test_an_unacknowledged_request_is_sent_again_and_handed_out_once(ipc_address: str) -> None:
    with (
        RequestReceiver(ipc_address, auto_ack=False) as receiver,
        RequestSender(ipc_address, ack_timeout=0.05, max_attempts=1000) as sender,
    ):
        sender.send(make_request("slow"), timeout=WAIT)
        delivery = receiver.recv_delivery(timeout=WAIT)
        assert isinstance(delivery, Delivery) and delivery.attempt == 1
        # The engine holds on to it without acknowledging: the sender sends it again...
        assert not sender.flush(timeout=0.5)
        assert sender.resent >= 1
        # ...and the receiver drops the copies, leaving them unanswered until the engine acks.
        assert receiver.recv(timeout=0.3) is None
        assert receiver.duplicates >= 1 and receiver.received == 1
        receiver.ack(delivery)
        assert sender.flush(WAIT) and sender.take_failures() == []


def test_a_copy_of_an_acknowledged_request_is_dropped_and_acknowledged_again(
    ipc_address: str,
) -> None:
    context = zmq.Context()
    peer = context.socket(zmq.DEALER)
    try:
        with RequestReceiver(ipc_address, context=context) as receiver:
            peer.connect(ipc_address)
            session = os.urandom(16)
            frames = encode_request(make_request("twice"))
            for attempt in (1, 2):  # as a sender whose first acknowledgement got lost would
                peer.send_multipart([Envelope(session, 0, 0, attempt).pack(), *frames])
            first = receiver.recv_delivery(timeout=WAIT)
            assert first is not None and first.request.request_id == "twice"
            assert first.sender == session.hex() and first.sequence == 0
            assert receiver.recv(timeout=0.3) is None and receiver.duplicates == 1
            for _ in range(2):
                assert peer.poll(int(WAIT * 1000))
                assert unpack_reply(peer.recv()) == (True, session, 0, "")
    finally:
        peer.close(linger=0)
        context.term()


def test_a_refused_request_is_reported_with_its_id_and_the_reason(ipc_address: str) -> None:
    limits = DecodeLimits(max_prompt_tokens=8)
    with (
        RequestReceiver(ipc_address, limits=limits) as receiver,
        RequestSender(ipc_address) as sender,
    ):
        sender.send(make_request("too long", tokens=9), timeout=WAIT)
        sender.send(make_request("fine"), timeout=WAIT)
        got = receiver.recv(timeout=WAIT)
        assert got is not None and got.request_id == "fine"
        assert not sender.flush(WAIT)  # everything is settled, one of them refused
        (failure,) = sender.take_failures()
        assert isinstance(failure, DeliveryFailure)
        assert failure.request_id == "too long" and failure.refused and failure.attempts == 1
        assert "max_prompt_tokens" in failure.reason
        assert sender.take_failures() == [] and sender.flush(WAIT)  # reported once


def test_a_request_never_acknowledged_is_reported_after_its_last_attempt(
    ipc_address: str,
) -> None:
    with (
        RequestReceiver(ipc_address, auto_ack=False) as receiver,
        RequestSender(ipc_address, ack_timeout=0.05, max_attempts=3) as sender,
    ):
        sender.send(make_request("lost"), timeout=WAIT)
        assert receiver.recv(timeout=WAIT) is not None  # taken, never acknowledged
        assert not sender.flush(WAIT)
        (failure,) = sender.take_failures()
        assert failure.request_id == "lost" and not failure.refused and failure.attempts == 3
        assert "no acknowledgement after 3 attempt(s)" in failure.reason
        assert sender.unacknowledged == [] and sender.resent == 2
        assert receiver.recv(timeout=0.2) is None and receiver.received == 1


def test_the_window_bounds_the_requests_left_unsettled(ipc_address: str) -> None:
    with RequestReceiver(ipc_address) as receiver:
        with RequestSender(ipc_address, window=2, linger=0) as sender:
            sender.send(make_request("a"), timeout=WAIT)
            sender.send(make_request("b"), timeout=WAIT)
            with pytest.raises(TimeoutError, match="window of 2"):
                sender.send(make_request("c"), timeout=0.1)
            assert receiver.recv(timeout=WAIT) is not None  # the engine takes one: room again
            sender.send(make_request("c"), timeout=WAIT)
            assert sender.unacknowledged == ["b", "c"]


def test_bad_delivery_settings_are_configuration_errors(ipc_address: str) -> None:
    with pytest.raises(ConfigurationError, match="ack_timeout"):
        RequestSender(ipc_address, ack_timeout=0)
    with pytest.raises(ConfigurationError, match="max_attempts"):
        RequestSender(ipc_address, max_attempts=0)
    with pytest.raises(ConfigurationError, match="window"):
        RequestSender(ipc_address, window=True)  # type: ignore[arg-type]


# --- a receiver process killed mid-stream ---------------------------------------------------------


def engine_process(address: str, log_path: str) -> None:
    """An engine: records each request it takes (id and attempt) before acknowledging it, and
    works a millisecond on each, so that requests queue up in front of it."""
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    with RequestReceiver(address, auto_ack=False) as receiver:
        os.write(fd, b"ready\n")
        while True:
            delivery = receiver.recv_delivery()
            assert delivery is not None
            os.write(fd, f"{delivery.request.request_id} {delivery.attempt}\n".encode())
            receiver.ack(delivery)
            time.sleep(0.001)


def start_engine(address: str, log_path: Path) -> multiprocessing.Process:
    # fork: the child needs no fresh interpreter (and its torch import) to run a receiver; it
    # builds its own ZMQ context.
    process = multiprocessing.get_context("fork").Process(
        target=engine_process, args=(address, str(log_path)), daemon=True
    )
    process.start()
    wait_for_records(log_path, 0)
    return process


def records(log_path: Path) -> list[tuple[str, int]]:
    lines = log_path.read_text().splitlines() if log_path.exists() else []
    return [(rid, int(attempt)) for rid, attempt in (line.split() for line in lines[1:])]


def wait_for_records(log_path: Path, count: int) -> None:
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        text = log_path.read_text() if log_path.exists() else ""
        if text.startswith("ready\n") and len(text.splitlines()) > count:
            return
        time.sleep(0.005)
    raise AssertionError(f"{log_path.name}: the engine did not record {count} requests")


def test_a_receiver_killed_mid_stream_loses_no_request_and_hands_none_out_twice(
    ipc_address: str, tmp_path: Path
) -> None:
    first_log, second_log = tmp_path / "first.log", tmp_path / "second.log"
    ids = [f"req-{index}" for index in range(400)]
    first = start_engine(ipc_address, first_log)
    second = None
    try:
        with RequestSender(ipc_address, ack_timeout=0.5, max_attempts=20, window=1024) as sender:
            for index, request_id in enumerate(ids):
                sender.send(make_request(request_id), timeout=WAIT)
                if index == 200:
                    # Mid-stream: the engine has taken some, more wait in the queues.
                    wait_for_records(first_log, 20)
                    os.kill(first.pid, signal.SIGKILL)
                    first.join(WAIT)
                    second = start_engine(ipc_address, second_log)
            assert sender.flush(timeout=6 * WAIT)
            assert sender.unacknowledged == [] and sender.take_failures() == []
            resent = sender.resent
    finally:
        for process in (first, second):
            if process is not None and process.is_alive():
                os.kill(process.pid, signal.SIGKILL)
                process.join(WAIT)

    before, after = records(first_log), records(second_log)
    before_ids, after_ids = [rid for rid, _ in before], [rid for rid, _ in after]
    # The kill caught requests in flight: some sent before it reached only the second engine.
    assert resent >= 1 and len(before_ids) <= 201
    # No request lost: each one was taken by one engine or the other.
    assert set(before_ids) | set(after_ids) == set(ids)
    # None handed out twice by one receiver.
    assert len(set(before_ids)) == len(before_ids) and len(set(after_ids)) == len(after_ids)
    # Across the restart, only a re-send can bring one back, and it says so.
    for request_id, attempt in after:
        if request_id in set(before_ids):
            assert attempt > 1, request_id
