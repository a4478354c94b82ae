"""Image URL fetching under its policy: off unless domains are named; only public addresses
(loopback, link-local metadata, private ones refused whatever the name, and IPv6 addresses
that carry them: IPv4-mapped, NAT64, 6to4, Teredo); redirects only to the same host, each hop
checked; size limits; one deadline for the whole fetch however a hostile host paces its bytes;
a bounded number of fetches at once. The fetches that succeed are served by a real HTTP
server on loopback, which the policy lets through only with its test-only switch; the hostile
hosts are scripted sockets on loopback."""
from __future__ import annotations

import http.server
import io
import select
import socket
import threading
import time

import pytest
from PIL import Image

from lifeline.media.fetch import (
    MAX_CONCURRENT_FETCHES,
    FetchPolicy,
    domain_allowed,
    fetch_image,
    is_public_address,
)
from lifeline.media.images import MediaError, decode_image
from lifeline.server.errors import APIError


def _png() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (12, 8), (200, 10, 30)).save(buf, format="PNG")
    return buf.getvalue()


PNG = _png()


class Handler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args):  # quiet
        pass

    def do_GET(self):  # noqa: N802 - the stdlib's name
        port = self.server.server_address[1]
        routes = {
            "/img.png": (200, {"Content-Type": "image/png"}, PNG),
            "/same": (302, {"Location": "/img.png"}, b""),
            "/other": (302, {"Location": f"http://localhost:{port}/img.png"}, b""),
            "/metadata": (302, {"Location": "http://169.254.169.254/latest/meta-data/"}, b""),
            "/loop": (302, {"Location": "/loop"}, b""),
            "/missing": (404, {}, b"no"),
            "/big": (200, {"Content-Type": "image/png"}, b"\x00" * 300_000),
        }
        if self.path == "/slow":
            time.sleep(2.0)
            status, headers, body = 200, {}, PNG
        else:
            status, headers, body = routes.get(self.path, (404, {}, b""))
        try:
            self.send_response(status)
            for k, v in headers.items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):  # the client gave up (a timeout)
            pass


@pytest.fixture(scope="module")
def origin():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


LOOPBACK_OK = FetchPolicy(("127.0.0.1", "localhost"), max_bytes=100_000, timeout_s=1.0,
                          allow_private_addresses=True)


def _code(url: str, policy: FetchPolicy) -> str:
    with pytest.raises(MediaError) as e:
        fetch_image(url, policy, param="messages[0].content[1].image_url.url")
    assert e.value.param == "messages[0].content[1].image_url.url"
    return e.value.code


def test_fetching_is_off_unless_domains_are_named():
    assert _code("https://example.com/a.png", FetchPolicy()) == "unsupported_image_url"


@pytest.mark.parametrize("url,allowed", [
    ("http://127.0.0.1/x.png", "127.0.0.1"),
    ("http://localhost/x.png", "localhost"),                       # a name for loopback
    ("http://169.254.169.254/latest/meta-data/", "169.254.169.254"),  # cloud metadata
    ("http://10.1.2.3/x.png", "10.1.2.3"),
    ("http://192.168.0.10/x.png", "192.168.0.10"),
    ("http://100.64.0.1/x.png", "100.64.0.1"),                     # shared address space
    ("http://[::1]/x.png", "::1"),
    ("http://[::ffff:127.0.0.1]/x.png", "::ffff:127.0.0.1"),       # IPv4-mapped loopback
    ("http://0.0.0.0/x.png", "0.0.0.0"),
])
def test_non_public_addresses_are_refused_whatever_the_name(url, allowed):
    assert _code(url, FetchPolicy((allowed,))) == "image_url_forbidden"


def test_domains_schemes_and_credentials():
    policy = FetchPolicy(("images.example.com",))
    assert _code("http://evil.example.org/x.png", policy) == "image_url_forbidden"
    assert _code("http://example.com/x.png", policy) == "image_url_forbidden"
    assert _code("ftp://images.example.com/x.png", policy) == "unsupported_image_url"
    assert _code("http://user:pw@images.example.com/x.png", policy) == "image_url_forbidden"
    assert domain_allowed("cdn.images.example.com", ("images.example.com",))
    assert domain_allowed("IMAGES.example.com.", (".images.example.com",))
    assert not domain_allowed("notimages.example.com", ("images.example.com",))


def test_a_fetch_from_loopback_when_the_test_switch_allows_it(origin):
    data = fetch_image(origin + "/img.png", LOOPBACK_OK)
    assert data == PNG and decode_image(data).size == (12, 8)
    assert fetch_image(origin + "/same", LOOPBACK_OK) == PNG  # a redirect on the same host
    # without the switch, the same server is refused before any connection
    assert _code(origin + "/img.png", FetchPolicy(("127.0.0.1",))) == "image_url_forbidden"


@pytest.mark.parametrize("path,code", [
    ("/other", "image_url_forbidden"),     # a redirect to another host
    ("/metadata", "image_url_forbidden"),  # a redirect to the metadata address
    ("/loop", "image_fetch_failed"),       # more redirects than allowed
    ("/missing", "image_fetch_failed"),
    ("/big", "image_too_large"),
    ("/slow", "image_fetch_failed"),       # past the timeout
])
def test_fetch_refusals(origin, path, code):
    assert _code(origin + path, LOOPBACK_OK) == code


@pytest.mark.parametrize("address", [
    "64:ff9b::7f00:1",                        # NAT64 (well-known prefix) of 127.0.0.1
    "64:ff9b::a9fe:a9fe",                     # NAT64 of the metadata address
    "64:ff9b:1::a00:1",                       # the local-use NAT64 prefix
    "::7f00:1",                               # IPv4-compatible 127.0.0.1
    "::ffff:0:a00:1",                         # IPv4-translated 10.0.0.1
    "2002:7f00:1::1",                         # 6to4 through 127.0.0.1
    "2002:c0a8:101::1",                       # 6to4 through 192.168.1.1
    "2001:0:4136:e378:8000:63bf:80ff:fffe",   # Teredo, client 127.0.0.1 (inverted)
    "3fff::1",                                # documentation (2024)
    "5f00::1",                                # SRv6 SIDs: outside global unicast
])
def test_ipv4_inside_ipv6_is_checked_as_ipv4(address):
    """An IPv6 literal that carries a refused IPv4 address is refused before any connection,
    on every Python version (3.11's tables call all but the Teredo one global)."""
    assert _code(f"http://[{address}]/x.png", FetchPolicy((address,))) == "image_url_forbidden"


@pytest.mark.parametrize("address,public", [
    ("8.8.8.8", True), ("1.1.1.1", True), ("100.63.255.255", True), ("100.128.0.0", True),
    ("0.1.2.3", False), ("10.9.8.7", False), ("100.64.0.1", False), ("127.1.2.3", False),
    ("169.254.169.254", False), ("172.16.0.1", False), ("172.31.255.255", False),
    ("172.32.0.1", True), ("192.0.0.9", False), ("192.0.2.1", False), ("192.88.99.1", False),
    ("192.168.1.1", False), ("198.18.0.1", False), ("198.51.100.1", False),
    ("203.0.113.9", False), ("224.0.0.251", False), ("240.0.0.1", False),
    ("255.255.255.255", False),
    ("2606:4700::1111", True), ("2a00:1450:4001::1", True),
    ("::", False), ("::1", False), ("fe80::1%eth0", False), ("fc00::1", False),
    ("fd12:3456::1", False), ("fec0::1", False), ("ff02::1", False), ("100::1", False),
    ("2001:db8::1", False), ("2001:2::1", False), ("2001:10::1", False),
    ("::ffff:8.8.8.8", True), ("::ffff:127.0.0.1", False), ("::8.8.8.8", True),
    ("64:ff9b::808:808", True), ("64:ff9b::c0a8:1", False), ("64:ff9b:1::808:808", False),
    ("2002:808:808::1", True), ("2002:a9fe:a9fe::1", False),
    ("2001:0:4136:e378:8000:63bf:f7f7:f7f7", True),   # Teredo, client 8.8.8.8
    ("2001:0:4136:e378:8000:63bf:f5ff:fffe", False),  # Teredo, client 10.0.0.1
    ("2001:0:a00:1:8000:63bf:f7f7:f7f7", False),      # Teredo, server 10.0.0.1
])
def test_the_public_address_table(address, public):
    assert is_public_address(address) is public


class Hostile:
    """A host on loopback that answers each connection with `script(conn)` in its own thread,
    and records how each one ended: 'client left' (the fetcher hung up first) or 'cap' (the
    script ran out, `CAP_S` after the request: the fetcher never gave up)."""

    CAP_S = 8.0

    def __init__(self, script):
        self.script = script
        self.outcomes: list[str] = []
        self.open = self.most_open = 0
        self.lock = threading.Lock()
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn):
        with self.lock:
            self.open += 1
            self.most_open = max(self.most_open, self.open)
        try:
            conn.recv(65536)
            end = time.monotonic() + self.CAP_S
            outcome = "cap"
            for piece, pause in self.script():
                if time.monotonic() > end:
                    break
                if _hung_up(conn):
                    outcome = "client left"
                    break
                try:
                    conn.sendall(piece)
                except OSError:
                    outcome = "client left"
                    break
                time.sleep(pause)
        finally:
            conn.close()
            with self.lock:
                self.open -= 1
                self.outcomes.append(outcome)

    def url(self, scheme="http"):
        return f"{scheme}://127.0.0.1:{self.port}/x.png"

    def close(self):
        self.sock.close()

    def wait_for(self, count: int, timeout: float = 30.0) -> list[str]:
        end = time.monotonic() + timeout
        while len(self.outcomes) < count and time.monotonic() < end:
            time.sleep(0.02)
        return self.outcomes


def _hung_up(conn) -> bool:
    if not select.select([conn], [], [], 0)[0]:
        return False
    try:
        return conn.recv(65536) == b""
    except OSError:
        return True


def trickled_head():
    """A status line and then one header, a byte every 50 ms, never finished."""
    for byte in b"HTTP/1.1 200 OK\r\nContent-Type: image/png\r\nX-Padding: ":
        yield bytes([byte]), 0.05
    while True:
        yield b"a", 0.05


def endless_continue():
    while True:
        yield b"HTTP/1.1 100 Continue\r\n\r\n", 0.01


def trickled_body():
    yield b"HTTP/1.1 200 OK\r\nContent-Length: 50000\r\n\r\n", 0.05
    while True:
        yield b"\x00", 0.05


def silence():
    while True:
        yield b"", 0.05


def trickled_tls_handshake():
    """A TLS handshake record announced at 16 KiB, its bytes a few a second."""
    yield b"\x16\x03\x03\x40\x00\x02", 0.05
    while True:
        yield b"\x00", 0.05


@pytest.mark.parametrize("script,scheme", [
    (trickled_head, "http"), (endless_continue, "http"), (trickled_body, "http"),
    (silence, "http"), (trickled_tls_handshake, "https"),
])
def test_one_deadline_covers_the_whole_fetch(script, scheme):
    """However the host paces its bytes (status line and headers a byte at a time, `100
    Continue` forever, a slow body, nothing at all, a slow TLS handshake), the fetch gives up
    at its deadline: the host sees the fetcher hang up long before its own script runs out."""
    host = Hostile(script)
    try:
        policy = FetchPolicy(("127.0.0.1",), timeout_s=1.0, allow_private_addresses=True)
        assert _code(host.url(scheme), policy) == "image_fetch_failed"
        assert host.wait_for(1) == ["client left"]
    finally:
        host.close()


def test_fetches_are_bounded_in_concurrency(origin):
    """`MAX_CONCURRENT_FETCHES` fetches hold a host that never answers; one more waits for a
    slot within its own deadline and gets a 503 to retry; the host never sees more than the
    limit at once."""
    host = Hostile(silence)
    slow = FetchPolicy(("127.0.0.1",), timeout_s=4.0, allow_private_addresses=True)
    quick = FetchPolicy(("127.0.0.1",), timeout_s=0.5, allow_private_addresses=True)
    errors: list[object] = []

    def fetch(policy):
        try:
            fetch_image(host.url(), policy)
        except (MediaError, APIError) as exc:
            errors.append(exc)

    holders = [threading.Thread(target=fetch, args=(slow,))
               for _ in range(MAX_CONCURRENT_FETCHES)]
    try:
        for t in holders:
            t.start()
        end = time.monotonic() + 30
        while host.open < MAX_CONCURRENT_FETCHES and time.monotonic() < end:
            time.sleep(0.02)
        with pytest.raises(APIError) as busy:
            fetch_image(host.url(), quick, param="messages[0].content[0].image_url.url")
        assert busy.value.status == 503 and busy.value.code == "image_fetch_busy"
        assert busy.value.retry_after and busy.value.param.endswith("image_url.url")
        for t in holders:
            t.join(30)
        assert [getattr(e, "code", None) for e in errors] == ["image_fetch_failed"] * 4
        assert host.most_open == MAX_CONCURRENT_FETCHES
        assert fetch_image(origin + "/img.png", LOOPBACK_OK) == PNG  # the slots came back
    finally:
        host.close()
