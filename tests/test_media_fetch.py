"""Image URL fetching under its policy: off unless domains are named; only public addresses
(loopback, link-local metadata, private and IPv4-mapped ones refused whatever the name);
redirects only to the same host, each hop checked; size and time limits. The fetches that
succeed are served by a real HTTP server on loopback, which the policy lets through only
with its test-only switch."""
from __future__ import annotations

import http.server
import io
import threading
import time

import pytest
from PIL import Image

from lifeline.media.fetch import FetchPolicy, domain_allowed, fetch_image
from lifeline.media.images import MediaError, decode_image


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
