"""A real gateway on loopback in a background thread, for tests and notebooks."""
from __future__ import annotations

from typing import Any

import uvicorn

from lifeline.gateway.app import create_gateway_app
from lifeline.gateway.config import GatewayConfig
from lifeline.server.run import UVICORN_RUNTIME, DrainingServer
from lifeline.server.testing import ServerThread, free_port


class GatewayThread(ServerThread):
    """`with GatewayThread(config) as gw:` serves at `gw.base_url` until the block ends."""

    def __init__(self, config: GatewayConfig, preloaded: dict[str, Any] | None = None):
        import threading

        self.config = config
        config.host, config.port = "127.0.0.1", free_port()
        self.app = create_gateway_app(config, preloaded)
        self.server = DrainingServer(uvicorn.Config(
            self.app, host="127.0.0.1", port=config.port, access_log=False,
            log_level="warning", timeout_graceful_shutdown=1,
            **UVICORN_RUNTIME), self.state)
        self.thread = threading.Thread(target=self.server.run, name="lifeline-test-gateway",
                                       daemon=True)
