"""httpcore's blocking network backend under one deadline for everything it does.

httpcore gives each socket operation its own timeout, so a host that sends a byte just before
each one runs out (a status line a byte a second, `100 Continue` forever, a TLS handshake
record that never completes) holds a fetch for as long as it likes. `DeadlineBackend` cuts
every connect, read and write to what is left before one deadline and refuses any once it has
passed; TLS runs through memory buffers over those same reads and writes, so the handshake is
bounded the same way. A fetch through it ends by its deadline however the host paces its
bytes.
"""
from __future__ import annotations

import ssl
import time
from typing import Any

import httpcore

_READ_BYTES = 64 << 10


class DeadlineBackend(httpcore.NetworkBackend):
    """httpcore's blocking sockets, each operation's timeout cut to what is left before
    `deadline`, and TLS done over those same capped reads and writes: a timeout that httpcore
    gives per operation becomes one for the whole fetch, however the host paces its bytes."""

    def __init__(self, deadline: float):
        self.deadline = deadline
        self.inner = httpcore.SyncBackend()

    def left(self, timeout: float | None, error: type[Exception]) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise error("the fetch's deadline passed")
        return left if timeout is None else min(timeout, left)

    def connect_tcp(self, host: str, port: int, timeout: float | None = None,
                    local_address: str | None = None,
                    socket_options: Any = None) -> httpcore.NetworkStream:
        stream = self.inner.connect_tcp(host, port, self.left(timeout, httpcore.ConnectTimeout),
                                        local_address, socket_options)
        return _DeadlineStream(stream, self)

    def connect_unix_socket(self, path: str, timeout: float | None = None,
                            socket_options: Any = None) -> httpcore.NetworkStream:
        raise httpcore.UnsupportedProtocol("image fetches use TCP only")

    def sleep(self, seconds: float) -> None:
        time.sleep(min(seconds, max(0.0, self.deadline - time.monotonic())))


class _DeadlineStream(httpcore.NetworkStream):
    def __init__(self, inner: httpcore.NetworkStream, backend: DeadlineBackend):
        self.inner, self.backend = inner, backend

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return self.inner.read(max_bytes, self.backend.left(timeout, httpcore.ReadTimeout))

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self.inner.write(buffer, self.backend.left(timeout, httpcore.WriteTimeout))

    def close(self) -> None:
        self.inner.close()

    def start_tls(self, ssl_context: ssl.SSLContext, server_hostname: str | None = None,
                  timeout: float | None = None) -> httpcore.NetworkStream:
        try:
            return _TLSStream(self, ssl_context, server_hostname)
        except Exception:
            self.close()
            raise

    def get_extra_info(self, info: str) -> Any:
        return self.inner.get_extra_info(info)


class _TLSStream(httpcore.NetworkStream):
    """TLS over a `_DeadlineStream` through memory buffers: the handshake and every record
    move by its capped reads and writes (a socket's own TLS would wait per `recv`, so a host
    trickling its handshake could outlast the deadline)."""

    def __init__(self, raw: _DeadlineStream, context: ssl.SSLContext, hostname: str | None):
        self.raw = raw
        self.incoming, self.outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        self.tls = context.wrap_bio(self.incoming, self.outgoing, server_hostname=hostname)
        self._io(self.tls.do_handshake)

    def _io(self, operation: Any, *args: Any) -> Any:
        while True:
            try:
                result = operation(*args)
            except ssl.SSLWantReadError:
                self._flush()
                data = self.raw.read(_READ_BYTES)
                if data:
                    self.incoming.write(data)
                else:
                    self.incoming.write_eof()
                continue
            except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                raise
            except ssl.SSLError as exc:
                raise httpcore.ConnectError(f"TLS failed ({exc.reason})") from None
            self._flush()
            return result

    def _flush(self) -> None:
        pending = self.outgoing.read()
        if pending:
            self.raw.write(pending)

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        try:
            return self._io(self.tls.read, max_bytes)
        except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
            return b""

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        while buffer:
            buffer = buffer[self._io(self.tls.write, buffer):]

    def close(self) -> None:
        self.raw.close()

    def start_tls(self, *args: Any, **kwargs: Any) -> httpcore.NetworkStream:
        raise httpcore.UnsupportedProtocol("TLS in TLS is not used by image fetches")

    def get_extra_info(self, info: str) -> Any:
        if info == "ssl_object":
            return self.tls
        return self.raw.get_extra_info(info)
