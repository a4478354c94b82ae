"""Stage 1 for several models: the gateway behind `lifeline serve --config FILE` routes each
request to a backend (a local engine or an upstream OpenAI server), falls back when one fails,
splits traffic, balances replicas, and records every decision (docs/gateway.md).

Imported lazily, as `lifeline.server` is."""
from __future__ import annotations

from typing import Any

_EXPORTS = {"create_gateway_app": "lifeline.gateway.app",
            "GatewayConfig": "lifeline.gateway.config", "load_config": "lifeline.gateway.config",
            "parse_config": "lifeline.gateway.config", "ConfigError": "lifeline.gateway.config",
            "GatewayThread": "lifeline.gateway.testing"}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'lifeline.gateway' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_EXPORTS[name]), name)
