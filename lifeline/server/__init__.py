"""Stages 1 and 10: the OpenAI-compatible server (`create_app`, `ServerConfig`, `serve`).

Imported lazily, so `lifeline.server.async_engine` does not pull in FastAPI."""
from __future__ import annotations

from typing import Any

_EXPORTS = {"create_app": "lifeline.server.app", "ServerConfig": "lifeline.server.config",
            "serve": "lifeline.server.run", "ServerThread": "lifeline.server.testing"}

__all__ = ["ServerConfig", "ServerThread", "create_app", "serve"]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'lifeline.server' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_EXPORTS[name]), name)
