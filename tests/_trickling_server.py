"""A hostile HTTP peer for the fetch tests and benchmarks/hostile_media.py: a raw TCP server on
127.0.0.1 that answers every connection by sending its bytes one at a time, slowly.

Each byte arrives well within any read timeout, so only a deadline on the whole fetch ends it.
"""

from __future__ import annotations

import socket
import threading
from types import TracebackType
from typing import Self

HEADERS = b"HTTP/1.1 200 OK\r\nContent-Type: image/png\r\nX-Padding: " + b"a" * 100_000
"""A status line and headers that never end (within any test): what a trickler sends."""

_BODY_HEAD = b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n"
BODY = _BODY_HEAD + bytes(100_000)
"""A response whose body comes one byte at a time; send its first ``BODY_BURST`` bytes (the
headers) at once."""
BODY_BURST = len(_BODY_HEAD)

TLS_RECORD = b"\x16\x03\x03\x40\x00" + bytes(16_384)
"""A TLS handshake record header announcing 16 KiB, then the record one byte at a time."""


class TricklingServer:
    """Listens on 127.0.0.1 (an ephemeral port) and sends ``payload`` to every client, the first
    ``burst`` bytes at once and then one byte every ``interval`` seconds, until the payload is
    sent, the client hangs up or the server is closed. Use as a context manager."""

    def __init__(self, payload: bytes, *, interval: float = 0.05, burst: int = 0) -> None:
        self._payload = payload
        self._interval = interval
        self._burst = burst
        self._stop = threading.Event()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.1)
        self._clients: list[socket.socket] = []
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        """The port it listens on."""
        return int(self._listener.getsockname()[1])

    def url(self, scheme: str = "http", path: str = "/cat.png") -> str:
        """A URL naming this server."""
        return f"{scheme}://127.0.0.1:{self.port}{path}"

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with self._lock:
                self._clients.append(client)
            threading.Thread(target=self._trickle, args=(client,), daemon=True).start()

    def _trickle(self, client: socket.socket) -> None:
        try:
            client.settimeout(1.0)
            try:
                client.recv(65536)  # the request (or a TLS ClientHello): its content is ignored
            except TimeoutError:
                pass
            client.sendall(self._payload[: self._burst])
            for index in range(self._burst, len(self._payload)):
                if self._stop.wait(self._interval):
                    return
                client.sendall(self._payload[index : index + 1])
        except OSError:
            pass  # the client gave up, as it should
        finally:
            client.close()

    def close(self) -> None:
        """Stop trickling and close every connection."""
        self._stop.set()
        self._listener.close()
        with self._lock:
            for client in self._clients:
                try:
                    client.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        self._thread.join(5)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
