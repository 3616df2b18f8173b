"""The ZMQ transport on real sockets: ipc:// in a temp dir and tcp:// on loopback."""

from __future__ import annotations

import gc
import logging
import threading
from collections.abc import Iterator
from typing import Any

import msgpack
import numpy as np
import pytest
import torch
import zmq
from mmproc.errors import ConfigurationError
from mmproc.wire import (
    DecodeLimits,
    EngineRequest,
    RequestReceiver,
    RequestSender,
    WireFeature,
    decode,
    encode,
    encode_request,
)
from mmproc.wire.delivery import REFUSED, Envelope, Reply, unpack_reply
from mmproc.wire.schema import decode_request_keys

# Generous: only reached when something is broken, never a measure of speed.
WAIT = 10.0


def address(buffer: Any) -> int:
    """Address of the first byte of a buffer (bytes, memoryview, zmq.Frame)."""
    return int(np.frombuffer(buffer, dtype=np.uint8).ctypes.data)


@pytest.fixture
def context() -> Iterator[zmq.Context]:
    ctx = zmq.Context()
    yield ctx
    ctx.term()


def make_request(request_id: str = "r", pixels: torch.Tensor | None = None) -> EngineRequest:
    pixels = torch.randn(64, 1024) if pixels is None else pixels
    feature = WireFeature(
        modality="image",
        item_index=0,
        hash="abc",
        offset=1,
        length=2,
        is_embed=None,
        data={"pixel_values": pixels, "image_grid_thw": torch.tensor([1, 8, 8])},
        norm={"mean": [0.5, 0.5, 0.5], "std": [0.5, 0.5, 0.5]},
    )
    return EngineRequest(request_id, [1, 2, 3, 4], [feature], {"max_tokens": 8})


def test_ipc_round_trip_with_large_tensor(ipc_address: str) -> None:
    pixels = torch.randn(512, 1024)  # 2 MiB: well past pyzmq's copy threshold, truly zero-copy
    with RequestReceiver(ipc_address) as receiver, RequestSender(ipc_address) as sender:
        tracker = sender.send(make_request("one", pixels), timeout=WAIT)
        got = receiver.recv(timeout=WAIT)
        assert got is not None and got.request_id == "one"
        assert torch.equal(got.features[0].data["pixel_values"], pixels)
        assert got.features[0].norm == {"mean": [0.5, 0.5, 0.5], "std": [0.5, 0.5, 0.5]}
        tracker.wait(WAIT)
        assert tracker.done and sender.flush(WAIT) and sender.pending == 0
        assert receiver.received == 1 and receiver.bad_messages == 0


def test_tcp_round_trip_on_an_ephemeral_port() -> None:
    with RequestReceiver("tcp://127.0.0.1:*") as receiver:
        assert receiver.address.startswith("tcp://127.0.0.1:")
        assert not receiver.address.endswith(":*")
        with RequestSender(receiver.address) as sender:
            for index in range(3):
                sender.send(make_request(f"r{index}"), timeout=WAIT)
            ids = [receiver.recv(timeout=WAIT) for _ in range(3)]
        assert [request.request_id for request in ids if request is not None] == ["r0", "r1", "r2"]


def test_sender_may_bind_and_receiver_connect(ipc_address: str) -> None:
    with RequestSender(ipc_address, bind=True) as sender:
        with RequestReceiver(ipc_address, bind=False) as receiver:
            sender.send(make_request("x"), timeout=WAIT)
            got = receiver.recv(timeout=WAIT)
            assert got is not None and got.request_id == "x"


def test_receive_side_decodes_over_zmq_frames_without_copy(
    ipc_address: str, context: zmq.Context
) -> None:
    pixels = torch.randn(256, 1024)
    router = context.socket(zmq.ROUTER)
    router.bind(ipc_address)
    try:
        with RequestSender(ipc_address, context=context, linger=0) as sender:
            sender.send(make_request("zc", pixels), timeout=WAIT)
            assert router.poll(int(WAIT * 1000))
            # the sender's identity and its delivery envelope, then the request's frames
            _, _, *frames = router.recv_multipart(copy=False)
        wire = decode(frames)
        received = wire["features"][0]["data"]["pixel_values"]
        assert received.data_ptr() == np.frombuffer(frames[1], dtype=np.uint8).ctypes.data
        assert torch.equal(received, pixels)
    finally:
        router.close(linger=0)


class RecordingSocket:
    """Wraps a sender's socket and records how each frame was handed to ZMQ."""

    def __init__(self, socket: zmq.Socket) -> None:
        self.socket = socket
        self.sends: list[tuple[Any, bool, bool]] = []  # (frame, copy, track)

    def send(self, frame: Any, flags: int = 0, copy: bool = True, track: bool = False) -> Any:
        self.sends.append((frame, copy, track))
        return self.socket.send(frame, flags, copy=copy, track=track)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.socket, name)


def test_small_frames_are_copied_and_large_tensor_frames_sent_zero_copy_and_tracked(
    ipc_address: str,
) -> None:
    big = torch.randn(512, 1024)  # 2 MiB: over pyzmq's copy threshold
    small = torch.randn(16, 16)  # 1 KiB: an aux frame, but under the copy threshold
    feature = make_request().features[0]
    data = {"pixel_values": big, "image_grid_thw": torch.tensor([1, 8, 8]), "small": small}
    request = EngineRequest(
        "mixed", [1, 2, 3, 4], [WireFeature("image", 0, "abc", 1, 2, None, data, feature.norm)]
    )
    with RequestReceiver(ipc_address) as receiver, RequestSender(ipc_address) as sender:
        recorder = RecordingSocket(sender._socket)
        sender._socket = recorder  # type: ignore[assignment]
        tracker = sender.send(request, timeout=WAIT)
        # the delivery envelope, then the request: the grid is inline, three frames
        envelope, body, pixels, little = recorder.sends
        assert len(envelope[0]) == 40 and envelope[1:] == (True, False)
        assert isinstance(body[0], bytes) and body[1:] == (True, False)
        assert pixels[1:] == (False, True)  # zero-copy, tracked
        assert address(pixels[0]) == big.data_ptr()  # the frame is the tensor's own memory
        assert little[1:] == (True, False)  # copied, as pyzmq would anyway; nothing to track
        got = receiver.recv(timeout=WAIT)
        assert got is not None
        assert torch.equal(got.features[0].data["pixel_values"], big)
        assert torch.equal(got.features[0].data["small"], small)
        tracker.wait(WAIT)
        assert sender.flush(WAIT) and sender.pending == 0
        sender._socket = recorder.socket


def test_a_request_of_small_frames_is_done_at_once(ipc_address: str) -> None:
    request = make_request("small", torch.randn(16, 16))  # every frame under 64 KiB
    with RequestReceiver(ipc_address) as receiver, RequestSender(ipc_address) as sender:
        tracker = sender.send(request, timeout=WAIT)
        assert tracker.done and sender.pending == 0  # copied into ZMQ: free to modify
        got = receiver.recv(timeout=WAIT)
        assert got is not None and torch.equal(
            got.features[0].data["pixel_values"], request.features[0].data["pixel_values"]
        )


def test_a_large_body_goes_without_copy_and_is_not_tracked(ipc_address: str) -> None:
    params = {"stop": ["x" * 300_000]}  # a msgpack body of ~300 KiB, no tensors
    ids = list(range(20))  # 160 bytes: inline
    with RequestReceiver(ipc_address) as receiver, RequestSender(ipc_address) as sender:
        recorder = RecordingSocket(sender._socket)
        sender._socket = recorder  # type: ignore[assignment]
        tracker = sender.send(EngineRequest("long", ids, [], params), timeout=WAIT)
        _, (body, copy, track) = recorder.sends  # after the delivery envelope
        assert len(body) > zmq.COPY_THRESHOLD and (copy, track) == (False, False)
        assert tracker.done and sender.pending == 0  # the body is immutable bytes
        got = receiver.recv(timeout=WAIT)
        assert got is not None and got.prompt_token_ids == ids and got.params == params
        sender._socket = recorder.socket


def test_long_prompt_ids_leave_as_one_zero_copy_frame(ipc_address: str) -> None:
    ids = list(range(100_000))
    with RequestReceiver(ipc_address) as receiver, RequestSender(ipc_address) as sender:
        recorder = RecordingSocket(sender._socket)
        sender._socket = recorder  # type: ignore[assignment]
        sender.send(EngineRequest("long", ids), timeout=WAIT)
        _, _, (frame, copy, track) = recorder.sends  # envelope, body, token ids
        assert len(frame) == 8 * len(ids) and (copy, track) == (False, True)
        got = receiver.recv(timeout=WAIT)
        assert got is not None and got.prompt_token_ids == ids
        assert type(got.prompt_token_ids) is list and type(got.prompt_token_ids[0]) is int
        sender._socket = recorder.socket


def test_receiver_decodes_tensors_as_views_over_the_received_frames(
    ipc_address: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import mmproc.wire.transport as transport

    received: list[Any] = []

    def keep_frames(frames: Any, *args: Any) -> tuple[EngineRequest, list[bytes | None]]:
        received.append(frames)
        return decode_request_keys(frames, *args)

    monkeypatch.setattr(transport, "decode_request_keys", keep_frames)
    pixels = torch.randn(256, 1024)
    with RequestReceiver(ipc_address) as receiver, RequestSender(ipc_address) as sender:
        sender.send(make_request("view", pixels), timeout=WAIT)
        got = receiver.recv(timeout=WAIT)
        assert got is not None
        (frames,) = received
        assert all(isinstance(frame, zmq.Frame) for frame in frames)
        decoded = got.features[0].data["pixel_values"]
        assert decoded.data_ptr() == address(frames[1])  # no copy on the receiving side
        assert torch.equal(decoded, pixels)


def test_sender_keeps_tensors_alive_until_zmq_is_done(ipc_address: str) -> None:
    expected = torch.arange(1 << 20, dtype=torch.float32)
    with RequestSender(ipc_address) as sender:
        # Queued before any engine exists: ZMQ holds the frames, nothing else references them.
        with RequestReceiver(ipc_address) as receiver:
            tracker = sender.send(make_request("alive", expected.clone()), timeout=WAIT)
            gc.collect()
            got = receiver.recv(timeout=WAIT)
            assert got is not None
            assert torch.equal(got.features[0].data["pixel_values"], expected)
            tracker.wait(WAIT)


def test_send_times_out_without_an_engine(ipc_address: str) -> None:
    with RequestSender(ipc_address) as sender:
        with pytest.raises(TimeoutError, match="no engine"):
            sender.send(make_request(), timeout=0.05)


def test_queues_are_bounded_by_high_water_marks(ipc_address: str) -> None:
    big = torch.zeros(4 << 20, dtype=torch.uint8)  # 4 MiB per message
    with RequestReceiver(ipc_address, recv_hwm=1) as receiver:
        with RequestSender(ipc_address, send_hwm=1, linger=0) as sender:
            sent = 0
            with pytest.raises(TimeoutError):
                # The engine reads nothing: the queues and the kernel's socket buffer fill up,
                # and the sender must stop accepting long before this many messages.
                for _ in range(200):
                    sender.send(make_request(f"q{sent}", big), timeout=0.2)
                    sent += 1
            assert 1 <= sent < 200
            # Everything accepted is delivered once the engine reads again.
            got = [receiver.recv(timeout=WAIT) for _ in range(sent)]
            assert all(request is not None for request in got)


def envelope(sequence: int, session: bytes = b"raw-peer-session") -> bytes:
    """The delivery frame a RequestSender puts in front of a request, for a raw DEALER peer."""
    return Envelope(session, sequence, 0, 1).pack()


def replies(peer: zmq.Socket, count: int) -> list[Reply]:
    """The next ``count`` replies a receiver sent to a raw peer."""
    got = []
    for _ in range(count):
        assert peer.poll(int(WAIT * 1000))
        (frame,) = peer.recv_multipart()
        reply = unpack_reply(frame)
        assert reply is not None
        got.append(reply)
    return got


def test_malformed_messages_are_counted_logged_refused_and_skipped(
    ipc_address: str, context: zmq.Context, caplog: pytest.LogCaptureFixture
) -> None:
    limits = DecodeLimits(max_frames=4, max_total_bytes=1 << 20)
    peer = context.socket(zmq.DEALER)
    peer.connect(ipc_address)
    try:
        with RequestReceiver(ipc_address, limits=limits) as receiver:
            pickle_ext = msgpack.packb({"params": msgpack.ExtType(1, b"cos\nsystem\n")})
            bad = [
                [b"\xc1"],  # never-used msgpack byte
                [pickle_ext],
                [msgpack.packb({"schema_version": 1})],
                [b"\x90", b"a", b"b", b"c", b"d"],  # 5 frames > max_frames
                [b"\x90", bytes(600_000), bytes(600_000)],  # > max_total_bytes in total
                encode({"schema_version": 99}),
            ]
            for sequence, message in enumerate(bad):
                peer.send_multipart([envelope(sequence), *message])
            peer.send_multipart(encode_request(make_request("no envelope")))
            good = len(bad)
            peer.send_multipart([envelope(good), *encode_request(make_request("good"))])
            with caplog.at_level(logging.WARNING, logger="mmproc.wire.transport"):
                got = receiver.recv(timeout=WAIT)
            assert got is not None and got.request_id == "good"
            assert receiver.bad_messages == len(bad) + 1
            assert receiver.last_error is not None and "no mmproc delivery envelope" in str(
                receiver.last_error
            )
            logged = [record.getMessage() for record in caplog.records]
            assert len(logged) == len(bad) + 1
            assert any("pickle" in line for line in logged)
            assert any("more than 4 frames" in line for line in logged)
            assert any("larger than the limit" in line for line in logged)
            # Each one with an envelope was answered: refused with its reason, or acknowledged.
            answers = {
                reply.sequence: (reply.kind, reply.reason) for reply in replies(peer, good + 1)
            }
            assert answers[good] == ("ack", "")
            assert all(answers[sequence][0] == REFUSED for sequence in range(good))
            assert "schema version 99" in answers[good - 1][1]
            assert "pickle" in answers[1][1]
    finally:
        peer.close(linger=0)


def test_oversized_frame_is_refused_by_zmq_and_the_receiver_keeps_serving(
    ipc_address: str, context: zmq.Context
) -> None:
    limits = DecodeLimits(max_total_bytes=1 << 20)
    with RequestReceiver(ipc_address, limits=limits) as receiver:
        peer = context.socket(zmq.DEALER)
        peer.connect(ipc_address)
        try:
            # MAXMSGSIZE: libzmq drops the connection instead of buffering a 2 MiB frame.
            peer.send_multipart([envelope(0), b"\x90", bytes(2 << 20)])
        finally:
            peer.close(linger=1000)  # let it try to deliver: the receiver must refuse it
        with RequestSender(ipc_address, context=context) as sender:
            sender.send(make_request("after"), timeout=WAIT)
            got = receiver.recv(timeout=WAIT)
            assert got is not None and got.request_id == "after"
            assert receiver.received == 1  # the oversized message never surfaced


def test_iteration_yields_requests_until_stopped_from_another_thread(ipc_address: str) -> None:
    received: list[str] = []
    with RequestReceiver(ipc_address, poll_interval=0.01) as receiver:
        with RequestSender(ipc_address) as sender:
            for index in range(3):
                sender.send(make_request(f"it{index}"), timeout=WAIT)

            def stop_after_three() -> None:
                for request in receiver:
                    received.append(request.request_id)
                    if len(received) == 3:
                        break

            reader = threading.Thread(target=stop_after_three)
            reader.start()
            reader.join(WAIT)
            assert received == ["it0", "it1", "it2"]
            # stop() from this thread ends an iteration that is waiting for more.
            waiting = threading.Thread(
                target=lambda: received.extend(request.request_id for request in receiver)
            )
            waiting.start()
            receiver.stop()
            waiting.join(WAIT)
            assert not waiting.is_alive()


def test_recv_returns_none_on_timeout(ipc_address: str) -> None:
    with RequestReceiver(ipc_address) as receiver:
        assert receiver.recv(timeout=0.01) is None


def test_close_is_clean_and_idempotent(ipc_address: str, context: zmq.Context) -> None:
    sender = RequestSender(ipc_address, context=context)
    receiver = RequestReceiver(ipc_address, context=context)
    sender.send(make_request(), timeout=WAIT)
    assert receiver.recv(timeout=WAIT) is not None
    sender.close()
    sender.close()
    receiver.close()
    receiver.close()
    assert sender.closed and receiver.closed
    with pytest.raises(RuntimeError, match="closed"):
        sender.send(make_request())
    with pytest.raises(RuntimeError, match="closed"):
        receiver.recv(timeout=0)
    assert not context.closed  # a shared context is left to its owner


def test_owned_context_is_terminated_on_close(ipc_address: str) -> None:
    sender = RequestSender(ipc_address)
    sender.close()
    assert sender._context.closed


@pytest.mark.parametrize("address", ["inproc://x", "http://localhost", "", "127.0.0.1:5555"])
def test_only_ipc_and_tcp_addresses(address: str) -> None:
    with pytest.raises(ConfigurationError, match="ipc:// or tcp://"):
        RequestSender(address)
    with pytest.raises(ConfigurationError, match="ipc:// or tcp://"):
        RequestReceiver(address)


def test_bad_settings_are_configuration_errors(ipc_address: str) -> None:
    with pytest.raises(ConfigurationError, match="send_hwm"):
        RequestSender(ipc_address, send_hwm=0)
    with pytest.raises(ConfigurationError, match="recv_hwm"):
        RequestReceiver(ipc_address, recv_hwm=-1)
    with pytest.raises(ConfigurationError, match="threshold"):
        RequestSender(ipc_address, threshold=-5)
    with pytest.raises(ConfigurationError, match="max_frames"):
        DecodeLimits(max_frames=0)
    with pytest.raises(ConfigurationError, match="cannot be allowed"):
        DecodeLimits(allowed_dtypes={"|O"})
    with pytest.raises(ConfigurationError, match="max_prompt_tokens"):
        DecodeLimits(max_prompt_tokens=0)
    # token ids travel as '<i8': a receiver that could decode no request fails at start-up
    with pytest.raises(ConfigurationError, match="must allow the '<i8' dtype"):
        RequestReceiver(ipc_address, limits=DecodeLimits(allowed_dtypes={"uint8", "int64"}))
