"""The engine on its own thread, so the event loop stays free while a step runs.

The engine is not thread-safe: every call into it (add, abort, step) happens on the engine
thread. Callers talk to it through a command queue; outputs come back to each request's
asyncio queue via `call_soon_threadsafe`, all of a step's outputs in one call.

The engine thread also builds the engine (and, for `lifeline serve`, loads the model): it
should be the only live thread that has run PyTorch's parallel CPU kernels. Each such thread
keeps its own OpenMP team (libgomp), and once the teams' threads outnumber the cores, libgomp
stops letting idle workers spin, so every parallel kernel pays a futex wake-up: an int8 GEMM
of one row took 3.5x longer (18 -> 66 us) and one user decoded at 31 instead of 55 tok/s
when the model had been prepared on the event loop's thread (docs/performance.md).
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from lifeline.engine.engine import LLMEngine, RequestOutput
from lifeline.engine.request import RequestError
from lifeline.engine.sampling_params import SamplingParams
from lifeline.server.errors import APIError


log = logging.getLogger("lifeline.engine")


class EngineDeadError(RuntimeError):
    pass


def request_failed(error: RequestError) -> APIError:
    """The OpenAI-format error of a request the engine ended without an answer."""
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


class AsyncEngine:
    """`build` makes the engine on the engine thread (`start()` returns at once; `built` is set
    when `engine` exists or `error` says why not)."""

    def __init__(self, build: Callable[[], LLMEngine],
                 on_finished: Callable[[RequestOutput], None] | None = None):
        self.build = build
        self.engine: LLMEngine | None = None
        self.built = threading.Event()
        self.on_finished = on_finished
        self._commands: queue.Queue[Any] = queue.Queue()
        self._sinks: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lifeline-engine", daemon=True)
        self.error: BaseException | None = None
        self.num_waiting = 0

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._commands.put(None)
        self._thread.join(timeout)

    @property
    def num_unfinished(self) -> int:
        return len(self._sinks)

    async def generate(self, prompt: list[int], params: SamplingParams, request_id: str,
                       arrival: float, cache_salt: str | None = None,
                       deadline: float | None = None, fault: str | None = None
                       ) -> AsyncIterator[RequestOutput]:
        """Yields one output per step that gave this request a token; the last is finished.
        Closing the iterator early (client gone) aborts the request and frees its blocks.
        A request the engine ended without an answer raises its `APIError`
        (`request_failed`)."""
        if self.error is not None:
            raise EngineDeadError(f"the engine stopped: {self.error!r}")
        loop = asyncio.get_running_loop()
        sink: asyncio.Queue = asyncio.Queue()
        accepted = loop.create_future()
        self._commands.put(_Add(prompt, params, request_id, arrival, sink, loop, accepted,
                                cache_salt, deadline, fault))
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
                    raise EngineDeadError(f"the engine stopped: {out!r}")
                finished = out.finished
                if out.error is not None:
                    raise request_failed(out.error)
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
            self.built.set()
        try:
            while not self._stop.is_set():
                busy = self.engine.has_unfinished_requests()
                self._drain_commands(block=not busy)
                if self.engine.has_unfinished_requests():
                    self._step()
        except BaseException as exc:  # noqa: BLE001 - handed to every waiting request
            self.error = exc
            log.critical("the engine loop stopped", exc_info=exc)
            for loop, sink in self._sinks.values():
                loop.call_soon_threadsafe(sink.put_nowait, exc)

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
                                    fault=cmd.fault)
        except Exception as exc:  # noqa: BLE001 - validation errors go back to the caller
            cmd.loop.call_soon_threadsafe(_settle, cmd.accepted, exc)
            return
        self._sinks[cmd.request_id] = (cmd.loop, cmd.sink)
        cmd.loop.call_soon_threadsafe(_settle, cmd.accepted, None)

    def _abort(self, request_id: str) -> None:
        self.engine.abort_request(request_id)
        self._sinks.pop(request_id, None)

    def _step(self) -> None:
        outputs = self.engine.step()
        self.num_waiting = len(self.engine.scheduler.waiting)
        deliveries: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput]]] = {}
        for out in outputs:
            target = self._sinks.get(out.request_id)
            if out.finished:
                self._sinks.pop(out.request_id, None)
                if self.on_finished is not None:
                    self.on_finished(out)
            if target is not None:
                loop, sink = target
                deliveries.setdefault(loop, []).append((sink, out))
        # one wake-up of each loop per step, not one per output: each is a write to the
        # loop's self-pipe, and on a machine whose cores all run the step, each wake-up can
        # preempt it (16 streams: 16 wake-ups a step)
        for loop, items in deliveries.items():
            loop.call_soon_threadsafe(_deliver, items)


def _deliver(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for sink, out in items:
        sink.put_nowait(out)


def _settle(future: asyncio.Future, exc: BaseException | None) -> None:
    if future.done():
        return
    if exc is None:
        future.set_result(None)
    else:
        future.set_exception(exc)
