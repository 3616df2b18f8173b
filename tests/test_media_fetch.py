"""mmproc.media.fetch: http(s) media fetched with httpx under a policy — tested against a real
HTTP server on 127.0.0.1 that can redirect, send too much, stall and trickle. Every refusal is a
MediaItemError, after which a good URL is still fetched."""

from __future__ import annotations

import io
import ipaddress
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

import numpy as np
import pytest
from _trickling_server import BODY, BODY_BURST, HEADERS, TLS_RECORD, TricklingServer
from mmproc.errors import MediaItemError
from mmproc.hashing import hash_item
from mmproc.inputs import parse_mm_data
from mmproc.media import MediaLimits, MediaOptions, RemoteMedia
from mmproc.media.fetch import address_is_public, host_is_allowed
from mmproc.testing.samples import encode_audio, encode_video, numbered_frames, tone
from PIL import Image

MEDIA: dict[str, bytes] = {}
LOOPBACK = MediaOptions(remote=RemoteMedia(allowed_networks=("127.0.0.1/32",)))


def _png() -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.full((12, 16, 3), 99, np.uint8)).save(buf, "PNG")
    return buf.getvalue()


class _Handler(BaseHTTPRequestHandler):
    """Routes: /media/<name>, /redirect/<n>/<name>, /to?u=<url>, /endless, /huge, /stall,
    /trickle, /gzip, and 404 for anything else."""

    stop: threading.Event

    def log_message(self, *args: Any) -> None:  # keep the test output clean
        pass

    def _head(self, status: int = 200, **headers: str) -> None:
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name.replace("_", "-"), value)
        self.end_headers()

    def do_GET(self) -> None:
        url = urlparse(self.path)
        parts = url.path.strip("/").split("/")
        try:
            if parts[0] == "media" and parts[1] in MEDIA:
                body = MEDIA[parts[1]]
                self._head(Content_Length=str(len(body)))
                self.wfile.write(body)
            elif parts[0] == "redirect":
                hops, name = int(parts[1]), parts[2]
                target = f"/redirect/{hops - 1}/{name}" if hops > 1 else f"/media/{name}"
                self._head(302, Location=target, Content_Length="0")
            elif parts[0] == "to":
                self._head(302, Location=parse_qs(url.query)["u"][0], Content_Length="0")
            elif parts[0] == "endless":  # no Content-Length: the body ends when it ends
                self._head()
                for _ in range(256):
                    self.wfile.write(bytes(1 << 16))
            elif parts[0] == "huge":
                self._head(Content_Length=str(10**9))
                self.wfile.write(bytes(1000))
            elif parts[0] == "stall":
                self._head(Content_Length="1000")
                self.wfile.write(b"x")
                self.wfile.flush()
                self.stop.wait(30)
            elif parts[0] == "trickle":
                self._head(Content_Length="100000")
                for _ in range(1000):
                    self.wfile.write(bytes(100))
                    self.wfile.flush()
                    if self.stop.wait(0.02):
                        break
            elif parts[0] == "gzip":
                self._head(Content_Encoding="gzip", Content_Length="4")
                self.wfile.write(b"\x1f\x8b\x08\x00")
            else:
                self._head(404, Content_Length="0")
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client gave up, as it should


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    """The base URL of a local HTTP server serving MEDIA."""
    MEDIA.update(
        {
            "cat.png": _png(),
            "clip.mp4": encode_video(numbered_frames(20)),
            "tone.mp3": encode_audio(tone(0.5, 16000), 16000, "mp3"),
        }
    )
    stop = threading.Event()
    handler = type("Handler", (_Handler,), {"stop": stop})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    stop.set()
    httpd.shutdown()
    httpd.server_close()


def _refused(url: str, options: MediaOptions, base: str) -> MediaItemError:
    """Fetch ``url`` as an image, return the error — once a good URL has been seen to be fetched
    with the same options after it."""
    with pytest.raises(MediaItemError) as info:
        parse_mm_data({"image": [url]}, media=options)
    assert (info.value.modality, info.value.index) == ("image", 0)
    good = parse_mm_data({"image": f"{base}/media/cat.png"}, media=options)["image"][0]
    assert good.size == (16, 12)
    return info.value


def _remote(**kwargs: Any) -> MediaOptions:
    return MediaOptions(remote=RemoteMedia(allowed_networks=("127.0.0.1/32",), **kwargs))


# --- fetching -----------------------------------------------------------------------------------


def test_image_video_and_audio_urls_give_what_their_bytes_give(server: str) -> None:
    for modality, name in [("image", "cat.png"), ("video", "clip.mp4"), ("audio", "tone.mp3")]:
        from_url = parse_mm_data({modality: f"{server}/media/{name}"}, media=LOOPBACK)[modality]
        from_bytes = parse_mm_data({modality: MEDIA[name]})[modality]
        assert hash_item(modality, from_url[0]) == hash_item(modality, from_bytes[0]), modality


def test_several_urls_in_one_request(server: str) -> None:
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:
        parsed = parse_mm_data(
            {"image": [f"{server}/media/cat.png"] * 3, "video": f"{server}/media/clip.mp4"},
            io_pool=pool,
            media=LOOPBACK,
        )
    assert [len(parsed["image"]), len(parsed["video"])] == [3, 1]


def test_redirects_are_followed_up_to_the_limit(server: str) -> None:
    options = _remote(max_redirects=3)
    assert parse_mm_data({"image": f"{server}/redirect/3/cat.png"}, media=options)["image"]
    err = _refused(f"{server}/redirect/4/cat.png", options, server)
    assert err.reason == "more than 3 redirects (RemoteMedia.max_redirects)"
    no_redirects = _remote(max_redirects=0)
    assert (
        "more than 0 redirects"
        in _refused(f"{server}/redirect/1/cat.png", no_redirects, server).reason
    )


def test_environment_proxies_are_ignored(server: str, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("HTTP_PROXY", "http_proxy", "ALL_PROXY"):
        monkeypatch.setenv(name, "http://127.0.0.1:9")  # nothing listens there
    options = _remote(timeout_s=9.5)  # a policy no earlier test used: a new client
    assert parse_mm_data({"image": f"{server}/media/cat.png"}, media=options)["image"]


# --- addresses and domains ------------------------------------------------------------------------


def test_loopback_is_refused_by_default(server: str) -> None:
    url = f"{server}/media/cat.png"
    with pytest.raises(MediaItemError) as info:
        parse_mm_data({"image": url}, media=MediaOptions(remote=RemoteMedia()))
    assert info.value.reason == (
        "127.0.0.1 resolves to 127.0.0.1, which is not a public address "
        "(RemoteMedia.allow_private_addresses / allowed_networks)"
    )
    assert parse_mm_data({"image": url}, media=LOOPBACK)["image"]


def test_a_name_is_checked_by_the_addresses_it_resolves_to(server: str) -> None:
    port = server.rsplit(":", 1)[1]
    with pytest.raises(MediaItemError) as info:
        parse_mm_data(
            {"image": f"http://localhost:{port}/media/cat.png"},
            media=MediaOptions(remote=RemoteMedia()),
        )
    assert info.value.reason.startswith("localhost resolves to ")
    assert "which is not a public address" in info.value.reason


@pytest.mark.parametrize(
    "target",
    [
        "http://127.0.0.2:{port}/media/cat.png",  # loopback outside the allowed network
        "http://169.254.169.254/latest/meta-data/",  # a cloud metadata service
        "http://10.0.0.1/",
        "http://[::1]:{port}/",
    ],
)
def test_a_redirect_to_a_private_address_is_refused(server: str, target: str) -> None:
    port = server.rsplit(":", 1)[1]
    url = f"{server}/to?u={target.format(port=port)}"
    err = _refused(url, LOOPBACK, server)
    assert "which is not a public address" in err.reason


def test_the_allowed_domains_are_checked_on_every_hop(server: str) -> None:
    port = server.rsplit(":", 1)[1]
    options = _remote(allowed_domains=("127.0.0.1",))
    assert parse_mm_data({"image": f"{server}/media/cat.png"}, media=options)["image"]
    err = _refused(f"{server}/to?u=http://localhost:{port}/media/cat.png", options, server)
    assert err.reason == (
        "redirect 1 goes to localhost, which is not an allowed domain (RemoteMedia.allowed_domains)"
    )
    elsewhere = _remote(allowed_domains=("media.example.com",))
    with pytest.raises(
        MediaItemError, match=r"the URL goes to 127\.0\.0\.1, which is not an allowed"
    ):
        parse_mm_data({"image": f"{server}/media/cat.png"}, media=elsewhere)


def test_a_redirect_to_another_scheme_is_refused(server: str) -> None:
    err = _refused(f"{server}/to?u=file:///etc/passwd", LOOPBACK, server)
    assert err.reason == "redirect 1 has scheme 'file'; only http and https are fetched"


# (address, public?, why): the IANA special-purpose registries (IPv4 and IPv6), IPv4 forms inside
# IPv6, and ordinary public addresses.
ADDRESSES = [
    ("8.8.8.8", True, "public IPv4"),
    ("1.1.1.1", True, "public IPv4"),
    ("2001:4860:4860::8888", True, "public IPv6"),
    ("2606:4700::1111", True, "public IPv6"),
    ("::ffff:8.8.8.8", True, "IPv4-mapped public address"),
    ("64:ff9b::808:808", True, "well-known NAT64 of 8.8.8.8"),
    ("2002:808:808::1", True, "6to4 of 8.8.8.8"),
    ("192.0.0.9", True, "PCP anycast (globally reachable in the registry)"),
    ("192.31.196.1", True, "AS112-v4"),
    ("2001:1::1", True, "PCP anycast"),
    ("2001:3::1", True, "AMT"),
    ("2001:4:112::1", True, "AS112-v6"),
    ("2001:20::1", True, "ORCHIDv2"),
    ("0.0.0.0", False, "this host"),
    ("0.1.2.3", False, "this network"),
    ("10.1.2.3", False, "private"),
    ("100.64.0.1", False, "carrier-grade NAT"),
    ("127.0.0.1", False, "loopback"),
    ("169.254.169.254", False, "link-local (cloud metadata)"),
    ("172.16.0.1", False, "private"),
    ("192.0.0.1", False, "IETF protocol assignments"),
    ("192.0.0.170", False, "NAT64 discovery"),
    ("192.0.2.1", False, "documentation"),
    ("192.88.99.1", False, "deprecated 6to4 relay anycast"),
    ("192.168.1.1", False, "private"),
    ("198.18.0.1", False, "benchmarking"),
    ("198.51.100.1", False, "documentation"),
    ("203.0.113.1", False, "documentation"),
    ("224.0.0.1", False, "multicast"),
    ("240.0.0.1", False, "reserved"),
    ("255.255.255.255", False, "broadcast"),
    ("::", False, "unspecified"),
    ("::1", False, "loopback"),
    ("::127.0.0.1", False, "IPv4-compatible (deprecated) of loopback"),
    ("::169.254.169.254", False, "IPv4-compatible of link-local"),
    ("::8.8.8.8", False, "IPv4-compatible: deprecated, whatever it embeds"),
    ("::ffff:127.0.0.1", False, "IPv4-mapped loopback"),
    ("::ffff:169.254.169.254", False, "IPv4-mapped link-local"),
    ("::ffff:0:127.0.0.1", False, "IPv4-translated (SIIT)"),
    ("64:ff9b::a00:1", False, "well-known NAT64 of 10.0.0.1"),
    ("64:ff9b::7f00:1", False, "well-known NAT64 of 127.0.0.1"),
    ("64:ff9b:1::808:808", False, "local-use NAT64 prefix"),
    ("100::1", False, "discard-only"),
    ("100:0:0:1::1", False, "dummy prefix"),
    ("2001::1", False, "Teredo"),
    ("2001:0:4136:e378:8000:63bf:3fff:fdd2", False, "Teredo with a public server"),
    ("2001:2::1", False, "benchmarking"),
    ("2001:10::1", False, "deprecated ORCHID"),
    ("2001:db8::1", False, "documentation"),
    ("2002:7f00:1::", False, "6to4 of 127.0.0.1"),
    ("2002:a9fe:a9fe::1", False, "6to4 of 169.254.169.254"),
    ("3fff::1", False, "documentation (2024)"),
    ("5f00::1", False, "SRv6 SIDs"),
    ("fc00::1", False, "unique local"),
    ("fd12:3456::1", False, "unique local"),
    ("fe80::1", False, "link-local"),
    ("fec0::1", False, "site-local (deprecated)"),
    ("ff02::1", False, "multicast"),
    ("4000::1", False, "unallocated (outside 2000::/3)"),
]


@pytest.mark.parametrize(
    ("address", "public"), [(a, p) for a, p, _ in ADDRESSES], ids=[w for *_, w in ADDRESSES]
)
def test_an_address_is_public_only_outside_every_special_purpose_range(
    address: str, public: bool
) -> None:
    assert address_is_public(ipaddress.ip_address(address)) is public


@pytest.mark.parametrize("target", ["[::127.0.0.1]", "[::ffff:7f00:1]", "[64:ff9b::7f00:1]"])
def test_an_ipv6_form_of_loopback_is_refused_where_it_is_connected_to(
    server: str, target: str
) -> None:
    port = server.rsplit(":", 1)[1]
    err = _refused(f"{server}/to?u=http://{target}:{port}/media/cat.png", LOOPBACK, server)
    assert "which is not a public address" in err.reason


def test_domain_patterns() -> None:
    domains = ("example.com", "*.cdn.example.org")
    assert host_is_allowed("example.com", domains)
    assert host_is_allowed("EXAMPLE.com.", domains)
    assert not host_is_allowed("www.example.com", domains)
    assert not host_is_allowed("evil-example.com", domains)
    assert host_is_allowed("a.cdn.example.org", domains)
    assert host_is_allowed("a.b.cdn.example.org", domains)
    assert not host_is_allowed("cdn.example.org", domains)
    assert not host_is_allowed("xcdn.example.org", domains)
    assert host_is_allowed("anything.test", None)


# --- bytes and time -------------------------------------------------------------------------------


def test_a_body_over_the_limit_is_cut_while_streaming(server: str) -> None:
    err = _refused(f"{server}/endless", _remote(max_bytes=100_000), server)
    assert err.reason == "127.0.0.1 sent more than 100,000 bytes, the limit (RemoteMedia.max_bytes)"


def test_a_declared_length_over_the_limit_is_refused_before_reading(server: str) -> None:
    err = _refused(f"{server}/huge", LOOPBACK, server)
    assert err.reason == (
        "127.0.0.1 declares 1,000,000,000 bytes, over the limit of 268,435,456 bytes "
        "(MediaLimits.max_item_bytes)"
    )


def test_the_smaller_byte_limit_applies(server: str) -> None:
    options = MediaOptions(
        remote=RemoteMedia(allowed_networks=("127.0.0.1/32",), max_bytes=1_000_000),
        limits=MediaLimits(max_item_bytes=50_000),
    )
    err = _refused(f"{server}/endless", options, server)
    assert err.reason.endswith("the limit (MediaLimits.max_item_bytes)")


def test_a_stalled_server_times_out(server: str) -> None:
    err = _refused(f"{server}/stall", _remote(timeout_s=0.5), server)
    assert err.reason == (
        "fetching from 127.0.0.1 took longer than the limit of 0.5 s (RemoteMedia.timeout_s)"
    )


def test_a_trickling_server_hits_the_deadline(server: str) -> None:
    # Each chunk arrives well within the read timeout; the whole never does.
    err = _refused(f"{server}/trickle", _remote(timeout_s=0.5), server)
    assert err.reason == (
        "fetching from 127.0.0.1 took longer than the limit of 0.5 s (RemoteMedia.timeout_s)"
    )


DEADLINE_S = 1.0
HANG_GUARD_S = 10 * DEADLINE_S  # a fetch not refused by then would trickle on for minutes


def _refused_within_the_hang_guard(url: str, options: MediaOptions) -> MediaItemError:
    """Fetch ``url`` on a thread; the error it ends with, once it has ended within the guard."""
    outcome: list[BaseException | None] = []

    def fetch() -> None:
        try:
            parse_mm_data({"image": url}, media=options)
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=fetch, daemon=True)
    thread.start()
    thread.join(HANG_GUARD_S)
    assert outcome, f"the fetch was still running after {HANG_GUARD_S:g} s"
    assert isinstance(outcome[0], MediaItemError), outcome[0]
    return outcome[0]


@pytest.mark.parametrize(
    ("payload", "burst", "url"),
    [
        (HEADERS, 0, lambda trickler, base: trickler.url()),
        (BODY, BODY_BURST, lambda trickler, base: trickler.url()),
        (TLS_RECORD, 0, lambda trickler, base: trickler.url("https")),
        (HEADERS, 0, lambda trickler, base: f"{base}/to?u={trickler.url()}"),
    ],
    ids=["status-and-headers", "body", "tls-handshake", "after-a-redirect"],
)
def test_a_fetch_whose_server_trickles_is_refused_at_the_deadline(
    server: str,
    payload: bytes,
    burst: int,
    url: Callable[[TricklingServer, str], str],
) -> None:
    # One byte every 50 ms: each read returns long before any read timeout would fire.
    options = _remote(timeout_s=DEADLINE_S)
    with TricklingServer(payload, interval=0.05, burst=burst) as trickler:
        err = _refused_within_the_hang_guard(url(trickler, server), options)
    assert err.reason == (
        f"fetching from 127.0.0.1 took longer than the limit of {DEADLINE_S:g} s "
        "(RemoteMedia.timeout_s)"
    )
    assert parse_mm_data({"image": f"{server}/media/cat.png"}, media=options)["image"]


def test_the_shorter_time_limit_applies(server: str) -> None:
    options = MediaOptions(
        remote=RemoteMedia(allowed_networks=("127.0.0.1/32",), timeout_s=30),
        limits=MediaLimits(read_timeout_s=0.5),
    )
    err = _refused(f"{server}/stall", options, server)
    assert err.reason.endswith("the limit of 0.5 s (MediaLimits.read_timeout_s)")


def test_compressed_responses_are_refused(server: str) -> None:
    err = _refused(f"{server}/gzip", LOOPBACK, server)
    assert err.reason == "127.0.0.1 sent Content-Encoding 'gzip'; only identity is accepted"


def test_an_http_error_is_named(server: str) -> None:
    assert _refused(f"{server}/nothing-here", LOOPBACK, server).reason == (
        "127.0.0.1 answered HTTP 404"
    )


def test_a_closed_port_is_named(server: str) -> None:
    err = _refused("http://127.0.0.1:9/cat.png", LOOPBACK, server)
    assert err.reason.startswith("cannot fetch from 127.0.0.1: ConnectError")


@pytest.mark.parametrize(
    ("url", "options"),
    [
        ("http://" + "a" * 60_000 + ".example/cat.png", _remote(allowed_domains=("127.0.0.1",))),
        ("http://" + "a" * 60_000 + ".invalid/cat.png", LOOPBACK),  # cannot be resolved
        ("http://127.0.0.1:" + "1" * 60_000 + "/cat.png", LOOPBACK),  # an invalid port
    ],
    ids=["not-allowed", "unresolvable", "invalid-port"],
)
def test_a_refusal_quotes_at_most_a_bounded_part_of_the_url(
    server: str, url: str, options: MediaOptions
) -> None:
    assert len(_refused(url, options, server).reason) <= 600


def test_an_invalid_url_is_named(server: str) -> None:
    assert _refused("http://[::1/", LOOPBACK, server).reason == "invalid URL: Invalid port: ':1'"
    assert _refused("http://:80/cat.png", LOOPBACK, server).reason == "the URL has no host"
