"""What `lifeline serve` was asked for, validated once at start-up."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from lifeline.engine.engine import EngineConfig
from lifeline.server.protocol import check_sampling_defaults


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
    admin_key: str | None = None
    """The key of `/debug/*` and `/dashboard*` (docs/serve.md, "Debug endpoints"): once API
    keys or this key are configured, those paths answer only to it (403 otherwise)."""
    protect_metrics: bool = False
    rate_limit_rpm: int | None = None
    rate_limit_tpm: int | None = None
    max_queued_requests: int | None = 512
    """Admitted requests still waiting for their first token; beyond it new ones get 503
    (None: no limit). Each holds its body (up to `max_body_bytes`) while it waits."""
    shutdown_timeout: float = 30.0
    otlp_endpoint: str | None = None
    max_body_bytes: int = 8 << 20
    max_images: int = 8
    """Images in one chat request (a vision-language model)."""
    max_image_bytes: int = 8 << 20
    """One image's encoded bytes (after base64); the body's own cap bounds them all."""
    max_image_pixels: int = 33_177_600
    """One image's width × height, read from its header before it is decoded (8K UHD)."""
    max_queued_image_bytes: int = 1 << 30
    """Bytes of images held by admitted requests before the vision tower has encoded them:
    decoded pictures while they are preprocessed, then frames and encoded bytes
    (lifeline.server.image_budget). Over it a request gets 503 with Retry-After; one whose
    own images exceed it, 400."""
    allowed_media_domains: list[str] = field(default_factory=list)
    """Domains whose http(s) image URLs are fetched (and their subdomains), public addresses
    only (lifeline.media.fetch); empty: image URLs must be data: URLs."""
    media_fetch_timeout_s: float = 10.0
    max_n: int = 64
    max_json_depth: int = 64
    request_timeout: float | None = 600.0
    """Seconds a request may spend in the engine, queue included: one that has produced tokens
    ends with finish_reason 'length' (llama.cpp's `t_max_predict_ms` does the same), one still
    queued gets 503 with Retry-After (docs/reliability.md); None: no limit."""
    default_max_tokens: int | None = 2048
    """`max_tokens` of a request that sends none (always clamped to the context left)."""
    sampling_defaults: dict[str, float] = field(default_factory=dict)
    """Sampling fields (temperature, top_p, top_k, min_p and the penalties) of a request that
    sends none: what vLLM takes from a model's generation_config.json. The OpenAI defaults
    (temperature 1) suit a small instruction model badly."""
    salt_cache_by_api_key: bool = False
    """Mix a keyed digest of each request's API key into its prefix-cache salt, so tenants
    never share blocks nor image embeddings (`lifeline.server.tenants.tenant_salt`)."""
    allowed_origins: list[str] = field(default_factory=list)
    """CORS: origins allowed to call the API from a browser (empty: CORS off; ['*']: any)."""
    allowed_methods: list[str] = field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = field(default_factory=lambda: ["*"])
    allow_credentials: bool = False
    enable_fault_injection: bool = False
    """Honour the `X-Lifeline-Fault` request header (tests and benchmarks/soak.py only)."""
    engine: EngineConfig = field(default_factory=EngineConfig)

    def __post_init__(self) -> None:
        for name in ("rate_limit_rpm", "rate_limit_tpm", "max_queued_requests"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name} must be non-negative, got {value}")
        if self.shutdown_timeout < 0:
            raise ValueError("shutdown_timeout must be non-negative")
        if self.request_timeout is not None and self.request_timeout <= 0:
            raise ValueError("request_timeout must be positive")
        if self.default_max_tokens is not None and self.default_max_tokens < 1:
            raise ValueError("default_max_tokens must be at least 1")
        check_sampling_defaults(self.sampling_defaults)
        if any(not key for key in self.api_keys):
            raise ValueError("an API key may not be empty")
        if self.admin_key == "":
            raise ValueError("the admin key may not be empty")
        for name in ("max_images", "max_image_bytes", "max_image_pixels",
                     "max_queued_image_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.salt_cache_by_api_key and not self.api_keys:
            raise ValueError("salt_cache_by_api_key needs API keys (--api-key): without them "
                             "every request is the same tenant")
