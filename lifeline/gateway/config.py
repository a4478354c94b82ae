"""`lifeline serve --config FILE`: the models a gateway serves and the backends behind them, read
from TOML or YAML and validated once, with errors that name the key at fault.

    [backends.NAME]   a local engine (`model` = a model spec) or an upstream OpenAI server
                      (`base_url`); docs/gateway.md lists every key.
    [models.NAME]     a route: aliases, pools of replicas with weights and a balancing
                      policy, a fallback chain, stickiness, attempt and first-token limits.
    [server] [health] [circuit_breaker]   the gateway's own settings.
    [ray]             where the Ray cluster of `kind = "ray"` backends is (docs/scale-out.md).
"""
from __future__ import annotations

import dataclasses
import os
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lifeline.engine.engine import EngineConfig
from lifeline.server.protocol import check_sampling_defaults
from lifeline.gateway.config_values import (
    ConfigError,
    Table,
    at_least_one,
    boolean,
    choice,
    integer,
    kind_of,
    names,
    non_negative,
    positive,
    size,
    sticky,
    tables,
    text,
)

def _sampling_defaults(value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ValueError(f"expected a table, got {kind_of(value)}")
    check_sampling_defaults(value)
    return dict(value)


BACKEND_OPTIONS: dict[str, Callable[[Any], Any]] = {
    "chat_template": text, "allow_request_chat_template": boolean,
    "reasoning_parser": choice(("think",)), "tool_call_parser": choice(("hermes",)),
    "max_queued_requests": integer(0), "request_timeout": positive,
    "default_max_tokens": integer(1), "max_n": integer(1),
    "sampling_defaults": _sampling_defaults, "allowed_media_domains": names,
    "media_fetch_timeout_s": positive, "max_images": integer(1), "max_image_bytes": size,
    "max_image_pixels": integer(1), "max_queued_image_bytes": size}
"""The `ServerConfig` options a local or Ray backend's engine server takes from its `server`
table (`lifeline serve --ray` gives its flags of these to every replica); each applies to the
requests that backend serves."""
_SET_IN_SERVER = ("set it in the file's [server] table: the gateway applies it to every request "
                  "before any backend sees it")
NOT_IN_A_BACKEND = {
    "api_keys": "set the keys in [server]: the gateway checks them, and a backend never sees a "
                "client's key",
    "admin_key": "set it in [server]: the gateway answers /debug/*, /dashboard/events and "
                 "/gateway/decisions for its backends",
    "protect_metrics": _SET_IN_SERVER, "rate_limit_rpm": _SET_IN_SERVER,
    "max_body_bytes": _SET_IN_SERVER, "shutdown_timeout": "set shutdown_timeout_s in [server]",
    "salt_cache_by_api_key": "set it in [server]: the gateway salts each request by its "
                             "caller's key (a backend never sees the key)",
    "rate_limit_tpm": "not behind the gateway: a backend never sees the caller's key, and the "
                      "gateway counts no tokens",
    "enable_fault_injection": "not behind the gateway: it does not pass X-Lifeline-Fault on",
    "otlp_endpoint": "not behind the gateway: it exports no spans",
    **{k: "not behind the gateway: it answers no CORS preflight" for k in (
        "allowed_origins", "allowed_methods", "allowed_headers", "allow_credentials")}}
"""`ServerConfig` options a backend's `server` table refuses, and why. With BACKEND_OPTIONS,
`served_model_name` and `engine` (keys of the backend itself) and the gateway's own, every
option of `lifeline serve` has one meaning at the gateway (tests/test_gateway_routing.py)."""
NOT_AT_THE_GATEWAY = {
    "rate_limit_tpm": "the gateway counts no tokens, so it cannot hold a token limit (nor can "
                      "its backends: they never see the caller's key)",
    "otlp_endpoint": "the gateway exports no spans"}
"""Options of `lifeline serve` that a gateway's [server] table refuses with a reason (any
other unknown key is refused too)."""
BACKEND_KEYS_OF_A_SERVER = ("served_model_name", "engine")
"""`ServerConfig` fields that a local or Ray backend sets with keys of its own."""
GATEWAY_OPTIONS = ("host", "port", "api_keys", "admin_key", "protect_metrics",
                   "rate_limit_rpm", "salt_cache_by_api_key", "max_body_bytes",
                   "max_json_depth", "shutdown_timeout")
"""`ServerConfig` fields the gateway itself applies ([server]; `max_json_depth` fixed)."""

POLICIES = ("least_outstanding", "power_of_two", "prefix_affinity", "round_robin")
KINDS = ("local", "upstream", "ray")
AUTOSCALING_KEYS: dict[str, Callable[[Any], Any]] = {
    "min_replicas": integer(0), "max_replicas": integer(1), "initial_replicas": integer(0),
    "target_ongoing_requests": positive, "upscale_delay_s": non_negative,
    "downscale_delay_s": non_negative, "metrics_interval_s": positive,
    "look_back_period_s": positive, "upscaling_factor": positive,
    "downscaling_factor": positive}
"""The autoscaling settings a `ray` backend passes to Ray Serve as they are (Ray's
`AutoscalingConfig` names)."""


@dataclass(frozen=True, slots=True)
class RaySpec:
    """How a `ray` backend's replicas run on Ray Serve."""
    replicas: int = 1
    """A fixed number of replicas (without `autoscaling`)."""
    autoscaling: tuple[tuple[str, Any], ...] = ()
    """Ray Serve's autoscaling settings; replaces `replicas` when given."""
    max_ongoing_requests: int | None = None
    """Requests one replica holds at once, queued in its engine included (default: the
    engine's `max_num_seqs`); Ray's router sends no more."""
    num_cpus: float = 1.0
    """CPUs Ray reserves for each replica."""
    router_policy: str = "least_outstanding"
    """Lifeline's policy inside Ray Serve's router (one of POLICIES)."""
    load_factor: float = 1.25
    health_check_period_s: float = 10.0
    graceful_shutdown_timeout_s: float = 20.0


@dataclass(frozen=True, slots=True)
class BackendSpec:
    name: str
    kind: str
    """'local': an engine in this process; 'upstream': an OpenAI-compatible server."""
    model: str | None
    """Upstream: the model name the upstream serves (None: the route's name). Local: the
    model spec (a GGUF file, an HF directory, `preset:NAME`; None: the default model)."""
    base_url: str | None = None
    """Upstream: where its OpenAI API lives, `/v1` included."""
    api_key: str | None = None
    """Upstream: the bearer key the gateway sends it (never the client's)."""
    honours_cache_salt: bool = False
    """Upstream: it keeps requests whose vLLM `cache_salt` differ out of each other's prefix
    cache (vLLM, Lifeline), so the gateway's `salt_cache_by_api_key` can work there."""
    served_model_name: str | None = None
    """Local: the name its server answers to (default: as `lifeline serve` names it)."""
    engine: EngineConfig | None = None
    server_options: dict[str, Any] = field(default_factory=dict)
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 600.0
    """Longest silence between two reads of a response."""
    first_token_timeout_s: float | None = None
    """A stream with no output token by then goes to the next backend (the route's own limit
    wins)."""
    max_concurrency: int | None = None
    """Requests in flight at once; a backend at its limit is skipped."""
    max_event_bytes: int = 1 << 20
    """The largest stream event it may send (and the most bytes of events held before the first
    output or after the end); past it, the answer is a `bad_response`."""
    max_response_bytes: int = 32 << 20
    """The largest whole (non-streaming) answer it may send; past it, a `bad_response`."""
    health_path: str = "/health"
    metrics_path: str | None = "/metrics"
    """Upstream: its Prometheus metrics, sampled while it has requests so that each one
    carries the upstream's side of its wait (`timings.backend.state`); None: not sampled."""
    state_interval_s: float = 0.25
    ray: RaySpec | None = None
    """Ray: how its replicas are deployed (the model and engine are `model` and `engine`)."""

    @property
    def root_url(self) -> str:
        """The upstream's server root (its `/health` lives there, not under `/v1`)."""
        base = (self.base_url or "").rstrip("/")
        return base.removesuffix("/v1")


@dataclass(frozen=True, slots=True)
class PoolSpec:
    """Replicas that share a route's traffic in proportion to `weight`."""
    name: str
    backends: tuple[str, ...]
    weight: float
    policy: str


@dataclass(frozen=True, slots=True)
class RouteSpec:
    name: str
    pools: tuple[PoolSpec, ...]
    aliases: tuple[str, ...] = ()
    fallbacks: tuple[str, ...] = ()
    """Backends tried, in order, after every pool's replicas."""
    sticky: tuple[str, ...] = ()
    """Where a session key is read, in order: 'user' (the body's field) or a header name."""
    max_attempts: int = 3
    first_token_timeout_s: float | None = None
    deadline_s: float = 900.0
    """A request's whole life at the gateway, every attempt and the relayed stream included."""
    prefix_chars: int = 256
    """Leading prompt characters hashed by `prefix_affinity`."""
    load_factor: float = 1.25
    """`prefix_affinity`'s bound: no replica takes more than this times its fair share."""


@dataclass(slots=True)
class GatewayConfig:
    backends: dict[str, BackendSpec]
    models: dict[str, RouteSpec]
    host: str | None = None
    port: int | None = None
    api_keys: list[str] = field(default_factory=list)
    protect_metrics: bool = False
    admin_key: str | None = None
    """The key of `/debug/*` and `/dashboard/events` (the local backends' records): once API
    keys are set, those paths answer to it alone."""
    rate_limit_rpm: int | None = None
    salt_cache_by_api_key: bool = False
    """Salt every request's prefix cache (and image embeddings) by its caller: the gateway
    sends each backend `cache_salt` = a keyed digest of the caller's API key (never the key;
    `lifeline.server.tenants.tenant_salt`) in place of the client's own salt."""
    max_body_bytes: int = 8 << 20
    max_json_depth: int = 64
    shutdown_timeout: float = 30.0
    default_model: str | None = None
    """The route of a request that names no model (default: the only one, if one)."""
    health_interval_s: float = 5.0
    health_timeout_s: float = 2.0
    unhealthy_after: int = 2
    """Consecutive failed health checks that take a backend out of rotation."""
    breaker_failures: int = 3
    """Consecutive failed requests that open a backend's circuit."""
    breaker_cooldown_s: float = 10.0
    ray_address: str | None = None
    """The Ray cluster of the `ray` backends (None: RAY_ADDRESS, else a local instance)."""
    ray_namespace: str = "lifeline"
    source: str = "<config>"

    def check(self) -> None:
        """What can be checked only once the command line's keys have joined the file's:
        raises ConfigError."""
        if not self.salt_cache_by_api_key:
            return
        where = f"{self.source}: server.salt_cache_by_api_key"
        if not self.api_keys:
            raise ConfigError(f"{where}: needs API keys (server.api_keys or --api-key): "
                              "without them every request is the same tenant")
        for name, spec in self.backends.items():
            if spec.kind == "upstream" and not spec.honours_cache_salt:
                raise ConfigError(
                    f"{where}: backend {name!r} is an upstream server, where the gateway can "
                    f"keep tenants apart only through vLLM's cache_salt: set "
                    f"`honours_cache_salt = true` in backends.{name} if it takes it (vLLM, "
                    "Lifeline), or serve that model from another gateway")

    def names(self) -> dict[str, str]:
        """Every name a client may ask for (models and aliases) -> its route."""
        out = {}
        for route in self.models.values():
            out[route.name] = route.name
            out.update({alias: route.name for alias in route.aliases})
        return out


def backend_body_limit(config: GatewayConfig) -> int:
    """The body limit of a local or Ray backend's server: the gateway holds clients to its own
    `max_body_bytes`, and re-serialises what it forwards (spaces after separators, the model's
    name, the cache salt), which may be a little larger than what the client sent."""
    return 2 * config.max_body_bytes


def load_config(path: str | Path) -> GatewayConfig:
    """Read and validate a TOML (`.toml`) or YAML (`.yaml`, `.yml`) gateway file."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the config: {exc.strerror or exc}") from None
    return parse_config(text, path.suffix.lower(), str(path))


def parse_config(text: str, suffix: str, source: str = "<config>") -> GatewayConfig:
    if suffix in (".yaml", ".yml"):
        import yaml

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ConfigError(f"{source}: not valid YAML: {exc}") from None
    elif suffix == ".toml":
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{source}: not valid TOML: {exc}") from None
    else:
        raise ConfigError(f"{source}: the config must be a .toml, .yaml or .yml file")
    return _Builder(source).build(data)


class _Builder:
    def __init__(self, source: str):
        self.source = source

    def build(self, data: Any) -> GatewayConfig:
        if data is None:
            data = {}
        top = Table(data, "", self.source)
        server = top.table("server", None)
        health = top.table("health", None)
        breaker = top.table("circuit_breaker", None)
        ray = top.table("ray", None)
        backends_table = top.table("backends")
        models_table = top.table("models")
        top.done()
        backends = {name: self.backend(name, backends_table) for name in
                    list(backends_table.data)}
        if not backends:
            raise ConfigError(f"{self.source}: backends: declare at least one backend")
        models = {name: self.route(name, models_table, backends) for name in
                  list(models_table.data)}
        if not models:
            raise ConfigError(f"{self.source}: models: declare at least one model")
        config = GatewayConfig(backends=backends, models=models, source=self.source)
        self.check_names(config)
        if server is not None:
            self.server(server, config)
        for spec in backends.values():
            if spec.kind != "upstream":
                spec.server_options["max_body_bytes"] = backend_body_limit(config)
        if health is not None:
            config.health_interval_s = health.get("interval_s", positive, 5.0)
            config.health_timeout_s = health.get("timeout_s", positive, 2.0)
            config.unhealthy_after = health.get("unhealthy_after", integer(1), 2)
            health.done()
        if breaker is not None:
            config.breaker_failures = breaker.get("failures", integer(1), 3)
            config.breaker_cooldown_s = breaker.get("cooldown_s", positive, 10.0)
            breaker.done()
        if ray is not None:
            config.ray_address = ray.get("address", text, None)
            config.ray_namespace = ray.get("namespace", text, "lifeline")
            ray.done()
        return config

    def server(self, t: Table, config: GatewayConfig) -> None:
        config.host = t.get("host", text, None)
        config.port = t.get("port", integer(0), None)
        config.api_keys = list(t.get("api_keys", names, ()))
        config.protect_metrics = t.get("protect_metrics", boolean, False)
        config.admin_key = t.get("admin_key", text, None)
        if config.admin_key == "":
            raise t.fail("admin_key", "the admin key may not be empty")
        config.rate_limit_rpm = t.get("rate_limit_rpm", integer(1), None)
        config.salt_cache_by_api_key = t.get("salt_cache_by_api_key", boolean, False)
        config.max_body_bytes = t.get("max_body_bytes", size, 8 << 20)
        config.shutdown_timeout = t.get("shutdown_timeout_s", non_negative, 30.0)
        default = t.get("default_model", text, None)
        if default is not None and default not in config.names():
            raise t.fail("default_model", f"no model or alias named {default!r}")
        config.default_model = default
        for key, why in NOT_AT_THE_GATEWAY.items():
            if key in t.data:
                raise t.fail(key, why)
        t.done()

    def backend(self, name: str, parent: Table) -> BackendSpec:
        t = parent.table(name)
        base_url = t.get("base_url", text, None)
        kind = t.get("kind", text, "upstream" if base_url else "local")
        if kind not in KINDS:
            raise t.fail("kind", f"expected one of {', '.join(KINDS)}, got {kind!r}")
        common = dict(
            name=name, kind=kind, model=t.get("model", text, None),
            connect_timeout_s=t.get("connect_timeout_s", positive, 5.0),
            read_timeout_s=t.get("read_timeout_s", positive, 600.0),
            first_token_timeout_s=t.get("first_token_timeout_s", positive, None),
            max_concurrency=t.get("max_concurrency", integer(1), None),
            max_event_bytes=t.get("max_event_bytes", size, 1 << 20),
            max_response_bytes=t.get("max_response_bytes", size, 32 << 20))
        if kind == "upstream":
            if base_url is None:
                raise t.fail("base_url", "required for an upstream backend")
            if not base_url.startswith(("http://", "https://")):
                raise t.fail("base_url", f"expected an http:// or https:// URL, got "
                             f"{base_url!r}")
            key = t.get("api_key", text, None)
            env = t.get("api_key_env", text, None)
            if env is not None:
                if env not in os.environ:
                    raise t.fail("api_key_env", f"the environment has no {env!r}")
                key = os.environ[env]
            metrics = t.get("metrics_path", text, "/metrics")
            spec = BackendSpec(**common, base_url=base_url, api_key=key,
                               honours_cache_salt=t.get("honours_cache_salt", boolean, False),
                               health_path=t.get("health_path", text, "/health"),
                               metrics_path=metrics or None,
                               state_interval_s=t.get("state_interval_s", positive, 0.25))
        else:
            if base_url is not None:
                raise t.fail("base_url", f"a {kind} backend has no base_url")
            ray = self.ray_deployment(t) if kind == "ray" else None
            engine = self.engine(t.table("engine", None))
            options = self.server_options(t.table("server", None))
            spec = BackendSpec(**common, engine=engine, server_options=options,
                               served_model_name=t.get("served_model_name", text, None),
                               ray=ray)
        t.done()
        return spec

    def ray_deployment(self, t: Table) -> RaySpec:
        """A `ray` backend's deployment keys (docs/scale-out.md); Ray must be installed."""
        import importlib.util

        if importlib.util.find_spec("ray") is None:
            raise t.fail("kind", "a ray backend needs Ray Serve: pip install 'lifeline[ray]'")
        replicas = t.get("replicas", integer(1), None)
        scaling = t.table("autoscaling", None)
        autoscaling: dict[str, Any] = {}
        if scaling is not None:
            if replicas is not None:
                raise t.fail("replicas", "give either `replicas` or `autoscaling`")
            autoscaling = {k: scaling.get(k, check) for k, check in AUTOSCALING_KEYS.items()
                           if k in scaling.data}
            scaling.known.extend(AUTOSCALING_KEYS)
            scaling.done()
            low, high = autoscaling.get("min_replicas", 1), autoscaling.get("max_replicas", 1)
            if low > high:
                raise scaling.fail("min_replicas", f"{low} is above max_replicas ({high})")
        return RaySpec(
            replicas=replicas or 1, autoscaling=tuple(autoscaling.items()),
            max_ongoing_requests=t.get("max_ongoing_requests", integer(1), None),
            num_cpus=t.get("num_cpus", positive, 1.0),
            router_policy=t.get("router_policy", choice(POLICIES), "least_outstanding"),
            load_factor=t.get("load_factor", at_least_one, 1.25),
            health_check_period_s=t.get("health_check_period_s", positive, 10.0),
            graceful_shutdown_timeout_s=t.get("graceful_shutdown_timeout_s", non_negative,
                                              20.0))

    def engine(self, t: Table | None) -> EngineConfig:
        """A local backend's engine options; the command line's defaults (DEFAULT_WEIGHTS,
        compiled) where the file says nothing."""
        from lifeline.cli import (DEFAULT_KV_CACHE_BYTES, DEFAULT_KV_CACHE_DTYPE,
                                  DEFAULT_WEIGHTS, KV_CACHE_DTYPES, WEIGHT_FORMATS)

        values: dict[str, Any] = {"weights": DEFAULT_WEIGHTS, "compile": True,
                                  "compile_in_background": True, "adaptive_threads": True,
                                  "kv_cache_memory_bytes": DEFAULT_KV_CACHE_BYTES,
                                  "kv_cache_dtype": DEFAULT_KV_CACHE_DTYPE}
        if t is None:
            return EngineConfig(**values)
        if "kv_cache_dtype" not in t.data and str(t.data.get("device", "cpu")) != "cpu":
            values["kv_cache_dtype"] = "auto"
        fields = {f.name: str(f.type) for f in dataclasses.fields(EngineConfig)}
        for key in list(t.data):
            if key not in fields:
                raise t.fail(str(key), f"unknown key (known here: {', '.join(fields)})")
            kind = fields[key]
            if key == "kv_cache_memory_bytes":
                check: Callable[[Any], Any] = size
            elif key == "weights":
                check = choice(WEIGHT_FORMATS)
            elif key == "kv_cache_dtype":
                check = choice(KV_CACHE_DTYPES)
            elif "bool" in kind:
                check = boolean
            elif key == "step_log_size":
                check = integer(0)
            elif "int" in kind:
                check = integer(1)
            else:
                check = text
            values[key] = t.get(key, check)
        try:
            return EngineConfig(**values)
        except ValueError as exc:
            raise ConfigError(f"{self.source}: {t.path}: {exc}") from None

    def server_options(self, t: Table | None) -> dict[str, Any]:
        """A local or Ray backend's `server` table: the options of its engine's server
        (`BACKEND_OPTIONS`); one the gateway applies itself, or cannot, is refused with
        where it goes or why (`NOT_IN_A_BACKEND`)."""
        if t is None:
            return {}
        for key, why in NOT_IN_A_BACKEND.items():
            if key in t.data:
                raise t.fail(key, why)
        out = {key: t.get(key, check) for key, check in BACKEND_OPTIONS.items()
               if key in t.data}
        t.known.extend(BACKEND_OPTIONS)
        t.done()
        if "chat_template" in out:
            out["chat_template"] = Path(out["chat_template"])
        if "allowed_media_domains" in out:
            out["allowed_media_domains"] = list(out["allowed_media_domains"])
        return out

    def route(self, name: str, parent: Table, backends: dict[str, BackendSpec]) -> RouteSpec:
        t = parent.table(name)
        policy = t.get("policy", choice(POLICIES), "least_outstanding")
        listed = t.get("backends", names, None)
        pools_data = t.get("pools", tables, None)
        if (listed is None) == (pools_data is None):
            raise t.fail("backends", "give either `backends` (one pool) or `pools`")
        if listed is not None:
            self.known(t, "backends", listed, backends)
            pools = (PoolSpec(name, listed, 1.0, policy),)
        else:
            pools = tuple(self.pool(t, i, item, policy, backends)
                          for i, item in enumerate(pools_data))
            seen: set[str] = set()
            for pool in pools:
                if pool.name in seen:
                    raise t.fail("pools", f"two pools are named {pool.name!r}")
                seen.add(pool.name)
        fallbacks = t.get("fallbacks", names, ())
        self.known(t, "fallbacks", fallbacks, backends)
        route = RouteSpec(
            name=name, pools=pools, aliases=t.get("aliases", names, ()), fallbacks=fallbacks,
            sticky=t.get("sticky", sticky, ()),
            max_attempts=t.get("max_attempts", integer(1), 3),
            first_token_timeout_s=t.get("first_token_timeout_s", positive, None),
            deadline_s=t.get("deadline_s", positive, 900.0),
            prefix_chars=t.get("prefix_chars", integer(1), 256),
            load_factor=t.get("load_factor", at_least_one, 1.25))
        t.done()
        return route

    def pool(self, route: Table, index: int, data: Any, policy: str,
             backends: dict[str, BackendSpec]) -> PoolSpec:
        t = Table(data, f"{route.key('pools')}[{index}]", self.source)
        listed = t.get("backends", names)
        self.known(t, "backends", listed, backends)
        pool = PoolSpec(name=t.get("name", text, f"pool{index}"), backends=listed,
                        weight=t.get("weight", positive, 1.0),
                        policy=t.get("policy", choice(POLICIES), policy))
        t.done()
        return pool

    @staticmethod
    def known(t: Table, key: str, names: tuple[str, ...],
              backends: dict[str, BackendSpec]) -> None:
        if key == "backends" and not names:
            raise t.fail(key, "list at least one backend")
        for i, item in enumerate(names):
            if item not in backends:
                raise t.fail(f"{key}[{i}]", f"no backend named {item!r} (backends: "
                             f"{', '.join(backends)})")
        if len(set(names)) != len(names):
            raise t.fail(key, "a backend is listed twice")

    def check_names(self, config: GatewayConfig) -> None:
        seen: dict[str, str] = {}
        for route in config.models.values():
            for i, name in enumerate((route.name, *route.aliases)):
                key = f"models.{route.name}" + ("" if i == 0 else f".aliases[{i - 1}]")
                if name in seen:
                    raise ConfigError(f"{self.source}: {key}: {name!r} is already "
                                      f"{seen[name]}")
                seen[name] = f"a name of models.{route.name}"
