"""`lifeline serve --config FILE`: the models a gateway serves and the backends behind them, read
from TOML or YAML and validated once, with errors that name the key at fault.

    [backends.NAME]   a local engine (`model` = a model spec) or an upstream OpenAI server
                      (`base_url`); docs/gateway.md lists every key.
    [models.NAME]     a route: aliases, pools of replicas with weights and a balancing
                      policy, a fallback chain, stickiness, attempt and first-token limits.
    [server] [health] [circuit_breaker]   the gateway's own settings.
"""
from __future__ import annotations

import dataclasses
import math
import os
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lifeline.engine.engine import EngineConfig

POLICIES = ("least_outstanding", "power_of_two", "prefix_affinity", "round_robin")
KINDS = ("local", "upstream")
LOCAL_SERVER_KEYS = ("chat_template", "allow_request_chat_template", "reasoning_parser",
                     "tool_call_parser", "max_queued_requests", "request_timeout",
                     "default_max_tokens", "salt_cache_by_api_key", "enable_fault_injection",
                     "max_n")
"""`ServerConfig` fields a local backend may set (`[backends.NAME.server]`)."""
_MISSING = object()


class ConfigError(ValueError):
    """A configuration that cannot be served; the message names the file and the key."""


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
    health_path: str = "/health"

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
    rate_limit_rpm: int | None = None
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
    source: str = "<config>"

    def names(self) -> dict[str, str]:
        """Every name a client may ask for (models and aliases) -> its route."""
        out = {}
        for route in self.models.values():
            out[route.name] = route.name
            out.update({alias: route.name for alias in route.aliases})
        return out


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


class _Table:
    """One mapping of the file, read key by key; `done` rejects the keys nobody read."""

    def __init__(self, data: Any, path: str, source: str):
        if not isinstance(data, dict):
            raise ConfigError(f"{source}: {path or 'the file'}: expected a table, "
                              f"got {_kind(data)}")
        self.data, self.path, self.source = dict(data), path, source
        self.known: list[str] = []

    def key(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def fail(self, key: str, message: str) -> ConfigError:
        return ConfigError(f"{self.source}: {self.key(key)}: {message}")

    def get(self, key: str, check: Callable[[Any], Any], default: Any = _MISSING) -> Any:
        self.known.append(key)
        if key not in self.data:
            if default is _MISSING:
                raise self.fail(key, "required")
            return default
        value = self.data.pop(key)
        try:
            return check(value)
        except (TypeError, ValueError) as exc:
            raise self.fail(key, str(exc)) from None

    def table(self, key: str, default: Any = _MISSING) -> _Table | None:
        self.known.append(key)
        if key not in self.data:
            if default is _MISSING:
                raise self.fail(key, "required")
            return default
        return _Table(self.data.pop(key), self.key(key), self.source)

    def done(self) -> None:
        for key in self.data:
            known = ", ".join(sorted(self.known)) or "none"
            raise self.fail(str(key), f"unknown key (known here: {known})")


def _kind(value: Any) -> str:
    return {dict: "a table", list: "a list", str: "a string", bool: "a boolean",
            int: "an integer", float: "a number"}.get(type(value), type(value).__name__)


def _str(value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"expected a non-empty string, got {_kind(value)}")
    return value


def _bool(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"expected true or false, got {_kind(value)}")
    return value


def _int(low: int) -> Callable[[Any], int]:
    def check(value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"expected an integer, got {_kind(value)}")
        if value < low:
            raise ValueError(f"must be at least {low}, got {value}")
        return value
    return check


def _positive(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"expected a number, got {_kind(value)}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"must be a positive number, got {value}")
    return float(value)


def _non_negative(value: Any) -> float:
    if isinstance(value, int | float) and not isinstance(value, bool) and value == 0:
        return 0.0
    return _positive(value)


def _names(value: Any) -> tuple[str, ...]:
    if not isinstance(value, list):
        raise ValueError(f"expected a list of names, got {_kind(value)}")
    for i, item in enumerate(value):
        if not isinstance(item, str) or not item:
            raise ValueError(f"item {i}: expected a non-empty string, got {_kind(item)}")
    return tuple(value)


def _sticky(value: Any) -> tuple[str, ...]:
    if value is True:
        return ("x-session-id", "user")
    if value is False:
        return ()
    if isinstance(value, str):
        value = [value]
    sources = _names(value)
    return tuple(s if s == "user" else s.lower() for s in sources)


def _bytes(value: Any) -> int:
    if isinstance(value, str):
        from lifeline.cli import parse_bytes

        try:
            return parse_bytes(value)
        except Exception as exc:  # argparse.ArgumentTypeError
            raise ValueError(str(exc)) from None
    return _int(1)(value)


class _Builder:
    def __init__(self, source: str):
        self.source = source

    def build(self, data: Any) -> GatewayConfig:
        if data is None:
            data = {}
        top = _Table(data, "", self.source)
        server = top.table("server", None)
        health = top.table("health", None)
        breaker = top.table("circuit_breaker", None)
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
        if health is not None:
            config.health_interval_s = health.get("interval_s", _positive, 5.0)
            config.health_timeout_s = health.get("timeout_s", _positive, 2.0)
            config.unhealthy_after = health.get("unhealthy_after", _int(1), 2)
            health.done()
        if breaker is not None:
            config.breaker_failures = breaker.get("failures", _int(1), 3)
            config.breaker_cooldown_s = breaker.get("cooldown_s", _positive, 10.0)
            breaker.done()
        return config

    def server(self, t: _Table, config: GatewayConfig) -> None:
        config.host = t.get("host", _str, None)
        config.port = t.get("port", _int(0), None)
        config.api_keys = list(t.get("api_keys", _names, ()))
        config.protect_metrics = t.get("protect_metrics", _bool, False)
        config.rate_limit_rpm = t.get("rate_limit_rpm", _int(1), None)
        config.max_body_bytes = t.get("max_body_bytes", _bytes, 8 << 20)
        config.shutdown_timeout = t.get("shutdown_timeout_s", _non_negative, 30.0)
        default = t.get("default_model", _str, None)
        if default is not None and default not in config.names():
            raise t.fail("default_model", f"no model or alias named {default!r}")
        config.default_model = default
        t.done()

    def backend(self, name: str, parent: _Table) -> BackendSpec:
        t = parent.table(name)
        base_url = t.get("base_url", _str, None)
        kind = t.get("kind", _str, "upstream" if base_url else "local")
        if kind not in KINDS:
            raise t.fail("kind", f"expected one of {', '.join(KINDS)}, got {kind!r}")
        common = dict(
            name=name, kind=kind, model=t.get("model", _str, None),
            connect_timeout_s=t.get("connect_timeout_s", _positive, 5.0),
            read_timeout_s=t.get("read_timeout_s", _positive, 600.0),
            first_token_timeout_s=t.get("first_token_timeout_s", _positive, None),
            max_concurrency=t.get("max_concurrency", _int(1), None))
        if kind == "upstream":
            if base_url is None:
                raise t.fail("base_url", "required for an upstream backend")
            if not base_url.startswith(("http://", "https://")):
                raise t.fail("base_url", f"expected an http:// or https:// URL, got "
                             f"{base_url!r}")
            key = t.get("api_key", _str, None)
            env = t.get("api_key_env", _str, None)
            if env is not None:
                if env not in os.environ:
                    raise t.fail("api_key_env", f"the environment has no {env!r}")
                key = os.environ[env]
            spec = BackendSpec(**common, base_url=base_url, api_key=key,
                               health_path=t.get("health_path", _str, "/health"))
        else:
            if base_url is not None:
                raise t.fail("base_url", "a local backend has no base_url")
            engine = self.engine(t.table("engine", None))
            options = self.server_options(t.table("server", None))
            spec = BackendSpec(**common, engine=engine, server_options=options,
                               served_model_name=t.get("served_model_name", _str, None))
        t.done()
        return spec

    def engine(self, t: _Table | None) -> EngineConfig:
        """A local backend's engine options; the command line's defaults (int8-all weights,
        compiled) where the file says nothing."""
        from lifeline.cli import DEFAULT_KV_CACHE_BYTES, DEFAULT_WEIGHTS, WEIGHT_FORMATS

        values: dict[str, Any] = {"weights": DEFAULT_WEIGHTS, "compile": True,
                                  "kv_cache_memory_bytes": DEFAULT_KV_CACHE_BYTES}
        if t is None:
            return EngineConfig(**values)
        fields = {f.name: str(f.type) for f in dataclasses.fields(EngineConfig)}
        for key in list(t.data):
            if key not in fields:
                raise t.fail(str(key), f"unknown key (known here: {', '.join(fields)})")
            kind = fields[key]
            if key == "kv_cache_memory_bytes":
                check: Callable[[Any], Any] = _bytes
            elif key == "weights":
                check = _choice(WEIGHT_FORMATS)
            elif "bool" in kind:
                check = _bool
            elif "int" in kind:
                check = _int(1)
            else:
                check = _str
            values[key] = t.get(key, check)
        try:
            return EngineConfig(**values)
        except ValueError as exc:
            raise ConfigError(f"{self.source}: {t.path}: {exc}") from None

    def server_options(self, t: _Table | None) -> dict[str, Any]:
        if t is None:
            return {}
        checks: dict[str, Callable[[Any], Any]] = {
            "chat_template": _str, "allow_request_chat_template": _bool,
            "reasoning_parser": _choice(("think",)), "tool_call_parser": _choice(("hermes",)),
            "max_queued_requests": _int(0), "request_timeout": _positive,
            "default_max_tokens": _int(1), "salt_cache_by_api_key": _bool,
            "enable_fault_injection": _bool, "max_n": _int(1)}
        out = {key: t.get(key, check) for key, check in checks.items() if key in t.data}
        t.known.extend(checks)
        t.done()
        if "chat_template" in out:
            out["chat_template"] = Path(out["chat_template"])
        return out

    def route(self, name: str, parent: _Table, backends: dict[str, BackendSpec]) -> RouteSpec:
        t = parent.table(name)
        policy = t.get("policy", _choice(POLICIES), "least_outstanding")
        listed = t.get("backends", _names, None)
        pools_data = t.get("pools", _list_of_tables, None)
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
        fallbacks = t.get("fallbacks", _names, ())
        self.known(t, "fallbacks", fallbacks, backends)
        route = RouteSpec(
            name=name, pools=pools, aliases=t.get("aliases", _names, ()), fallbacks=fallbacks,
            sticky=t.get("sticky", _sticky_check, ()),
            max_attempts=t.get("max_attempts", _int(1), 3),
            first_token_timeout_s=t.get("first_token_timeout_s", _positive, None),
            prefix_chars=t.get("prefix_chars", _int(1), 256),
            load_factor=t.get("load_factor", _at_least_one, 1.25))
        t.done()
        return route

    def pool(self, route: _Table, index: int, data: Any, policy: str,
             backends: dict[str, BackendSpec]) -> PoolSpec:
        t = _Table(data, f"{route.key('pools')}[{index}]", self.source)
        listed = t.get("backends", _names)
        self.known(t, "backends", listed, backends)
        pool = PoolSpec(name=t.get("name", _str, f"pool{index}"), backends=listed,
                        weight=t.get("weight", _positive, 1.0),
                        policy=t.get("policy", _choice(POLICIES), policy))
        t.done()
        return pool

    @staticmethod
    def known(t: _Table, key: str, names: tuple[str, ...],
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


def _choice(options: tuple[str, ...]) -> Callable[[Any], str]:
    def check(value: Any) -> str:
        if value not in options:
            raise ValueError(f"expected one of {', '.join(options)}, got {value!r}")
        return value
    return check


def _list_of_tables(value: Any) -> list[Any]:
    if not isinstance(value, list) or not value:
        raise ValueError(f"expected a non-empty list of tables, got {_kind(value)}")
    return value


def _sticky_check(value: Any) -> tuple[str, ...]:
    if not isinstance(value, bool | str | list):
        raise ValueError(f"expected true, false, 'user', a header name or a list of them, "
                         f"got {_kind(value)}")
    return _sticky(value)


def _at_least_one(value: Any) -> float:
    number = _positive(value)
    if number < 1:
        raise ValueError(f"must be at least 1, got {value}")
    return number
