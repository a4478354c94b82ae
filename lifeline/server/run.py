"""Run the app under uvicorn, with a drain on SIGTERM/SIGINT: stop admitting (503, `/ready`
503), let in-flight requests finish for up to `shutdown_timeout` seconds, then exit.
uvicorn's own graceful shutdown closes the listening socket at once, so the drain comes first."""
from __future__ import annotations

import asyncio
import logging
import sys
import time
from types import FrameType

import uvicorn
from fastapi import FastAPI

from lifeline.observe import AccessLog
from lifeline.server.app import LoadedOrLoader, create_app
from lifeline.server.config import ServerConfig
from lifeline.server.state import ServerState

log = logging.getLogger("lifeline.server")
UVICORN_RUNTIME = {"loop": "asyncio", "http": "h11"}
"""uvicorn's event loop and HTTP parser, named rather than left to its "auto", which takes
uvloop and httptools whenever they are installed: Ray Serve's extra (`lifeline[ray]`) brings
both, and the server would silently become another one than the one every figure in the docs
was measured on (docs/scale-out.md)."""


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServerState):
        super().__init__(config)
        self.state = state
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining = False

    async def startup(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        self.state.on_fatal = self._fatal
        await super().startup(sockets)

    def _fatal(self) -> None:
        self.should_exit = True

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._draining or self._loop is None:
            self.should_exit = True
            self.force_exit = self._draining
            return
        self._draining = True
        self.state.admission.draining = True
        self._loop.call_soon_threadsafe(lambda: self._loop.create_task(self.drain()))

    async def drain(self) -> None:
        timeout = self.state.config.shutdown_timeout
        admission = self.state.admission
        log.warning("draining: %d requests in flight, waiting up to %.0f s", admission.in_flight,
                    timeout)
        deadline = time.monotonic() + timeout
        while admission.in_flight > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if admission.in_flight:
            log.warning("drain timed out: aborting %d requests", admission.in_flight)
            for generation in list(self.state.generations):
                generation.abort()
            deadline = time.monotonic() + 2
            while admission.in_flight > 0 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
        await asyncio.sleep(0.1)  # let the last responses flush
        self.should_exit = True


def build_app(model: LoadedOrLoader, config: ServerConfig) -> FastAPI:
    """The app, with the JSON access log on stderr (raises on a bad configuration)."""
    app = create_app(model, config)
    AccessLog.configure()
    return app


def serve(app: FastAPI) -> int:
    """Run until SIGTERM or Ctrl-C has drained the server; the exit status (1: the model could
    not be loaded, or the server could not start)."""
    state: ServerState = app.state.lifeline
    config = state.config
    uconfig = uvicorn.Config(app, host=config.host, port=config.port, access_log=False,
                             timeout_graceful_shutdown=1, log_level="info", **UVICORN_RUNTIME)
    server = DrainingServer(uconfig, state)
    server.run()
    if state.load_error is not None:
        print(f"lifeline serve: cannot load the model: {state.load_error}", file=sys.stderr)
        return 1
    return 0 if server.started else 1
