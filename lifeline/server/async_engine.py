"""The in-process `EngineClient`: an `LLMEngine` on its own thread, so the event loop stays
free while a step runs.

The engine is not thread-safe: every call into it (add, abort, step) happens on the engine
thread. Callers talk to it through a command queue; outputs come back to each request's
asyncio queue via `call_soon_threadsafe`, all of a step's outputs in one call, each a
snapshot (`GenerationOutput`) taken on the engine thread: nothing the loop reads is shared
with the live `Request`.

The engine thread also builds the engine (and, for `lifeline serve`, loads the model): it
should be the only live thread that has run PyTorch's parallel CPU kernels. Each such thread
keeps its own OpenMP team (libgomp), and once the teams' threads outnumber the cores, libgomp
stops letting idle workers spin, so every parallel kernel pays a futex wake-up (what that cost
a decode when the model was prepared on the event loop's thread: docs/performance.md).
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from lifeline.engine.background_compile import engine_building, engine_built
from lifeline.engine.engine import LLMEngine, RequestOutput
from lifeline.engine.kv_layout import kv_bytes_per_token
from lifeline.model.weight_format import trim_heap
from lifeline.engine.request import RequestError, Timeline
from lifeline.engine.sampling_params import SamplingParams
from lifeline.engine.step_log import StepLog
from lifeline.observe.stats import EngineStats
from lifeline.server.engine_client import (
    EngineClient,
    EngineDeadError,
    GenerationOutput,
    ModelInfo,
)
from lifeline.server.errors import APIError

log = logging.getLogger("lifeline.engine")


def _dead(cause: BaseException) -> EngineDeadError:
    return EngineDeadError(f"the engine stopped: {cause!r}")


def request_failed(error: RequestError, timeline: Timeline | None = None) -> APIError:
    """The OpenAI-format error of a request the engine ended without an answer, carrying the
    engine's copy of its `timeline` (for the request's record)."""
    api_error = _request_error(error)
    api_error.timeline = timeline
    return api_error


def _request_error(error: RequestError) -> APIError:
    if error is RequestError.TIMEOUT:
        return APIError(503, "the request waited longer than the server's request timeout "
                        "without producing a token; the server is overloaded, retry later",
                        None, "request_timeout", 1.0)
    if error is RequestError.UNSCHEDULABLE:
        return APIError(400, "the request does not fit the server's KV cache", None,
                        "context_length_exceeded")
    return APIError(500, "the engine failed while running this request (the failure is "
                    "logged; other requests were not affected)", None, "engine_error")


@dataclass(slots=True)
class _Add:
    prompt: list[int]
    params: SamplingParams
    request_id: str
    arrival: float
    sink: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    accepted: asyncio.Future
    cache_salt: str | None = None
    deadline: float | None = None
    fault: str | None = None
    client_id: str | None = None
    choice_index: int | None = None
    images: tuple = ()


@dataclass(slots=True)
class _Sink:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    fresh: bool = True
    """No output delivered yet (the first one carries a copy of the timeline)."""


@dataclass(frozen=True, slots=True)
class _Failed:
    """Delivered instead of the output of a request the engine ended without an answer."""
    error: RequestError
    timeline: Timeline
    """A copy of the request's timeline as the engine ended it."""


class AsyncEngine(EngineClient):
    """`build` makes the engine on the engine thread (`start()` returns at once;
    `wait_started()` returns once `engine` exists, or raises why not)."""

    def __init__(self, build: Callable[[], LLMEngine]):
        self.build = build
        self.engine: LLMEngine | None = None
        """The engine itself: only the engine thread may call into it (tests read it)."""
        self.built = threading.Event()
        self._commands: queue.Queue[Any] = queue.Queue()
        self._sinks: dict[str, _Sink] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lifeline-engine", daemon=True)
        self.error: BaseException | None = None
        self._info: ModelInfo | None = None

    def start(self) -> None:
        engine_building()  # counted before the thread starts: another engine's graphs wait
        try:
            self._thread.start()
        except BaseException:
            engine_built()
            raise

    def wait_started(self, timeout: float | None = None) -> bool:
        if not self.built.wait(timeout):
            return False
        if self.engine is None:
            raise self.error or RuntimeError("the engine is not built")
        return True

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._commands.put(None)
        self._thread.join(timeout)

    @property
    def dead_error(self) -> BaseException | None:
        return self.error

    @property
    def tokenizer(self) -> Any:
        return self._built().tokenizer

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._built().tokenizer.encode(text, add_special_tokens)

    def detokenize(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        return self._built().tokenizer.decode(token_ids, skip_special_tokens)

    def model_info(self) -> ModelInfo:
        if self._info is None:
            self._info = _model_info(self._built())
        return self._info

    def stats(self) -> EngineStats:
        return EngineStats() if self.engine is None else EngineStats.of(self.engine)

    @property
    def step_log(self) -> StepLog | None:
        return None if self.engine is None else self.engine.step_log

    def _built(self) -> LLMEngine:
        if self.engine is None:
            raise RuntimeError("the engine is not built yet")
        return self.engine

    async def generate(self, prompt_ids: list[int], params: SamplingParams, request_id: str, *,
                       arrival: float, cache_salt: str | None = None,
                       deadline: float | None = None, fault: str | None = None,
                       client_id: str | None = None, choice_index: int | None = None,
                       images: Sequence[Any] = ()) -> AsyncIterator[GenerationOutput]:
        if self.error is not None:
            raise _dead(self.error)
        loop = asyncio.get_running_loop()
        sink: asyncio.Queue = asyncio.Queue()
        accepted = loop.create_future()
        self._commands.put(_Add(prompt_ids, params, request_id, arrival, sink, loop, accepted,
                                cache_salt, deadline, fault, client_id, choice_index,
                                tuple(images)))
        if self.error is not None:  # the loop died before it could take the add, or drained it
            raise _dead(self.error)
        try:
            await accepted
        except asyncio.CancelledError:
            self.abort(request_id)  # queued after the add, so it finds the request
            raise
        finished = False
        try:
            while True:
                out = await sink.get()
                if isinstance(out, BaseException):
                    raise _dead(out)
                if isinstance(out, _Failed):
                    finished = True
                    raise request_failed(out.error, out.timeline)
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    def _run(self) -> None:
        try:
            self.engine = self.build()
        except BaseException as exc:  # noqa: BLE001 - reported by whoever waits on `built`
            self.error = exc
            return
        finally:
            engine_built()
            self.built.set()
        try:
            stepped = True  # the build's and warm-up's temporaries too
            while not self._stop.is_set():
                busy = self.engine.has_unfinished_requests()
                self._drain_commands(block=not busy)
                if self.engine.has_unfinished_requests():
                    self._step()
                    stepped = True
                elif stepped and not busy:  # idle for a wait (0.5 s) after some steps
                    # what the steps freed goes back to the system: after 16 users' 48
                    # requests on Gemma 3 the heap held ~300 MB more (docs/performance.md)
                    trim_heap()
                    stepped = False
        except BaseException as exc:  # noqa: BLE001 - handed to every waiting request
            self.error = exc  # set before the queue is drained: `generate` checks it after
            log.critical("the engine loop stopped", exc_info=exc)
            for target in self._sinks.values():
                _call(target.loop, target.queue.put_nowait, exc)
            self._refuse_queued(exc)
        finally:
            self.engine.close()

    def _refuse_queued(self, exc: BaseException) -> None:
        """Settle every add still queued with the engine's death, so no caller waits on an
        engine that will never take it."""
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(cmd, _Add):
                _call(cmd.loop, _settle, cmd.accepted, _dead(exc))

    def _drain_commands(self, block: bool) -> None:
        while True:
            try:
                cmd = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
            except queue.Empty:
                return
            block = False
            if cmd is None:
                return
            if isinstance(cmd, _Add):
                self._add(cmd)
            else:
                self._abort(cmd[1])

    def _add(self, cmd: _Add) -> None:
        try:
            self.engine.add_request(cmd.prompt, cmd.params, cmd.request_id, cmd.arrival,
                                    cache_salt=cmd.cache_salt, deadline=cmd.deadline,
                                    fault=cmd.fault, client_id=cmd.client_id,
                                    choice_index=cmd.choice_index,
                                    **({"images": cmd.images} if cmd.images else {}))
        except Exception as exc:  # noqa: BLE001 - validation errors go back to the caller
            _call(cmd.loop, _settle, cmd.accepted, exc)
            return
        self._sinks[cmd.request_id] = _Sink(cmd.loop, cmd.sink)
        if not _call(cmd.loop, _settle, cmd.accepted, None):
            self._abort(cmd.request_id)

    def _abort(self, request_id: str) -> None:
        self.engine.abort_request(request_id)
        self._sinks.pop(request_id, None)

    def _step(self) -> None:
        outputs = self.engine.step()
        deliveries: dict[asyncio.AbstractEventLoop, list[tuple[str, asyncio.Queue, Any]]] = {}
        for out in outputs:
            target = self._sinks.get(out.request_id)
            if out.finished:
                self._sinks.pop(out.request_id, None)
            if target is not None:
                if out.error is not None:
                    item: Any = _Failed(out.error, _copy(out.request.timeline))
                else:
                    item = _snapshot(out, target.fresh)
                target.fresh = False
                deliveries.setdefault(target.loop, []).append((out.request_id, target.queue,
                                                               item))
        # one wake-up of each loop per step, not one per output: each is a write to the
        # loop's self-pipe, and on a machine whose cores all run the step, each wake-up can
        # preempt it (16 streams: 16 wake-ups a step)
        for loop, items in deliveries.items():
            if not _call(loop, _deliver, items):
                for request_id, _, _ in items:  # nobody can read them any more
                    self._abort(request_id)


def _snapshot(out: RequestOutput, first: bool) -> GenerationOutput:
    """`out` as the loop may read it: nothing in it changes when the engine steps again."""
    req = out.request
    timeline = req.timeline
    return GenerationOutput(
        out.request_id, tuple(out.new_token_ids), out.new_text, out.text, out.finished,
        out.finish_reason, timeline.token_times[-1] if out.new_token_ids else None,
        req.num_cached_tokens, tuple(out.new_logprobs),
        None if out.prompt_logprobs is None else tuple(out.prompt_logprobs),
        _copy(timeline) if first or out.finished else None)


def _copy(timeline: Timeline) -> Timeline:
    steps = timeline.steps
    return dataclasses.replace(timeline, prefill_chunks=list(timeline.prefill_chunks),
                               token_times=list(timeline.token_times),
                               preemptions=list(timeline.preemptions),
                               steps=None if steps is None else steps.copy())


def _model_info(engine: LLMEngine) -> ModelInfo:
    loaded, cfg = engine.loaded, engine.loaded.config
    return ModelInfo(
        source=str(loaded.source), architecture=cfg.architecture, vocab_size=cfg.vocab_size,
        max_model_len=engine.max_model_len,
        max_model_len_limited_by=engine.max_model_len_reason, context_length=cfg.max_position,
        num_params=cfg.num_params(), num_active_params=cfg.num_active_params(),
        weight_format=loaded.weight_format, vision=cfg.vision,
        kv_bytes_per_token=round(kv_bytes_per_token(cfg, engine.config.kv_dtype_bytes,
                                                    cfg.num_layers)),
        kv_pool_bytes=round(engine.kv_layout.total_bytes),
        startup=MappingProxyType(engine.startup.ordered()),
        chat_template=getattr(loaded, "chat_template", None))


def _call(loop: asyncio.AbstractEventLoop, fn: Callable[..., None], *args: Any) -> bool:
    """`fn(*args)` on `loop`; False when the loop has closed."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:
        return False
    return True


def _deliver(items: list[tuple[str, asyncio.Queue, Any]]) -> None:
    for _, sink, item in items:
        sink.put_nowait(item)


def _settle(future: asyncio.Future, exc: BaseException | None) -> None:
    if future.done():
        return
    if exc is None:
        future.set_result(None)
    else:
        future.set_exception(exc)
