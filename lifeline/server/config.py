"""What `lifeline serve` was asked for, validated once at start-up."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from lifeline.engine.engine import EngineConfig


@dataclass(slots=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None
    """Model id clients must name; defaults to `gemma-3-270m` or the model file's stem."""
    chat_template: Path | None = None
    allow_request_chat_template: bool = False
    reasoning_parser: str | None = None
    tool_call_parser: str | None = None
    api_keys: list[str] = field(default_factory=list)
    protect_metrics: bool = False
    rate_limit_rpm: int | None = None
    rate_limit_tpm: int | None = None
    max_queued_requests: int | None = None
    """Admitted requests still waiting for their first token; beyond it new ones get 503."""
    shutdown_timeout: float = 30.0
    otlp_endpoint: str | None = None
    max_body_bytes: int = 8 << 20
    max_n: int = 64
    max_json_depth: int = 64
    engine: EngineConfig = field(default_factory=EngineConfig)

    def __post_init__(self) -> None:
        for name in ("rate_limit_rpm", "rate_limit_tpm", "max_queued_requests"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name} must be non-negative, got {value}")
        if self.shutdown_timeout < 0:
            raise ValueError("shutdown_timeout must be non-negative")
        if any(not key for key in self.api_keys):
            raise ValueError("an API key may not be empty")
