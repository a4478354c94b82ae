"""Fetching an `http(s)://` image URL, only where the server allows it, without letting a
request reach what the server can reach and the client cannot (SSRF).

- Off unless the server names domains (`--allowed-media-domains`): a host must be one of
  them or a subdomain of one.
- Every address the host resolves to must be a global one: never loopback, link-local
  (169.254.0.0/16, where cloud metadata lives), private, shared (100.64/10), multicast,
  reserved or unspecified, IPv4 or IPv6 (IPv4-mapped ones are checked as IPv4), whatever the
  DNS says. The connection goes to the address that was checked (the host name goes in the
  `Host` header and TLS's SNI and certificate check), so a second DNS answer cannot swap it.
- Redirects are followed by hand, at most `max_redirects`, only to the same host, each hop
  checked again; the body is read up to `max_bytes` and the whole fetch within `timeout_s`.
Each refusal is a `MediaError` (400) naming the field.
"""
from __future__ import annotations

import ipaddress
import socket
import time
from dataclasses import dataclass, field
from urllib.parse import urljoin, urlsplit

import httpx

from lifeline.media.images import MediaError


@dataclass(frozen=True, slots=True)
class FetchPolicy:
    allowed_domains: tuple[str, ...] = ()
    max_bytes: int = 8 << 20
    timeout_s: float = 10.0
    max_redirects: int = 3
    allow_private_addresses: bool = field(default=False, repr=False)
    """Tests only (a server on loopback): lets non-global addresses through."""

    @property
    def enabled(self) -> bool:
        return bool(self.allowed_domains)


def domain_allowed(host: str, domains: tuple[str, ...]) -> bool:
    host = host.lower().rstrip(".")
    return any(host == d or host.endswith("." + d) for d in
               (d.lower().strip().lstrip(".").rstrip(".") for d in domains) if d)


def _public(address: str) -> bool:
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_global and not ip.is_multicast


def resolve_checked(host: str, port: int, policy: FetchPolicy, param: str) -> str:
    """One address of `host` to connect to, every address it resolves to checked."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        raise MediaError(f"the image URL's host {host[:80]!r} does not resolve", param=param,
                         code="image_fetch_failed") from None
    addresses = list(dict.fromkeys(info[4][0] for info in infos))
    if not addresses:
        raise MediaError(f"the image URL's host {host[:80]!r} has no address", param=param,
                         code="image_fetch_failed")
    if not policy.allow_private_addresses:
        for address in addresses:
            if not _public(address):
                raise MediaError(f"the image URL's host resolves to {address}, which is not a "
                                 "public address: refused", param=param,
                                 code="image_url_forbidden")
    return addresses[0]


def fetch_image(url: str, policy: FetchPolicy, *, param: str = "messages") -> bytes:
    """The bytes at `url`, under `policy`."""
    if not policy.enabled:
        raise MediaError("this server does not fetch image URLs (start it with "
                         "--allowed-media-domains); send a data: URL instead", param=param,
                         code="unsupported_image_url")
    deadline = time.monotonic() + policy.timeout_s
    first_host = None
    for _ in range(policy.max_redirects + 1):
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise MediaError("an image URL is http(s)://host/... or a data: URL", param=param,
                             code="unsupported_image_url")
        if parts.username or parts.password:
            raise MediaError("an image URL may not carry credentials", param=param,
                             code="image_url_forbidden")
        host = parts.hostname
        if first_host is None:
            first_host = host
        elif host != first_host:
            raise MediaError(f"the image URL redirects to another host ({host[:80]}): refused",
                             param=param, code="image_url_forbidden")
        if not domain_allowed(host, policy.allowed_domains):
            raise MediaError(f"image URLs from {host[:80]!r} are not allowed on this server",
                             param=param, code="image_url_forbidden")
        port = parts.port or (443 if parts.scheme == "https" else 80)
        address = resolve_checked(host, port, policy, param)
        response_url, status, location, body = _get(url, parts, address, port, policy,
                                                    deadline, param)
        if status in (301, 302, 303, 307, 308) and location:
            url = urljoin(response_url, location)
            continue
        if status != 200:
            raise MediaError(f"fetching the image answered HTTP {status}", param=param,
                             code="image_fetch_failed")
        return body
    raise MediaError(f"the image URL redirects more than {policy.max_redirects} times",
                     param=param, code="image_fetch_failed")


def _get(url: str, parts, address: str, port: int, policy: FetchPolicy, deadline: float,
         param: str) -> tuple[str, int, str | None, bytes]:
    host_header = parts.hostname if parts.port is None else f"{parts.hostname}:{parts.port}"
    literal = f"[{address}]" if ":" in address else address
    target = parts._replace(netloc=f"{literal}:{port}").geturl()
    left = deadline - time.monotonic()
    if left <= 0:
        raise MediaError("fetching the image timed out", param=param, code="image_fetch_failed")
    try:
        with httpx.Client(timeout=left, follow_redirects=False, trust_env=False) as client:
            with client.stream("GET", target, headers={"Host": host_header,
                                                       "Accept": "image/*"},
                               extensions={"sni_hostname": parts.hostname}) as r:
                if r.status_code != 200:
                    return url, r.status_code, r.headers.get("location"), b""
                declared = r.headers.get("content-length")
                if declared and declared.isdigit() and int(declared) > policy.max_bytes:
                    raise MediaError(f"the image is {int(declared):,} bytes; the limit is "
                                     f"{policy.max_bytes:,}", param=param,
                                     code="image_too_large")
                chunks, size = [], 0
                for chunk in r.iter_bytes():
                    size += len(chunk)
                    if size > policy.max_bytes:
                        raise MediaError(f"the image is over {policy.max_bytes:,} bytes",
                                         param=param, code="image_too_large")
                    if time.monotonic() > deadline:
                        raise MediaError("fetching the image timed out", param=param,
                                         code="image_fetch_failed")
                    chunks.append(chunk)
                return url, 200, None, b"".join(chunks)
    except httpx.TimeoutException:
        raise MediaError("fetching the image timed out", param=param,
                         code="image_fetch_failed") from None
    except httpx.HTTPError as exc:
        raise MediaError(f"fetching the image failed ({type(exc).__name__})", param=param,
                         code="image_fetch_failed") from None
