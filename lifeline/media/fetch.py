"""Fetching an `http(s)://` image URL, only where the server allows it, without letting a
request reach what the server can reach and the client cannot (SSRF), and without letting a
slow or hostile host hold the server.

- Off unless the server names domains (`--allowed-media-domains`): a host must be one of
  them or a subdomain of one.
- Every address the host resolves to must be a public one (`is_public_address`): never
  loopback, link-local (169.254.0.0/16, where cloud metadata lives), private, shared
  (100.64/10), multicast, reserved, documentation or unspecified, IPv4 or IPv6, nor an IPv6
  address that carries such an IPv4 one (IPv4-mapped, IPv4-compatible, NAT64, 6to4, Teredo),
  whatever the DNS says. The tables are this module's own, so the answer does not change with
  the Python version. The connection goes to the address that was checked (the host name goes
  in the `Host` header and TLS's SNI and certificate check), so a second DNS answer cannot
  swap it.
- Redirects are followed by hand, at most `max_redirects`, only to the same host, each hop
  checked again; the body is read up to `max_bytes`.
- One deadline, `timeout_s` from the call, covers the whole fetch: the wait for a slot, each
  DNS lookup, connecting, TLS, the status line, every header (and every 1xx answer), the
  body. Every socket operation runs under what is left of it (lifeline.media.deadline_net),
  so a host that trickles a byte a second or sends `100 Continue` forever is cut off at the
  deadline.
- At most `MAX_CONCURRENT_FETCHES` fetches run at once in a process; one over it waits for a
  slot within its own deadline, then gets a 503 with Retry-After.
Each refusal is a `MediaError` (400) naming the field. The fetch blocks its thread: callers
run it off the event loop (lifeline.server.openai_api prepares image requests in worker
threads).
"""
from __future__ import annotations

import ipaddress
import socket
import ssl
import threading
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import SplitResult, quote, urljoin, urlsplit

import httpcore

from lifeline.media.deadline_net import DeadlineBackend
from lifeline.media.images import MediaError

MAX_CONCURRENT_FETCHES = 4
"""Image fetches in flight at once in one process (each holds a connection and a thread)."""
_SLOTS = threading.BoundedSemaphore(MAX_CONCURRENT_FETCHES)
_LOOKUPS = threading.BoundedSemaphore(MAX_CONCURRENT_FETCHES)
"""DNS lookups in flight: `getaddrinfo` has no timeout of its own, so each runs in a daemon
thread that the fetch waits for only until its deadline; one that hangs keeps its slot, so
hung lookups cannot pile up either."""
_TARGET_SAFE = "/%:@!$&'()*+,;=-._~"


@dataclass(frozen=True, slots=True)
class FetchPolicy:
    allowed_domains: tuple[str, ...] = ()
    max_bytes: int = 8 << 20
    timeout_s: float = 10.0
    """The whole fetch, redirects included."""
    max_redirects: int = 3
    allow_private_addresses: bool = field(default=False, repr=False)
    """Tests only (a server on loopback): lets non-public addresses through."""

    @property
    def enabled(self) -> bool:
        return bool(self.allowed_domains)


def domain_allowed(host: str, domains: tuple[str, ...]) -> bool:
    host = host.lower().rstrip(".")
    return any(host == d or host.endswith("." + d) for d in
               (d.lower().strip().lstrip(".").rstrip(".") for d in domains) if d)


def _nets(*cidrs: str) -> tuple[Any, ...]:
    return tuple(ipaddress.ip_network(c) for c in cidrs)


NON_PUBLIC_V4 = _nets(
    "0.0.0.0/8", "10.0.0.0/8", "100.64.0.0/10", "127.0.0.0/8", "169.254.0.0/16",
    "172.16.0.0/12", "192.0.0.0/24", "192.0.2.0/24", "192.88.99.0/24", "192.168.0.0/16",
    "198.18.0.0/15", "198.51.100.0/24", "203.0.113.0/24", "224.0.0.0/4", "240.0.0.0/4")
"""This network, private, shared (CGNAT), loopback, link-local, IETF protocol assignments,
documentation, the 6to4 relay anycast, benchmarking, multicast, reserved and broadcast
(IANA's special-purpose registry, RFC 6890 and its updates)."""
GLOBAL_UNICAST_V6 = ipaddress.ip_network("2000::/3")
"""The only IPv6 block handed out for public hosts: anything outside it (loopback, unique
local, link-local, site-local, multicast, discard-only, ...) is refused unless it carries an
IPv4 address (below)."""
NON_PUBLIC_V6 = _nets("2001::/23", "2001:db8::/32", "3fff::/20")
"""Inside 2000::/3: IETF protocol assignments (ORCHID, benchmarking, ...; Teredo, also in it,
is unpacked first), and the two documentation blocks."""
MAPPED, TRANSLATED, COMPATIBLE = _nets("::ffff:0:0/96", "::ffff:0:0:0/96", "::/96")
"""IPv4-mapped, IPv4-translated (SIIT) and the deprecated IPv4-compatible: the last 32 bits."""
NAT64, NAT64_LOCAL = _nets("64:ff9b::/96", "64:ff9b:1::/48")
"""The well-known NAT64 prefix (the last 32 bits, translated to by a gateway on the server's
network) and the local-use one (RFC 8215: whatever the operator's translator reaches, so never
public)."""
SIX_TO_FOUR, TEREDO = _nets("2002::/16", "2001::/32")
"""6to4 (bits 16-47) and Teredo (the server in bits 32-63, the client's address inverted in
the last 32 bits)."""


def is_public_address(address: str) -> bool:
    """Whether a fetch may connect to `address` (IPv4 or IPv6, a `%scope` ignored): checked
    against this module's tables, an IPv6 address carrying an IPv4 one as that IPv4 one."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if ip.version == 4:
        return not any(ip in net for net in NON_PUBLIC_V4)
    embedded = _embedded_v4(ip)
    if embedded is not None:
        return all(is_public_address(str(v4)) for v4 in embedded)
    if ip in NAT64_LOCAL or ip not in GLOBAL_UNICAST_V6:
        return False
    return not any(ip in net for net in NON_PUBLIC_V6)


def _embedded_v4(ip: ipaddress.IPv6Address) -> tuple[ipaddress.IPv4Address, ...] | None:
    """The IPv4 addresses an IPv6 address stands for (None: it carries none)."""
    value = int(ip)
    if any(ip in net for net in (MAPPED, TRANSLATED, COMPATIBLE, NAT64)):
        return (ipaddress.IPv4Address(value & 0xFFFFFFFF),)
    if ip in SIX_TO_FOUR:
        return (ipaddress.IPv4Address((value >> 80) & 0xFFFFFFFF),)
    if ip in TEREDO:
        server = ipaddress.IPv4Address((value >> 64) & 0xFFFFFFFF)
        client = ipaddress.IPv4Address(~value & 0xFFFFFFFF)
        return server, client
    return None


def resolve_checked(host: str, port: int, policy: FetchPolicy, param: str,
                    deadline: float | None = None) -> str:
    """One address of `host` to connect to, every address it resolves to checked; the lookup
    waits no later than `deadline` (monotonic; None: one `timeout_s` from now)."""
    if deadline is None:
        deadline = time.monotonic() + policy.timeout_s
    try:
        infos = _getaddrinfo(host, port, deadline)
    except TimeoutError:
        raise _timed_out(param) from None
    except (OSError, UnicodeError):
        raise MediaError(f"the image URL's host {host[:80]!r} does not resolve", param=param,
                         code="image_fetch_failed") from None
    addresses = list(dict.fromkeys(info[4][0] for info in infos))
    if not addresses:
        raise MediaError(f"the image URL's host {host[:80]!r} has no address", param=param,
                         code="image_fetch_failed")
    if not policy.allow_private_addresses:
        for address in addresses:
            if not is_public_address(address):
                raise MediaError(f"the image URL's host resolves to {address}, which is not a "
                                 "public address: refused", param=param,
                                 code="image_url_forbidden")
    return addresses[0]


def _getaddrinfo(host: str, port: int, deadline: float) -> list[Any]:
    """`socket.getaddrinfo` in a daemon thread, waited for until `deadline` (TimeoutError)."""
    if not _LOOKUPS.acquire(timeout=max(0.0, deadline - time.monotonic())):
        raise TimeoutError
    done, answer = threading.Event(), {}

    def lookup() -> None:
        try:
            answer["infos"] = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except (OSError, UnicodeError) as exc:
            answer["error"] = exc
        finally:
            _LOOKUPS.release()
            done.set()

    threading.Thread(target=lookup, name="lifeline-dns", daemon=True).start()
    if not done.wait(max(0.0, deadline - time.monotonic())):
        raise TimeoutError
    if "error" in answer:
        raise answer["error"]
    return answer["infos"]


def fetch_image(url: str, policy: FetchPolicy, *, param: str = "messages") -> bytes:
    """The bytes at `url`, under `policy`, within `policy.timeout_s` from this call."""
    if not policy.enabled:
        raise MediaError("this server does not fetch image URLs (start it with "
                         "--allowed-media-domains); send a data: URL instead", param=param,
                         code="unsupported_image_url")
    deadline = time.monotonic() + policy.timeout_s
    _checked_url(url, None, policy, param)  # a URL refused anyway waits for no slot
    if not _SLOTS.acquire(timeout=max(0.0, deadline - time.monotonic())):
        from lifeline.server.errors import APIError

        raise APIError(503, f"the server is already fetching {MAX_CONCURRENT_FETCHES} image "
                       "URLs and none finished in time; retry, or send a data: URL", param,
                       "image_fetch_busy", 1.0)
    try:
        return _follow(url, policy, deadline, param)
    finally:
        _SLOTS.release()


def _checked_url(url: str, first_host: str | None, policy: FetchPolicy,
                 param: str) -> SplitResult:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise MediaError("an image URL is http(s)://host/... or a data: URL", param=param,
                         code="unsupported_image_url")
    if parts.username or parts.password:
        raise MediaError("an image URL may not carry credentials", param=param,
                         code="image_url_forbidden")
    host = parts.hostname
    if first_host is not None and host != first_host:
        raise MediaError(f"the image URL redirects to another host ({host[:80]}): refused",
                         param=param, code="image_url_forbidden")
    if not domain_allowed(host, policy.allowed_domains):
        raise MediaError(f"image URLs from {host[:80]!r} are not allowed on this server",
                         param=param, code="image_url_forbidden")
    try:
        parts.port
    except ValueError:
        raise MediaError("the image URL's port is not a number in range", param=param,
                         code="unsupported_image_url") from None
    return parts


def _follow(url: str, policy: FetchPolicy, deadline: float, param: str) -> bytes:
    first_host = None
    for _ in range(policy.max_redirects + 1):
        parts = _checked_url(url, first_host, policy, param)
        first_host = parts.hostname
        port = parts.port or (443 if parts.scheme == "https" else 80)
        address = resolve_checked(parts.hostname, port, policy, param, deadline)
        status, location, body = _get(parts, address, port, policy, deadline, param)
        if status in (301, 302, 303, 307, 308) and location:
            url = urljoin(url, location)
            continue
        if status != 200:
            raise MediaError(f"fetching the image answered HTTP {status}", param=param,
                             code="image_fetch_failed")
        return body
    raise MediaError(f"the image URL redirects more than {policy.max_redirects} times",
                     param=param, code="image_fetch_failed")


def _get(parts: SplitResult, address: str, port: int, policy: FetchPolicy, deadline: float,
         param: str) -> tuple[int, str | None, bytes]:
    """One GET to `address`, as `parts` names it: (status, Location, body of a 200)."""
    try:
        host = parts.hostname.encode("idna").decode("ascii")
    except UnicodeError:
        raise MediaError("the image URL's host is not a valid name", param=param,
                         code="unsupported_image_url") from None
    name = f"[{host}]" if ":" in host else host
    host_header = name if parts.port is None else f"{name}:{parts.port}"
    target = quote(parts.path or "/", safe=_TARGET_SAFE)
    if parts.query:
        target += "?" + quote(parts.query, safe=_TARGET_SAFE + "?")
    request_url = httpcore.URL(scheme=parts.scheme.encode(), host=address.encode(), port=port,
                               target=target.encode())
    headers = [(b"Host", host_header.encode()), (b"Accept", b"image/*")]
    try:
        with httpcore.ConnectionPool(network_backend=DeadlineBackend(deadline)) as pool, \
                pool.stream("GET", request_url, headers=headers,
                            extensions={"sni_hostname": host}) as r:
            if r.status != 200:
                return r.status, _header(r, b"location"), b""
            declared = _header(r, b"content-length")
            if declared and declared.isdigit() and int(declared) > policy.max_bytes:
                raise MediaError(f"the image is {int(declared):,} bytes; the limit is "
                                 f"{policy.max_bytes:,}", param=param, code="image_too_large")
            chunks, size = [], 0
            for chunk in r.iter_stream():
                size += len(chunk)
                if size > policy.max_bytes:
                    raise MediaError(f"the image is over {policy.max_bytes:,} bytes",
                                     param=param, code="image_too_large")
                chunks.append(chunk)
            return 200, None, b"".join(chunks)
    except httpcore.TimeoutException:
        raise _timed_out(param) from None
    except (httpcore.NetworkError, httpcore.ProtocolError, httpcore.UnsupportedProtocol,
            ssl.SSLError, OSError) as exc:
        raise MediaError(f"fetching the image failed ({type(exc).__name__})", param=param,
                         code="image_fetch_failed") from None


def _header(response: httpcore.Response, name: bytes) -> str | None:
    for key, value in response.headers:
        if key.lower() == name:
            return value.decode("latin-1")
    return None


def _timed_out(param: str) -> MediaError:
    return MediaError("fetching the image timed out", param=param, code="image_fetch_failed")
