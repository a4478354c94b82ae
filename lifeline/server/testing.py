"""A real server on loopback in a background thread, for tests and notebooks."""
from __future__ import annotations

import signal
import socket
import threading
import time
from typing import Any, Self

import uvicorn

from lifeline.server.app import LoadedOrLoader, create_app
from lifeline.server.config import ServerConfig
from lifeline.server.run import UVICORN_RUNTIME, DrainingServer
from lifeline.server.state import ServerState


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerThread:
    """`with ServerThread(loaded, config) as srv:` serves at `srv.base_url` until the block ends."""

    def __init__(self, model: LoadedOrLoader, config: ServerConfig | None = None):
        self.config = config or ServerConfig()
        self.config.host, self.config.port = "127.0.0.1", free_port()
        self.app = create_app(model, self.config)
        self.server = DrainingServer(uvicorn.Config(
            self.app, host="127.0.0.1", port=self.config.port, access_log=False,
            log_level="warning", timeout_graceful_shutdown=1,
            **UVICORN_RUNTIME), self.state)
        self.thread = threading.Thread(target=self.server.run, name="lifeline-test-server",
                                       daemon=True)

    @property
    def state(self) -> ServerState:
        return self.app.state.lifeline

    @property
    def engine(self) -> Any:
        """The `LLMEngine` behind the in-process client, for tests that inject faults into it or
        read its KV cache (the server itself knows it only as an `EngineClient`)."""
        return self.state.client.engine

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.config.port}"

    def start(self, timeout: float = 180.0) -> Self:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        return self

    def sigterm(self) -> None:
        """What SIGTERM does to `lifeline serve`: start the drain (signals only reach the main
        thread, so the test calls the handler itself)."""
        self.server.handle_exit(signal.SIGTERM, None)

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
