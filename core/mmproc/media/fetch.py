"""Fetching ``http://`` and ``https://`` media with httpx, for clients that may not be trusted.

What a URL may reach is decided per hop — the URL and every redirect (followed here, one at a
time, at most ``RemoteMedia.max_redirects``):

* the scheme is http or https, and the host is on ``RemoteMedia.allowed_domains`` (if set);
* the addresses are checked where the connection is made: the transport's network backend
  resolves the host itself, refuses it if *any* address it resolves to is not public (see
  :func:`address_is_public`: every block of the IANA special-purpose registries that is not
  globally reachable, multicast, reserved, and all IPv6 outside ``2000::/3``; an IPv4 address
  inside an IPv4-mapped, NAT64 or 6to4 IPv6 address counts as itself, IPv4-compatible and
  Teredo addresses are refused) unless ``allow_private_addresses`` or ``allowed_networks``
  admits it, and connects to exactly the address it checked. A name cannot resolve to a public
  address for a check and to a private one for the connection, and TLS still verifies the
  certificate against the host name;
* environment proxies and ``.netrc`` are ignored (``trust_env=False``): a proxy would make the
  address check meaningless.

Then the body: ``Accept-Encoding: identity`` (a compressed response could expand past the byte
limit before being counted; a ``Content-Encoding`` other than identity is refused), a
``Content-Length`` over the limit is refused before reading, and the body is counted while it
streams.

Time: ``RemoteMedia.timeout_s`` (or ``MediaLimits.read_timeout_s`` when shorter) is a deadline
for the whole fetch — resolving, connecting, TLS, the status line, headers and body of every
hop. It is enforced by the network stream itself: every socket operation is given only the time
left until the deadline, and none starts after it, so a peer that trickles its bytes (each in
time for a read timeout, which restarts on every byte) is cut off at the deadline all the same.
Host names are looked up on a thread of their own, so that a slow resolver is cut off too (the
lookup itself runs on until the system resolver gives up).

Every failure is a :class:`~mmproc.media.problem.MediaProblem` naming the host (never the full
URL: signed URLs carry secrets) and the limit, in a bounded message.
"""

from __future__ import annotations

import contextvars
import functools
import ipaddress
import socket
import ssl
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any, cast

import httpcore
import httpx

from mmproc.media.policy import IPNetwork, MediaLimits, RemoteMedia
from mmproc.media.problem import MediaProblem

__all__ = ["address_is_public", "fetch_url", "host_is_allowed"]

_REDIRECTS = frozenset({301, 302, 303, 307, 308})
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


# Refusals quote at most this much of a host, scheme or error text: the bound of
# mmproc.media.sources.QUOTE_CHARS, kept here because sources imports this module (lazily) and
# the core's import graph has no circles.
_QUOTE_CHARS = 200


def _shortened(text: str) -> str:
    return text if len(text) <= _QUOTE_CHARS else text[:_QUOTE_CHARS] + "…"


def _quoted(text: str) -> str:
    return repr(_shortened(text))


class _ForbiddenAddress(Exception):
    """Raised by the network backend; the fetch turns it into a MediaProblem."""


# The deadline (time.monotonic()) of the fetch running on this thread: connections are pooled
# and shared between fetches, so the deadline travels with the caller, not with the connection.
_DEADLINE: contextvars.ContextVar[float | None] = contextvars.ContextVar(
    "mmproc_fetch_deadline", default=None
)


def _time_left(timeout: float | None, expired: type[Exception]) -> float | None:
    """``timeout`` cut to the time left before this thread's fetch deadline; raises
    ``expired`` once the deadline has passed."""
    deadline = _DEADLINE.get()
    if deadline is None:
        return timeout
    left = deadline - time.monotonic()
    if left <= 0:
        raise expired("the fetch deadline has passed")
    return left if timeout is None else min(timeout, left)


class _DeadlineStream(httpcore.NetworkStream):
    """A network stream whose every operation ends by the fetch deadline.

    A plain socket read returns as soon as any byte arrives, and CPython's TLS reads and
    handshakes treat the socket timeout as a deadline for the whole call, so giving each call
    only the time left is enough.
    """

    def __init__(self, stream: httpcore.NetworkStream) -> None:
        self._stream = stream

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return self._stream.read(max_bytes, _time_left(timeout, httpcore.ReadTimeout))

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self._stream.write(buffer, _time_left(timeout, httpcore.WriteTimeout))

    def close(self) -> None:
        self._stream.close()

    def start_tls(
        self,
        ssl_context: ssl.SSLContext,
        server_hostname: str | None = None,
        timeout: float | None = None,
    ) -> httpcore.NetworkStream:
        left = _time_left(timeout, httpcore.ConnectTimeout)
        return _DeadlineStream(self._stream.start_tls(ssl_context, server_hostname, left))

    def get_extra_info(self, info: str) -> Any:
        return self._stream.get_extra_info(info)


def _resolve(host: str, port: int, timeout: float | None) -> list[Any]:
    """``getaddrinfo`` for a TCP connection, given up on at the deadline.

    getaddrinfo takes no timeout, so a name is looked up on a thread of its own that the caller
    stops waiting for at its deadline (a daemon thread: one left behind ends when the system
    resolver gives up, and never holds up the interpreter's exit).
    """
    try:
        ipaddress.ip_address(host)
    except ValueError:
        pass
    else:  # a literal: nothing to look up
        return socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    wait = _time_left(timeout, httpcore.ConnectTimeout)
    outcome: list[list[Any] | Exception] = []
    done = threading.Event()

    def lookup() -> None:
        try:
            outcome.append(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM))
        except Exception as exc:  # raised on the caller's thread instead
            outcome.append(exc)
        finally:
            done.set()

    threading.Thread(target=lookup, name="mmproc-resolve", daemon=True).start()
    if not done.wait(wait):
        raise httpcore.ConnectTimeout("the host name lookup did not finish in time")
    if isinstance(outcome[0], Exception):
        raise outcome[0]
    return outcome[0]


def _networks(*cidrs: str) -> tuple[IPNetwork, ...]:
    return tuple(ipaddress.ip_network(cidr) for cidr in cidrs)


# The IANA special-purpose address registries (IPv4 and IPv6, as of 2025): the blocks not
# globally reachable, and the entries inside them that are. Kept here rather than taken from
# ipaddress.is_global, whose answer changes between Python releases (3.11 calls ::127.0.0.1,
# fec0::/10 and 64:ff9b:1::/48 global).
_V4_NOT_PUBLIC = _networks(
    "0.0.0.0/8",  # this network
    "10.0.0.0/8",  # private
    "100.64.0.0/10",  # shared (carrier-grade NAT)
    "127.0.0.0/8",  # loopback
    "169.254.0.0/16",  # link-local (cloud metadata services)
    "172.16.0.0/12",  # private
    "192.0.0.0/24",  # IETF protocol assignments (DS-Lite, NAT64 discovery, ...)
    "192.0.2.0/24",  # documentation
    "192.88.99.0/24",  # 6to4 relay anycast (deprecated)
    "192.168.0.0/16",  # private
    "198.18.0.0/15",  # benchmarking
    "198.51.100.0/24",  # documentation
    "203.0.113.0/24",  # documentation
    "224.0.0.0/4",  # multicast
    "240.0.0.0/4",  # reserved, and the limited broadcast address
)
_V4_PUBLIC_INSIDE = _networks("192.0.0.9/32", "192.0.0.10/32")  # PCP and TURN anycast
# IANA allocates global unicast from 2000::/3 only: everything outside is not public, whatever
# it is (::/96 IPv4-compatible, ::ffff:0:0:0/96 translated, 64:ff9b:1::/48 local-use NAT64,
# 100::/64 discard, 5f00::/16 SRv6, fc00::/7, fe80::/10, fec0::/10, ff00::/8, unallocated).
_V6_GLOBAL_UNICAST = ipaddress.ip_network("2000::/3")
_V6_NOT_PUBLIC = _networks(
    "2001::/23",  # IETF protocol assignments: Teredo, benchmarking, ORCHID, ...
    "2001:db8::/32",  # documentation
    "3fff::/20",  # documentation
)
_V6_PUBLIC_INSIDE = _networks(
    "2001:1::1/128",  # PCP anycast
    "2001:1::2/128",  # TURN anycast
    "2001:1::3/128",  # DNS-SD service registration anycast
    "2001:3::/32",  # AMT
    "2001:4:112::/48",  # AS112-v6
    "2001:20::/28",  # ORCHIDv2
    "2001:30::/28",  # drone remote ID
)
_MAPPED = ipaddress.ip_network("::ffff:0:0/96")
_SIXTOFOUR = ipaddress.ip_network("2002::/16")


def _embedded_ipv4(address: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    """The IPv4 address traffic to ``address`` reaches: IPv4-mapped, well-known NAT64 and 6to4
    addresses carry it. (Teredo's also does, but Teredo is refused whole.)"""
    if address in _MAPPED or address in _NAT64:
        return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    if address in _SIXTOFOUR:
        return ipaddress.IPv4Address((int(address) >> 80) & 0xFFFFFFFF)
    return None


def address_is_public(address: _IPAddress) -> bool:
    """Whether ``address`` is a public unicast address: outside every block of the IANA
    special-purpose registries that is not globally reachable, and outside multicast and
    reserved space. An IPv6 address that carries an IPv4 one (IPv4-mapped, well-known NAT64
    ``64:ff9b::/96``, 6to4 ``2002::/16``) is judged by the IPv4 address; deprecated
    IPv4-compatible ``::a.b.c.d``, Teredo ``2001::/32``, the local-use NAT64 prefix
    ``64:ff9b:1::/48`` and anything outside ``2000::/3`` are not public."""
    if isinstance(address, ipaddress.IPv6Address):
        embedded = _embedded_ipv4(address)
        if embedded is not None:
            return address_is_public(embedded)
        if address not in _V6_GLOBAL_UNICAST:
            return False
        if any(address in network for network in _V6_PUBLIC_INSIDE):
            return True
        return not any(address in network for network in _V6_NOT_PUBLIC)
    if any(address in network for network in _V4_PUBLIC_INSIDE):
        return True
    return not any(address in network for network in _V4_NOT_PUBLIC)


def _address_allowed(address: _IPAddress, remote: RemoteMedia) -> bool:
    if remote.allow_private_addresses or address_is_public(address):
        return True
    return any(address in network for network in remote.allowed_networks)


def host_is_allowed(host: str, allowed_domains: tuple[str, ...] | None) -> bool:
    """Whether ``host`` matches the allow-list (``None``: every host does): an entry
    ``"example.com"`` matches that host, ``"*.example.com"`` its subdomains."""
    if allowed_domains is None:
        return True
    host = host.lower().rstrip(".")
    for domain in allowed_domains:
        if domain.startswith("*."):
            if host.endswith(domain[1:]):
                return True
        elif host == domain:
            return True
    return False


class _CheckedAddressBackend(httpcore.SyncBackend):
    """Resolves each host itself and connects only to addresses the policy admits."""

    def __init__(self, remote: RemoteMedia) -> None:
        self._remote = remote

    def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.NetworkStream:
        try:
            infos = _resolve(host, port, timeout)
        except OSError as exc:
            raise httpcore.ConnectError(f"cannot resolve {host!r}: {exc}") from exc
        addresses: list[_IPAddress] = []
        for *_, sockaddr in infos:
            address = ipaddress.ip_address(str(sockaddr[0]).split("%", 1)[0])
            if not _address_allowed(address, self._remote):
                raise _ForbiddenAddress(
                    f"{_shortened(host)} resolves to {address}, which is not a public address "
                    "(RemoteMedia.allow_private_addresses / allowed_networks)"
                )
            if address not in addresses:
                addresses.append(address)
        error: Exception = httpcore.ConnectError(f"no address for {host!r}")
        for address in addresses:
            left = _time_left(timeout, httpcore.ConnectTimeout)
            try:
                stream = super().connect_tcp(
                    str(address), port, left, local_address, socket_options
                )
            except httpcore.ConnectError as exc:
                error = exc
            else:
                return _DeadlineStream(stream)
        raise error


class _PoolStream(httpx.SyncByteStream):
    def __init__(self, response: httpcore.Response) -> None:
        self._response = response

    def __iter__(self) -> Iterator[bytes]:
        # httpcore's sync pool always answers with a sync stream.
        yield from cast(Iterable[bytes], self._response.stream)

    def close(self) -> None:
        self._response.close()


class _CheckedTransport(httpx.BaseTransport):
    """An httpx transport over an httpcore pool whose connections go to checked addresses only
    (httpx's own transport takes no network backend)."""

    def __init__(self, remote: RemoteMedia) -> None:
        self._pool = httpcore.ConnectionPool(
            ssl_context=httpx.create_ssl_context(),
            network_backend=_CheckedAddressBackend(remote),
            max_connections=32,
            max_keepalive_connections=8,
        )

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = self._pool.handle_request(
            httpcore.Request(
                method=request.method,
                url=httpcore.URL(
                    scheme=request.url.raw_scheme,
                    host=request.url.raw_host,
                    port=request.url.port,
                    target=request.url.raw_path,
                ),
                headers=request.headers.raw,
                content=cast(Iterable[bytes], request.stream),  # a sync client's request
                extensions=request.extensions,
            )
        )
        return httpx.Response(
            status_code=response.status,
            headers=response.headers,
            stream=_PoolStream(response),
            extensions=response.extensions,
        )

    def close(self) -> None:
        self._pool.close()


@functools.lru_cache(maxsize=16)
def _client(remote: RemoteMedia) -> httpx.Client:
    # One client (and connection pool) per policy: connections are reused across requests, and
    # a connection is only ever made by the backend that checked its address.
    return httpx.Client(
        transport=_CheckedTransport(remote),
        trust_env=False,
        follow_redirects=False,
        headers={"Accept-Encoding": "identity"},
    )


def _byte_limit(remote: RemoteMedia, limits: MediaLimits) -> tuple[int | None, str]:
    """The smaller of the two byte limits, and its name."""
    candidates = [
        (value, name)
        for value, name in (
            (remote.max_bytes, "RemoteMedia.max_bytes"),
            (limits.max_item_bytes, "MediaLimits.max_item_bytes"),
        )
        if value is not None
    ]
    return min(candidates) if candidates else (None, "")


def _time_limit(remote: RemoteMedia, limits: MediaLimits) -> tuple[float, str]:
    """The shorter of the two time limits, and its name."""
    if limits.read_timeout_s is not None and limits.read_timeout_s < remote.timeout_s:
        return limits.read_timeout_s, "MediaLimits.read_timeout_s"
    return remote.timeout_s, "RemoteMedia.timeout_s"


def _check_hop(url: httpx.URL, remote: RemoteMedia, hop: int) -> None:
    where = "the URL" if hop == 0 else f"redirect {hop}"
    if url.scheme not in ("http", "https"):
        raise MediaProblem(
            f"{where} has scheme {_quoted(url.scheme)}; only http and https are fetched"
        )
    if not url.host:
        raise MediaProblem(f"{where} has no host")
    if not host_is_allowed(url.host, remote.allowed_domains):
        raise MediaProblem(
            f"{where} goes to {_shortened(url.host)}, which is not an allowed domain "
            "(RemoteMedia.allowed_domains)"
        )


def fetch_url(url: str, remote: RemoteMedia, limits: MediaLimits) -> bytes:
    """Download ``url`` under ``remote``'s policy and the byte and time limits (see the module
    docstring).

    Raises:
        MediaProblem: refused, failed, or over a limit.
    """
    try:
        current = httpx.URL(url)
    except (httpx.InvalidURL, ValueError, TypeError) as exc:
        raise MediaProblem(f"invalid URL: {_shortened(str(exc))}") from exc
    timeout, timeout_name = _time_limit(remote, limits)
    deadline = time.monotonic() + timeout
    host = _shortened(current.host)
    token = _DEADLINE.set(deadline)
    try:
        for hop in range(remote.max_redirects + 1):
            _check_hop(current, remote, hop)
            host = _shortened(current.host)
            location = _get(current, remote, limits, deadline)
            if isinstance(location, bytes):
                return location
            current = current.join(location)
        raise MediaProblem(
            f"more than {remote.max_redirects} redirects (RemoteMedia.max_redirects)"
        )
    except MediaProblem:
        raise
    except _ForbiddenAddress as exc:
        raise MediaProblem(str(exc)) from exc
    except (httpx.TimeoutException, httpcore.TimeoutException) as exc:
        raise MediaProblem(
            f"fetching from {host} took longer than the limit of {timeout:g} s ({timeout_name})"
        ) from exc
    except Exception as exc:  # any transport failure is this item's failure, not the server's
        raise MediaProblem(
            f"cannot fetch from {host}: {type(exc).__name__}: {_shortened(str(exc))}"
        ) from exc
    finally:
        _DEADLINE.reset(token)


def _get(url: httpx.URL, remote: RemoteMedia, limits: MediaLimits, deadline: float) -> bytes | str:
    """The body of ``url``, or the ``Location`` it redirects to."""
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise httpx.TimeoutException("deadline passed before the request")
    client = _client(remote)
    host = _shortened(url.host)
    request = client.build_request("GET", url, timeout=httpx.Timeout(remaining))
    response = client.send(request, stream=True)
    try:
        if response.status_code in _REDIRECTS and "location" in response.headers:
            return response.headers["location"]
        if response.status_code != 200:
            raise MediaProblem(f"{host} answered HTTP {response.status_code}")
        encoding = response.headers.get("content-encoding", "identity").strip().lower()
        if encoding not in ("", "identity"):
            raise MediaProblem(
                f"{host} sent Content-Encoding {_quoted(encoding)}; only identity is accepted"
            )
        limit, limit_name = _byte_limit(remote, limits)
        declared = response.headers.get("content-length", "")
        if limit is not None and declared.isdigit() and int(declared) > limit:
            raise MediaProblem(
                f"{host} declares {int(declared):,} bytes, over the limit of {limit:,} "
                f"bytes ({limit_name})"
            )
        body = bytearray()
        for chunk in response.iter_raw():  # each read ends by the deadline (_DeadlineStream)
            body += chunk
            if limit is not None and len(body) > limit:
                raise MediaProblem(
                    f"{host} sent more than {limit:,} bytes, the limit ({limit_name})"
                )
        return bytes(body)
    finally:
        response.close()
