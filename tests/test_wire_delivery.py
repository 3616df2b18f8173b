"""Delivery between RequestSender and RequestReceiver: acknowledgements, re-sends, duplicates,
refusals, and a receiver process killed mid-stream. Real sockets, real processes."""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable
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
    SenderStats,
    WireFeature,
    encode_request,
)
from mmproc.wire.delivery import (
    ACK,
    DEDUP_ENTRIES_PER_SENDER,
    DEDUP_HOLD,
    DEDUP_SENDERS,
    Envelope,
    ReceiverLedger,
    unpack_reply,
)

# Generous: only reached when something is broken, never a measure of speed.
WAIT = 10.0


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
                assert unpack_reply(peer.recv()) == (ACK, session, 0, "", b"")
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


def test_a_sender_may_not_outgrow_what_a_receiver_remembers_of_it(ipc_address: str) -> None:
    with pytest.raises(ConfigurationError, match="window must be at most 4096 requests"):
        RequestSender(ipc_address, window=DEDUP_ENTRIES_PER_SENDER + 1)
    with pytest.raises(ConfigurationError, match=r"ack_timeout \* max_attempts must be at most"):
        RequestSender(ipc_address, ack_timeout=DEDUP_HOLD, max_attempts=2)
    RequestSender(
        ipc_address, window=DEDUP_ENTRIES_PER_SENDER, ack_timeout=DEDUP_HOLD / 3, max_attempts=3
    ).close()


# --- the receiver's memory of its senders, under a flood ----------------------------------------


def _drain_until(receiver: RequestReceiver, done: Callable[[], bool]) -> None:
    """Let the receiver read (and hand out nothing) until ``done()``."""
    deadline = time.monotonic() + WAIT
    while not done():
        assert time.monotonic() < deadline, "the receiver did not read the flood"
        assert receiver.recv(timeout=0.05) is None


def test_malformed_messages_from_many_new_senders_do_not_make_a_live_senders_resend_a_delivery(
    ipc_address: str,
) -> None:
    context = zmq.Context()
    live = context.socket(zmq.DEALER)
    flooders = [context.socket(zmq.DEALER) for _ in range(8)]
    try:
        with RequestReceiver(ipc_address, context=context) as receiver:
            for peer in (live, *flooders):
                peer.connect(ipc_address)
            session = os.urandom(16)
            frames = encode_request(make_request("live"))
            live.send_multipart([Envelope(session, 0, 0, 1).pack(), *frames])
            first = receiver.recv_delivery(timeout=WAIT)
            assert first is not None and first.request.request_id == "live"
            # Garbage behind well-formed envelopes, each from a new session, more sessions than
            # the receiver keeps records for.
            flood = DEDUP_SENDERS + 1
            for index in range(flood):
                garbage = [Envelope(os.urandom(16), 0, 0, 1).pack(), b"\xc1"]
                flooders[index % len(flooders)].send_multipart(garbage)
            _drain_until(receiver, lambda: receiver.bad_messages >= flood)
            # The live sender's acknowledgement was lost: it sends the request again.
            live.send_multipart([Envelope(session, 0, 0, 2).pack(), *frames])
            assert receiver.recv(timeout=0.5) is None
            assert receiver.duplicates == 1 and receiver.received == 1
            for _ in range(2):  # acknowledged when taken, and again for the copy
                assert live.poll(int(WAIT * 1000))
                assert unpack_reply(live.recv()) == (ACK, session, 0, "", b"")
    finally:
        for peer in (live, *flooders):
            peer.close(linger=0)
        context.term()


def test_a_flood_of_valid_requests_from_new_senders_never_pushes_out_a_live_sender(
    ipc_address: str,
) -> None:
    context = zmq.Context()
    live, flooder = context.socket(zmq.DEALER), context.socket(zmq.DEALER)
    try:
        with RequestReceiver(ipc_address, context=context) as receiver:
            live.connect(ipc_address)
            flooder.connect(ipc_address)
            session = os.urandom(16)
            frames = encode_request(make_request("live"))
            live.send_multipart([Envelope(session, 0, 0, 1).pack(), *frames])
            assert receiver.recv(timeout=WAIT) is not None
            # Well-formed requests, each from a new session: one more than the records left
            # (sent from a thread: more than the queues hold until the receiver reads).
            flood = encode_request(make_request("flood"))

            def send_flood() -> None:
                for _ in range(DEDUP_SENDERS):
                    flooder.send_multipart([Envelope(os.urandom(16), 0, 0, 1).pack(), *flood])

            sending = threading.Thread(target=send_flood, daemon=True)
            sending.start()
            taken = 0
            deadline = time.monotonic() + WAIT
            while taken + receiver.turned_away < DEDUP_SENDERS:
                assert time.monotonic() < deadline, "the receiver did not read the flood"
                taken += receiver.recv(timeout=0.05) is not None
            sending.join(WAIT)
            # Every record is a sender heard from within DEDUP_HOLD: the last newcomer waits.
            assert (taken, receiver.turned_away) == (DEDUP_SENDERS - 1, 1)
            live.send_multipart([Envelope(session, 0, 0, 2).pack(), *frames])
            assert receiver.recv(timeout=0.5) is None
            assert receiver.duplicates == 1 and receiver.received == DEDUP_SENDERS
    finally:
        live.close(linger=0)
        flooder.close(linger=0)
        context.term()


def envelope_of(session: int, sequence: int = 0, base: int = 0) -> Envelope:
    return Envelope(session.to_bytes(16, "big"), sequence, base, 1)


def test_a_full_ledger_forgets_only_a_silent_acknowledged_sender_past_the_hold() -> None:
    hold = 0.2
    ledger = ReceiverLedger(max_sessions=2, hold=hold)
    acked, pending, newcomer = envelope_of(1), envelope_of(2), envelope_of(3)
    ledger.delivered(acked, acknowledged=True, now=time.monotonic())
    ledger.delivered(pending, acknowledged=False, now=time.monotonic())
    assert not ledger.admits(newcomer, time.monotonic())  # both heard from within the hold
    time.sleep(hold * 1.5)
    now = time.monotonic()
    assert ledger.admits(newcomer, now)
    ledger.delivered(newcomer, acknowledged=True, now=now)
    # The acknowledged one went; the one whose delivery awaits the engine's ack stayed.
    assert ledger.seen(acked) is None and ledger.seen(pending) is False
    assert ledger.seen(newcomer) is True
    time.sleep(hold * 1.5)
    ledger.heard_again(newcomer, time.monotonic())  # it sends a copy: alive again
    assert not ledger.admits(envelope_of(4), time.monotonic())  # pending still holds its place
    ledger.acknowledged(pending)
    assert ledger.admits(envelope_of(4), time.monotonic())


def test_a_sender_that_breaks_its_window_forgets_only_its_own_entries() -> None:
    ledger = ReceiverLedger(max_per_session=3)
    now = time.monotonic()
    other = envelope_of(9)
    ledger.delivered(other, acknowledged=True, now=now)
    for sequence in range(5):
        ledger.delivered(envelope_of(1, sequence), acknowledged=True, now=now)
    assert [ledger.seen(envelope_of(1, sequence)) for sequence in range(5)] == [
        None,
        None,
        True,
        True,
        True,
    ]
    assert ledger.seen(other) is True and ledger.entries == 4


def test_a_senders_base_forgets_what_it_settled() -> None:
    ledger = ReceiverLedger()
    now = time.monotonic()
    for sequence in range(3):
        ledger.delivered(envelope_of(1, sequence), acknowledged=True, now=now)
    ledger.delivered(envelope_of(1, 3, base=2), acknowledged=True, now=now)
    assert ledger.entries == 2
    assert ledger.seen(envelope_of(1, 0)) is False  # below the base: dropped, unanswered


# --- a receiver process killed mid-stream ---------------------------------------------------------


def tensor_digest(request: EngineRequest) -> str:
    """A digest of every tensor of every feature of ``request``: names, dtypes, shapes, bytes."""
    digest = hashlib.sha256()
    for feature in request.features:
        for name, tensor in feature.data.items():
            digest.update(f"{feature.hash} {name} {tensor.dtype} {tuple(tensor.shape)}".encode())
            digest.update(tensor.contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def engine_process(address: str, log_path: str) -> None:
    """An engine: records each request it takes (id, attempt and `tensor_digest`) before
    acknowledging it, and works a millisecond on each, so that requests queue up in front of
    it."""
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    with RequestReceiver(address, auto_ack=False) as receiver:
        os.write(fd, b"ready\n")
        while True:
            delivery = receiver.recv_delivery()
            assert delivery is not None
            request = delivery.request
            line = f"{request.request_id} {delivery.attempt} {tensor_digest(request)}\n"
            os.write(fd, line.encode())
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
    return [(rid, attempt) for rid, attempt, _ in digests(log_path)]


def digests(log_path: Path) -> list[tuple[str, int, str]]:
    lines = log_path.read_text().splitlines() if log_path.exists() else []
    return [(rid, int(attempt), digest) for rid, attempt, digest in map(str.split, lines[1:])]


def wait_for_records(log_path: Path, count: int) -> None:
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        text = log_path.read_text() if log_path.exists() else ""
        if text.startswith("ready\n") and len(text.splitlines()) > count:
            return
        time.sleep(0.005)
    raise AssertionError(f"{log_path.name}: the engine did not record {count} requests")


def send_through_a_restart(
    address: str,
    first_log: Path,
    second_log: Path,
    requests: list[EngineRequest],
    kill_after: int,
) -> SenderStats:
    """Send ``requests`` to an engine process, killing it after the first ``kill_after`` (once it
    has taken 20, more waiting in the queues) and starting another in its place; every request
    must end acknowledged. The sender's stats at the end."""
    first = start_engine(address, first_log)
    second = None
    try:
        with RequestSender(address, ack_timeout=0.5, max_attempts=20, window=1024) as sender:
            for index, request in enumerate(requests):
                sender.send(request, timeout=WAIT)
                if index == kill_after:
                    wait_for_records(first_log, 20)
                    os.kill(first.pid, signal.SIGKILL)
                    first.join(WAIT)
                    second = start_engine(address, second_log)
            assert sender.flush(timeout=6 * WAIT)
            assert sender.unacknowledged == [] and sender.take_failures() == []
            return sender.stats
    finally:
        for process in (first, second):
            if process is not None and process.is_alive():
                os.kill(process.pid, signal.SIGKILL)
                process.join(WAIT)


def test_a_receiver_killed_mid_stream_loses_no_request_and_hands_none_out_twice(
    ipc_address: str, tmp_path: Path
) -> None:
    first_log, second_log = tmp_path / "first.log", tmp_path / "second.log"
    ids = [f"req-{index}" for index in range(400)]
    requests = [make_request(request_id) for request_id in ids]
    resent = send_through_a_restart(ipc_address, first_log, second_log, requests, 200).resent

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


def image_request(request_id: str, seeds: tuple[int, int]) -> EngineRequest:
    """A request with two images, each 64 Qwen2-VL patches (75 KiB) drawn from its seed."""
    features = []
    for index, seed in enumerate(seeds):
        generator = torch.Generator().manual_seed(seed)
        pixels = torch.randint(0, 256, (64, 1176), dtype=torch.uint8, generator=generator)
        data = {"pixel_values": pixels, "image_grid_thw": torch.tensor([1, 8, 8])}
        features.append(WireFeature("image", index, f"img-{seed}", 4 * index, 4, None, data))
    return EngineRequest(request_id, list(range(16)), features)


def test_a_receiver_killed_mid_stream_while_items_go_by_reference_loses_nothing_and_stays_exact(
    ipc_address: str, tmp_path: Path
) -> None:
    first_log, second_log = tmp_path / "first.log", tmp_path / "second.log"
    # Six images shared by all requests: after the first few, items go by reference, and the
    # restarted engine holds none of the items the sender refers to.
    sent = {
        f"req-{index}": image_request(f"req-{index}", (index % 6, (index + 2) % 6))
        for index in range(300)
    }
    stats = send_through_a_restart(ipc_address, first_log, second_log, list(sent.values()), 150)

    taken = digests(first_log) + digests(second_log)
    # Every request reached an engine, and whichever engine took it got exactly its tensors.
    assert {rid for rid, _, _ in taken} == set(sent)
    for rid, _, digest in taken:
        assert digest == tensor_digest(sent[rid]), rid
    # None handed out twice by one receiver.
    for log in (first_log, second_log):
        ids = [rid for rid, _ in records(log)]
        assert len(set(ids)) == len(ids)
    # Items went by reference, and the new engine's missing items cost sends in full.
    assert stats.items_by_reference > 0 and stats.resent_in_full >= 1


def test_wait_for_replies_returns_when_the_acknowledgement_comes_not_at_its_timeout(
    ipc_address: str,
) -> None:
    with RequestReceiver(ipc_address) as receiver, RequestSender(ipc_address) as sender:
        sender.send(make_request("late"), timeout=WAIT)
        acknowledger = threading.Timer(0.3, lambda: receiver.recv(timeout=WAIT))
        acknowledger.start()
        start = time.monotonic()
        while sender.unacknowledged and time.monotonic() - start < WAIT:
            sender.wait_for_replies(WAIT)
        waited = time.monotonic() - start
        acknowledger.join()
        assert sender.unacknowledged == [] and sender.acknowledged == 1
        assert waited < WAIT / 2  # woken by the reply, not by running out of time


def test_wait_for_replies_ends_when_its_wake_descriptor_is_written(ipc_address: str) -> None:
    read, write = os.pipe()
    try:
        with RequestSender(ipc_address) as sender:
            threading.Timer(0.2, os.write, (write, b"\0")).start()
            start = time.monotonic()
            sender.wait_for_replies(WAIT, read)
            assert time.monotonic() - start < WAIT / 2
            sender.close()
            with pytest.raises(RuntimeError, match="closed"):
                sender.wait_for_replies(0.1)
    finally:
        os.close(read)
        os.close(write)


def test_wait_for_replies_leaves_the_sender_to_other_threads_while_it_waits(
    ipc_address: str,
) -> None:
    with RequestReceiver(ipc_address) as receiver, RequestSender(ipc_address) as sender:
        waiter = threading.Thread(target=sender.wait_for_replies, args=(2.0,))
        waiter.start()
        time.sleep(0.1)
        start = time.monotonic()
        sender.send(make_request("meanwhile"), timeout=WAIT)  # not held up by the wait
        sent_after = time.monotonic() - start
        waiter.join()
        assert sent_after < 1.0
        assert receiver.recv(timeout=WAIT) is not None
