"""Media items by reference: an item the receiver holds goes again as its key only; a wrong
guess of what it holds costs one send in full, never a request. Real sockets on loopback; the
receiver process killed mid-stream is in tests/test_wire_delivery.py."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgpack
import pytest
import torch
import zmq
from mmproc.errors import ConfigurationError, DecodeError
from mmproc.wire import (
    DEFAULT_ITEM_CACHE_BYTES,
    EngineRequest,
    ItemCache,
    MissingItemsError,
    ReceiverStats,
    RequestReceiver,
    RequestSender,
    SenderStats,
    StandInsNotHeldError,
    WireFeature,
    decode_request,
    encode_request,
    is_stand_in,
    item_key,
)
from mmproc.wire.items import ITEM_ENTRY_BYTES, ITEM_KEY_BYTES
from zmq.utils.monitor import recv_monitor_message

# Generous: only reached when something is broken, never a measure of speed.
WAIT = 10.0

NORM = {"mean": [0.48, 0.46, 0.41], "std": [0.27, 0.26, 0.28], "rescale": 1 / 255}
# 64 Qwen2-VL patches of 1176 uint8 values: 75,264 bytes, past pyzmq's copy threshold.
PATCHES = (64, 1176)
ITEM_BYTES = PATCHES[0] * PATCHES[1] + 3 * 8  # pixels and the int64 grid


def pixels(seed: int, shape: tuple[int, ...] = PATCHES) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=generator)


def image(seed: int, index: int = 0, offset: int = 0, **overrides: object) -> WireFeature:
    """Image ``seed`` as a request's image ``index`` at prompt position ``offset``: the same
    seed is the same item (same hash, same tensors) whatever request it is in."""
    fields: dict[str, object] = {
        "modality": "image",
        "item_index": index,
        "hash": f"image-{seed:04d}",
        "offset": offset,
        "length": 4,
        "is_embed": None,
        "data": {"pixel_values": pixels(seed), "image_grid_thw": torch.tensor([1, 8, 8])},
        "norm": NORM,
    }
    fields.update(overrides)
    return WireFeature(**fields)  # type: ignore[arg-type]


def chat_request(request_id: str, seeds: list[int]) -> EngineRequest:
    """A request with images ``seeds`` in this order, 4 placeholders each, then 8 text tokens."""
    features = [image(seed, index, 4 * index) for index, seed in enumerate(seeds)]
    return EngineRequest(request_id, list(range(4 * len(seeds) + 8)), features)


def described(request: EngineRequest) -> tuple[object, ...]:
    """Everything of a request the engine reads, each tensor as its dtype, shape and bytes."""
    return (
        request.request_id,
        request.prompt_token_ids,
        [
            (
                (f.modality, f.item_index, f.hash, f.offset, f.length, f.norm),
                [(k, t.dtype, tuple(t.shape), t.numpy().tobytes()) for k, t in f.data.items()],
            )
            for f in request.features
        ],
    )


def assert_bit_correct(got: EngineRequest | None, expected: EngineRequest) -> None:
    assert got is not None
    assert described(got) == described(expected)


@pytest.fixture
def kept() -> ItemCache:
    """A receiver's items, holding image 1 as it came."""
    cache = ItemCache(DEFAULT_ITEM_CACHE_BYTES)
    received = decode_request(encode_request(chat_request("first", [1])))
    (feature,) = received.features
    assert cache.keep(item_key(feature), feature)
    return cache


# --- the schema: references on the wire, filled in on decode ----------------------------------


def test_a_feature_by_reference_travels_as_its_key_and_is_filled_in_from_the_kept_item(
    kept: ItemCache,
) -> None:
    request = chat_request("again", [1])
    key = item_key(request.features[0])
    frames = encode_request(request, by_reference={key})
    assert len(frames) == 1  # no tensor frame left: the pixels stay at the receiver
    (wire,) = msgpack.unpackb(frames[0])["features"]
    assert (wire["data"], wire["norm"], wire["ref"]) == (None, None, key)
    assert len(key) == ITEM_KEY_BYTES
    got = decode_request(frames, items=kept)
    assert_bit_correct(got, request)
    held = kept.get(key)
    assert held is not None
    # the request shares the kept tensors (read-only views) in a dict of its own
    assert got.features[0].data["pixel_values"] is held.data["pixel_values"]
    assert got.features[0].data is not held.data


def test_a_reference_to_an_item_not_held_is_a_missing_items_error_naming_it() -> None:
    request = chat_request("new receiver", [7, 8])
    by_reference = {item_key(request.features[1])}
    with pytest.raises(MissingItemsError, match=r"feature 1 \('image' item 1, hash 'image-0008'"):
        decode_request(encode_request(request, by_reference=by_reference), items=ItemCache(1 << 20))
    with pytest.raises(MissingItemsError) as caught:
        decode_request(encode_request(request, by_reference=by_reference))  # no items at all
    assert caught.value.positions == (1,) and isinstance(caught.value, DecodeError)


@pytest.mark.parametrize(
    "other",
    [
        pytest.param({"norm": None, "data": {"pixel_values": pixels(1).float()}}, id="cpu-norm"),
        pytest.param({"norm": {**NORM, "rescale": 1.0}}, id="another-norm-spec"),
        pytest.param({"data": {"pixel_values": pixels(1).view(torch.int8)}}, id="another-dtype"),
        pytest.param({"data": {"pixel_values": pixels(1).view(32, 2352)}}, id="another-shape"),
        pytest.param({"modality": "video"}, id="another-modality"),
    ],
)
def test_an_item_of_the_same_hash_in_another_wire_form_is_never_served_for_it(
    kept: ItemCache, other: dict[str, object]
) -> None:
    # Another front end hashed the same picture to the same hash but ships it otherwise.
    theirs = image(1, **other)
    assert theirs.hash == "image-0001"
    request = EngineRequest("theirs", list(range(12)), [theirs])
    frames = encode_request(request, by_reference={item_key(theirs)})
    with pytest.raises(MissingItemsError):
        decode_request(frames, items=kept)


def test_malformed_references_are_refused_as_malformed_not_as_missing(kept: ItemCache) -> None:
    request = chat_request("bad", [1])
    wire = request.to_wire()
    feature = wire["features"][0]
    feature["ref"] = b"short"
    with pytest.raises(DecodeError, match="ref must be 16 bytes") as caught:
        decode_request(encode_request_tree(wire), items=kept)
    assert not isinstance(caught.value, MissingItemsError)
    feature["ref"] = item_key(request.features[0])  # with its data still there
    with pytest.raises(DecodeError, match="by reference has nil data and norm") as caught:
        decode_request(encode_request_tree(wire), items=kept)
    assert not isinstance(caught.value, MissingItemsError)
    # a held item at a placement that does not fit: checked as a feature in full would be
    feature["data"] = feature["norm"] = None
    feature["is_embed"] = torch.ones(3, dtype=torch.bool)
    with pytest.raises(DecodeError, match=r"is_embed must be a bool tensor of shape \(4,\)"):
        decode_request(encode_request_tree(wire), items=kept)
    feature["is_embed"], feature["offset"] = None, 10
    with pytest.raises(DecodeError, match=r"spans prompt positions 10\.\.14"):
        decode_request(encode_request_tree(wire), items=kept)
    feature["offset"] = 0
    assert_bit_correct(decode_request(encode_request_tree(wire), items=kept), request)


def encode_request_tree(wire: dict[str, object]) -> list[bytes | memoryview]:
    from mmproc.wire import encode

    return encode(wire)


def test_the_item_cache_is_bounded_in_bytes_and_keeps_no_item_larger_than_the_bound() -> None:
    features = decode_request(encode_request(chat_request("three", [1, 2, 3]))).features
    keys = [item_key(feature) for feature in features]
    cache = ItemCache(2 * (ITEM_BYTES + ITEM_ENTRY_BYTES))  # room for two
    for key, feature in zip(keys, features, strict=True):
        assert cache.keep(key, feature)
    assert len(cache) == 2 and keys[0] not in cache and cache.evictions == 1
    assert cache.nbytes == 2 * (ITEM_BYTES + ITEM_ENTRY_BYTES) <= cache.max_bytes
    small = ItemCache(ITEM_BYTES)  # smaller than one item with its entry
    assert not small.keep(keys[0], features[0]) and len(small) == 0
    with pytest.raises(ConfigurationError, match="item_cache_bytes must be an int >= 0"):
        ItemCache(-1)


# --- over real sockets ------------------------------------------------------------------------


@pytest.fixture
def pair(ipc_address: str) -> Iterator[tuple[RequestSender, RequestReceiver]]:
    with RequestReceiver(ipc_address) as receiver, RequestSender(ipc_address) as sender:
        yield sender, receiver


def send_and_take(
    sender: RequestSender, receiver: RequestReceiver, request: EngineRequest
) -> EngineRequest | None:
    """Send one request, let the engine take it, and wait for its acknowledgement (a chat's next
    turn comes after the answer to the last one)."""
    sender.send(request, timeout=WAIT)
    got = receiver.recv(timeout=WAIT)
    assert sender.flush(WAIT)
    return got


def test_a_ten_turn_chat_with_a_new_image_each_turn_sends_each_image_once(
    pair: tuple[RequestSender, RequestReceiver],
) -> None:
    sender, receiver = pair
    for turn in range(1, 11):
        request = chat_request(f"turn-{turn}", list(range(turn)))  # every earlier image again
        assert_bit_correct(send_and_take(sender, receiver, request), request)
    stats = sender.stats
    assert stats.items_in_full == 10 and stats.items_by_reference == sum(range(10))
    assert stats.resent == 0 and stats.acknowledged == stats.requests == 10
    # every image's pixels crossed once: the bytes are the ten images and little besides
    assert 10 * ITEM_BYTES < stats.bytes < 10 * ITEM_BYTES + 20_000
    took = receiver.stats
    assert (took.items_in_full, took.items_by_reference) == (10, 45)
    assert took.missing_items == 0 and took.items_cached == 10


def test_a_repeated_qwen2_vl_image_costs_under_256_bytes_on_the_wire_after_its_first_send(
    pair: tuple[RequestSender, RequestReceiver],
) -> None:
    sender, receiver = pair
    patches = pixels(5, (3996, 1176))  # a 1024x768 image: grid 1x54x74, 4.48 MiB
    feature = image(
        5, length=999, data={"pixel_values": patches, "image_grid_thw": torch.tensor([1, 54, 74])}
    )
    ids = list(range(1024))
    costs = []
    for request in (
        EngineRequest("first", ids, [feature]),
        EngineRequest("again", ids, [feature]),
        EngineRequest("no media", ids, []),
    ):
        before = sender.stats.bytes
        assert_bit_correct(send_and_take(sender, receiver, request), request)
        costs.append(sender.stats.bytes - before)
    first, again, no_media = costs
    assert first > patches.numel()
    assert again - no_media <= 256


def test_an_item_repeated_within_one_request_travels_once_even_to_a_receiver_keeping_none(
    ipc_address: str,
) -> None:
    with (
        RequestReceiver(ipc_address, item_cache_bytes=0) as receiver,
        RequestSender(ipc_address) as sender,
    ):
        request = chat_request("twice", [3, 3])
        assert_bit_correct(send_and_take(sender, receiver, request), request)
        assert (sender.stats.items_in_full, sender.stats.items_by_reference) == (1, 1)
        assert receiver.stats.items_cached == 0
        # nothing was kept: the next request carries the item in full again
        request = chat_request("again", [3])
        assert_bit_correct(send_and_take(sender, receiver, request), request)
        assert sender.stats.items_in_full == 2 and sender.stats.resent == 0


@contextlib.contextmanager
def evicted_first_item(
    ipc_address: str, **sender_options: Any
) -> Iterator[tuple[RequestSender, RequestReceiver]]:
    """A sender and a receiver with room for one item, after two requests of an item each: the
    receiver has evicted the first item (seed 1), which the sender takes it to hold (it guesses
    the default 1 GiB: wrong)."""
    room_for_one = ITEM_BYTES + ITEM_ENTRY_BYTES
    with (
        RequestReceiver(ipc_address, item_cache_bytes=room_for_one) as receiver,
        RequestSender(ipc_address, **sender_options) as sender,
    ):
        for request_id, seed in (("x", 1), ("y", 2)):
            send_and_take(sender, receiver, chat_request(request_id, [seed]))
        assert sender.stats.items_held == 2 and receiver.stats.evictions == 1
        yield sender, receiver


def test_an_item_the_receiver_evicted_since_is_sent_again_in_full_at_once(
    ipc_address: str,
) -> None:
    with evicted_first_item(ipc_address) as (sender, receiver):
        request = chat_request("x again", [1])  # by reference: the receiver has dropped it
        assert_bit_correct(send_and_take(sender, receiver, request), request)
        stats = sender.stats
        assert (stats.items_by_reference, stats.resent_in_full, stats.resent) == (1, 1, 1)
        assert stats.items_in_full == 3 and sender.take_failures() == []
        assert receiver.stats.missing_items == 1 and receiver.bad_messages == 0
        assert receiver.stats.received == 3


def test_a_sender_driven_through_wait_for_replies_sends_a_missing_item_in_full_on_its_own(
    ipc_address: str,
) -> None:
    with evicted_first_item(ipc_address, watch_replies=False) as (sender, receiver):
        request = chat_request("x again", [1])  # by reference: the receiver has dropped it
        taken: list[EngineRequest | None] = []
        engine = threading.Thread(target=lambda: taken.append(receiver.recv(timeout=WAIT)))
        engine.start()
        sender.send(request, timeout=WAIT)
        # No thread of the sender's reads the replies: the caller's waits do, and send again.
        assert not [t for t in threading.enumerate() if t.name.startswith("mmproc-sender-replies")]
        deadline = time.monotonic() + WAIT
        while sender.unacknowledged and time.monotonic() < deadline:
            sender.wait_for_replies(0.5)
        engine.join()
        assert_bit_correct(taken[0], request)
        stats = sender.stats
        assert (stats.items_by_reference, stats.resent_in_full, stats.acknowledged) == (1, 1, 3)
        assert receiver.stats.missing_items == 1


def stand_in_of(request: EngineRequest, request_id: str) -> EngineRequest:
    """``request`` under ``request_id`` with meta tensors (dtype and shape, no memory) for its
    pixels: what a front end keeps of items it takes its engine to hold."""
    features = [
        dataclasses.replace(
            feature,
            data={
                **feature.data,
                "pixel_values": torch.empty(PATCHES, dtype=torch.uint8, device="meta"),
            },
        )
        for feature in request.features
    ]
    return EngineRequest(request_id, request.prompt_token_ids, features)


def test_a_stand_in_of_an_item_the_receiver_holds_goes_by_reference_and_arrives_whole(
    pair: tuple[RequestSender, RequestReceiver],
) -> None:
    sender, receiver = pair
    first = chat_request("first", [1])
    send_and_take(sender, receiver, first)
    again = stand_in_of(first, "again")
    assert is_stand_in(again.features[0]) and not is_stand_in(first.features[0])
    assert item_key(again.features[0]) == item_key(first.features[0])
    assert sender.holds(again) == [True]
    got = send_and_take(sender, receiver, again)
    assert got is not None
    assert_bit_correct(got, dataclasses.replace(first, request_id="again"))
    assert sender.stats.items_by_reference == 1 and sender.take_failures() == []


def test_a_stand_in_the_receiver_is_not_known_to_hold_is_refused_before_anything_is_sent(
    pair: tuple[RequestSender, RequestReceiver],
) -> None:
    sender, receiver = pair
    lone = stand_in_of(chat_request("lone", [4]), "lone")
    assert sender.holds(lone) == [False]
    with pytest.raises(StandInsNotHeldError, match="image-0004") as caught:
        sender.send(lone, timeout=WAIT)
    assert caught.value.request_id == "lone" and caught.value.hashes == ("image-0004",)
    assert sender.stats.requests == 0 and sender.unacknowledged == []
    assert receiver.recv(timeout=0.2) is None


def test_a_stand_in_of_an_item_the_receiver_evicted_fails_as_missing_not_as_refused(
    ipc_address: str,
) -> None:
    with evicted_first_item(ipc_address) as (sender, receiver):
        request = stand_in_of(chat_request("x again", [1]), "x again")
        sender.send(request, timeout=WAIT)  # by reference: the receiver has dropped it
        assert receiver.recv(timeout=0.5) is None  # never handed to the engine
        deadline = time.monotonic() + WAIT
        failures = sender.take_failures()
        while not failures and time.monotonic() < deadline:
            sender.wait_for_replies(0.1)
            failures = sender.take_failures()
        (failure,) = failures
        assert (failure.request_id, failure.missing, failure.refused) == ("x again", True, False)
        assert "lacks items" in failure.reason
        # Nothing to send it in full with: not re-sent, and no longer taken to be held.
        assert sender.stats.resent_in_full == 0 and sender.unacknowledged == []
        assert sender.holds(request) == [False]


def connection_watch(sender: RequestSender) -> Callable[[], None]:
    """A wait for ``sender``'s next connection (to a receiver bound after this call). A request
    sent before the sender has seen its old receiver go can be written to the dead connection
    and is only re-sent after ``ack_timeout``; once the new connection is up, the old one is
    gone. Call with no request of the sender's in flight (the monitor shares its socket)."""
    monitor = sender._socket.get_monitor_socket(zmq.EVENT_CONNECTED)

    def wait() -> None:
        try:
            assert monitor.poll(int(WAIT * 1000)), "the sender did not connect to the new receiver"
            recv_monitor_message(monitor)
        finally:
            sender._socket.disable_monitor()
            monitor.close()

    return wait


def test_a_new_receiver_in_the_old_ones_place_gets_references_again_in_full(
    ipc_address: str,
) -> None:
    with RequestSender(ipc_address) as sender:
        with RequestReceiver(ipc_address) as first:
            send_and_take(sender, first, chat_request("before", [1, 2]))
            reconnected = connection_watch(sender)
        with RequestReceiver(ipc_address) as second:  # a restart: it holds nothing
            reconnected()
            request = chat_request("after", [1, 2, 3])
            assert_bit_correct(send_and_take(sender, second, request), request)
            assert second.stats.missing_items == 1 and second.stats.items_in_full == 3
            request = chat_request("after that", [1, 2, 3])
            assert_bit_correct(send_and_take(sender, second, request), request)
        stats = sender.stats
        assert stats.resent_in_full == 1 and stats.items_by_reference == 2 + 3
        assert stats.acknowledged == 3 and sender.take_failures() == []


def test_a_receiver_keeping_less_than_one_item_loses_nothing_and_is_never_sent_references(
    ipc_address: str,
) -> None:
    with (
        RequestReceiver(ipc_address, item_cache_bytes=ITEM_BYTES // 2) as receiver,
        RequestSender(ipc_address) as sender,
    ):
        for turn in range(5):
            request = chat_request(f"r{turn}", [1, 2])
            assert_bit_correct(send_and_take(sender, receiver, request), request)
        stats = sender.stats
        assert (stats.items_in_full, stats.items_by_reference, stats.resent) == (10, 0, 0)
        assert receiver.stats.items_cached == 0 and receiver.stats.missing_items == 0


def test_an_engine_acknowledging_itself_says_what_is_held_when_it_acknowledges(
    ipc_address: str,
) -> None:
    with (
        RequestReceiver(ipc_address, auto_ack=False) as receiver,
        RequestSender(ipc_address) as sender,
    ):
        sender.send(chat_request("manual", [4]), timeout=WAIT)
        delivery = receiver.recv_delivery(timeout=WAIT)
        assert delivery is not None
        assert sender.stats.items_held == 0  # not acknowledged yet: nothing is taken as held
        receiver.ack(delivery)
        assert sender.flush(WAIT) and sender.stats.items_held == 1
        sender.send(chat_request("manual again", [4]), timeout=WAIT)
        delivery = receiver.recv_delivery(timeout=WAIT)
        assert delivery is not None and sender.stats.items_by_reference == 1
        assert_bit_correct(delivery.request, chat_request("manual again", [4]))
        receiver.ack(delivery)
        assert sender.flush(WAIT)


def test_four_senders_with_overlapping_items_lose_nothing_and_get_bit_correct_tensors(
    ipc_address: str,
) -> None:
    # The receiver keeps three of the eight images the senders share, so each sender's guess of
    # what it holds is often wrong: other senders' items push its own out.
    per_sender, pool = 40, 8
    room = 3 * (ITEM_BYTES + ITEM_ENTRY_BYTES)
    expected = {
        f"s{sender}-{index}": chat_request(
            f"s{sender}-{index}", [(sender + index) % pool, (sender * 3 + index + 1) % pool]
        )
        for sender in range(4)
        for index in range(per_sender)
    }
    got: dict[str, EngineRequest] = {}
    senders = [RequestSender(ipc_address) for _ in range(4)]
    errors: list[BaseException] = []

    def run(number: int, sender: RequestSender) -> None:
        try:
            for index in range(per_sender):
                sender.send(expected[f"s{number}-{index}"], timeout=WAIT)
                if index % 4 == 3:
                    assert sender.flush(WAIT)  # so that acknowledgements feed its guesses
            assert sender.flush(WAIT)
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    with RequestReceiver(ipc_address, item_cache_bytes=room) as receiver:
        threads = [
            threading.Thread(target=run, args=(number, sender), daemon=True)
            for number, sender in enumerate(senders)
        ]
        for thread in threads:
            thread.start()
        while len(got) < len(expected):
            request = receiver.recv(timeout=WAIT)
            assert request is not None, f"only {len(got)} of {len(expected)} requests arrived"
            assert request.request_id not in got  # none handed out twice
            got[request.request_id] = request
        for thread in threads:
            thread.join(WAIT)
        assert not errors, errors
        took = receiver.stats
    try:
        for request_id, request in expected.items():
            assert_bit_correct(got[request_id], request)
        stats = [sender.stats for sender in senders]
        assert all(s.acknowledged == per_sender and s.given_up == s.refused == 0 for s in stats)
        assert all(sender.take_failures() == [] for sender in senders)
        # the guesses were wrong at times, and each wrong one cost one send in full
        assert sum(s.resent_in_full for s in stats) == took.missing_items > 0
        assert sum(s.items_by_reference for s in stats) > took.items_by_reference > 0
        assert took.received == len(expected) and took.bad_messages == 0
    finally:
        for sender in senders:
            sender.close()


# --- settings and stats -------------------------------------------------------------------------


def test_a_sender_keeping_no_items_sends_every_item_in_full(ipc_address: str) -> None:
    with (
        RequestReceiver(ipc_address) as receiver,
        RequestSender(ipc_address, item_cache_bytes=0) as sender,
    ):
        for request_id in ("a", "b"):
            request = chat_request(request_id, [1, 1])
            assert_bit_correct(send_and_take(sender, receiver, request), request)
        stats = sender.stats
        assert (stats.items_in_full, stats.items_by_reference, stats.items_held) == (4, 0, 0)
        assert (
            sender.item_cache_bytes == 0 and receiver.item_cache_bytes == DEFAULT_ITEM_CACHE_BYTES
        )


@pytest.mark.parametrize("value", [-1, 1.5, True, "1GiB"])
def test_item_cache_bytes_must_be_a_byte_count(ipc_address: str, value: object) -> None:
    with pytest.raises(ConfigurationError, match="RequestSender item_cache_bytes"):
        RequestSender(ipc_address, item_cache_bytes=value)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="RequestReceiver item_cache_bytes"):
        RequestReceiver(ipc_address, item_cache_bytes=value)  # type: ignore[arg-type]


def test_stats_are_frozen_snapshots_that_both_ends_agree_on(
    pair: tuple[RequestSender, RequestReceiver],
) -> None:
    sender, receiver = pair
    send_and_take(sender, receiver, chat_request("one", [1]))
    sent, took = sender.stats, receiver.stats
    assert isinstance(sent, SenderStats) and isinstance(took, ReceiverStats)
    assert (sent.requests, sent.messages, sent.frames) == (1, 1, 3)  # envelope, body, pixels
    assert sent.bytes == took.bytes and sent.frames == took.frames
    with pytest.raises(dataclasses.FrozenInstanceError):
        sent.requests = 2  # type: ignore[misc]
    for snapshot in (sent, took):
        counters = snapshot.as_dict()
        assert all(type(value) is int for value in counters.values())
        assert list(counters) == [field.name for field in dataclasses.fields(snapshot)]
    send_and_take(sender, receiver, chat_request("two", [1]))
    assert sent.requests == 1 and sender.stats.requests == 2  # a snapshot does not move
