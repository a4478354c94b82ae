"""`/v1/chat/completions` and `/v1/completions`: parse, template, tokenize, admit, generate,
answer as one JSON body or as SSE chunks, and account the request."""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.concurrency import run_in_threadpool

from lifeline.engine.engine import RequestOutput
from lifeline.observe import RequestRecord, ServerStamps, combine_timelines
from lifeline.server.chat_frontend import Delta, RenderedPrompt
from lifeline.server.errors import APIError, bad_request, parse_json, validation_error
from lifeline.server.generation import Cancelled, Choice, Generation
from lifeline.server.protocol import ChatCompletionRequest, CompletionRequest
from lifeline.server.responses import sse, usage
from lifeline.server.state import ServerState, new_id

router = APIRouter()
THREAD_THRESHOLD_CHARS = 4096
"""Prompts longer than this are templated and tokenized off the event loop."""


@dataclass(slots=True, eq=False)
class Job:
    """One HTTP generation request on its way through the server."""
    state: ServerState
    stamps: ServerStamps
    key: str
    endpoint: str
    body: Any
    response_id: str
    prompts: list[list[int]] = field(default_factory=list)
    rendered: RenderedPrompt | None = None
    anatomy: dict[str, int] | None = None
    anatomy_task: asyncio.Future | None = None
    choices: list[Choice] = field(default_factory=list)
    generation: Generation | None = None
    reasoning_tokens: int = 0
    first_answer: float | None = None
    accounted: bool = False
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def is_chat(self) -> bool:
        return isinstance(self.body, ChatCompletionRequest)

    def record(self, status: int = 200) -> RequestRecord:
        timeline = combine_timelines([c.timeline for c in self.choices])
        finish = [c.finish_reason for c in self.choices]
        return RequestRecord.build(
            self.stamps, timeline, request_id=self.response_id, model=self.state.model_id,
            endpoint=self.endpoint, prompt_tokens=self.prompt_tokens,
            cached_tokens=self.cached_tokens, completion_tokens=self.completion_tokens,
            reasoning_tokens=self.reasoning_tokens, first_answer_token_time=self.first_answer,
            finish_reason=finish[0] if finish and finish[0] else "abort",
            anatomy=self.anatomy, status=status)

    def start_anatomy(self) -> None:
        """Prompt anatomy renders the template twice more: it runs beside the generation."""
        if self.rendered is not None:
            self.anatomy_task = asyncio.ensure_future(run_in_threadpool(
                self.state.chat.anatomy, self.rendered, self.prompts[0]))

    async def finish_anatomy(self) -> None:
        if self.anatomy_task is None:
            return
        try:
            self.anatomy = await asyncio.wait_for(self.anatomy_task, 30)
        except Exception:  # noqa: BLE001 - the anatomy is a report; the answer stands
            self.anatomy = None

    def account(self, record: RequestRecord) -> None:
        if not self.accounted:
            self.accounted = True
            self.state.account(record)
            self.state.limiter.charge_tokens(self.key, self.completion_tokens)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def completion_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.choices)

    @property
    def cached_tokens(self) -> int:
        n = self.body.n
        return sum(self.choices[i * n].cached_tokens for i in range(len(self.prompts))
                   if i * n < len(self.choices))

    def usage(self) -> dict[str, Any]:
        return usage(self.prompt_tokens, self.completion_tokens, self.cached_tokens,
                     self.reasoning_tokens)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Any:
    job = await _prepare(request, ChatCompletionRequest, "/v1/chat/completions")
    return await _respond(request, job, ChatStream(job))


@router.post("/v1/completions")
async def completions(request: Request) -> Any:
    job = await _prepare(request, CompletionRequest, "/v1/completions")
    return await _respond(request, job, CompletionStream(job))


async def parse_body(request: Request, model: type[BaseModel]) -> Any:
    state: ServerState = request.app.state.lifeline
    data = parse_json(await request.body(), state.config.max_json_depth)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc) from None


async def _prepare(request: Request, model: type[BaseModel], endpoint: str) -> Job:
    state: ServerState = request.app.state.lifeline
    stamps: ServerStamps = request.state.stamps
    state.require_engine()
    body = await parse_body(request, model)
    state.check_model(body.model)
    if body.n > state.config.max_n:
        raise bad_request(f"n must be at most {state.config.max_n}", "n")
    stamps.mark("parsed")
    state.limiter.admit_request(request.state.key)
    job = Job(state, stamps, request.state.key, endpoint, body,
              new_id("chatcmpl" if model is ChatCompletionRequest else "cmpl"))
    if job.is_chat:
        offload = body.chat_template is not None or _chat_size(body) > THREAD_THRESHOLD_CHARS
        job.rendered = await _off_loop(state.chat.render, body, offload)
        stamps.mark("templated")
        offload = len(job.rendered.text) > THREAD_THRESHOLD_CHARS
        job.prompts = [await _off_loop(state.chat.encode, job.rendered, offload)]
        stamps.mark("tokenized")
    else:
        stamps.templated = stamps.parsed
        job.prompts = [await _tokenize(state, p) for p in body.prompts]
        stamps.mark("tokenized")
    _check_prompts(state, job.prompts, "messages" if job.is_chat else "prompt")
    state.limiter.admit_tokens(job.key, job.prompt_tokens * body.n)
    _make_choices(job)
    return job


async def _off_loop(fn: Callable[..., Any], arg: Any, offload: bool) -> Any:
    try:
        if offload:
            return await run_in_threadpool(fn, arg)
        return fn(arg)
    except (ValueError, TypeError) as exc:
        raise bad_request(str(exc), getattr(exc, "param", None)) from None


def _chat_size(body: ChatCompletionRequest) -> int:
    size = 0
    for m in body.messages:
        size += len(m.content) if isinstance(m.content, str) else len(str(m.content))
    return size + len(str(body.tools or ""))


async def _tokenize(state: ServerState, prompt: str | list[int]) -> list[int]:
    if isinstance(prompt, list):
        return [int(t) for t in prompt]
    if not prompt:
        raise bad_request("the prompt is empty", "prompt")
    if state.loaded.tokenizer is None:
        raise bad_request("this model has no tokenizer: send token ids", "prompt")
    return await _off_loop(state.loaded.tokenizer.encode, prompt,
                           len(prompt) > THREAD_THRESHOLD_CHARS)


def _check_prompts(state: ServerState, prompts: list[list[int]], param: str) -> None:
    vocab = state.loaded.config.vocab_size
    limit = state.engine.max_model_len
    for ids in prompts:
        if not ids:
            raise bad_request("the prompt is empty", "prompt")
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise bad_request(f"token id {bad} is outside the vocabulary (size {vocab})",
                              param)
        if len(ids) >= limit:
            raise bad_request(f"the prompt has {len(ids)} tokens; this model's context is "
                              f"{limit} tokens and needs room for at least one more", param)


def _make_choices(job: Job) -> None:
    body, state = job.body, job.state
    limit = state.engine.max_model_len
    wanted = body.requested_max_tokens if job.is_chat else body.max_tokens
    num_logprobs = body.num_logprobs if job.is_chat else body.logprobs
    vocab = state.loaded.config.vocab_size
    for name, ids in (("logit_bias", body.logit_bias or {}),
                      ("stop_token_ids", body.stop_token_ids or [])):
        bad = next((t for t in ids if not 0 <= int(t) < vocab), None)
        if bad is not None:
            raise bad_request(f"{name} names token {bad}, outside the vocabulary (size {vocab})",
                              name)
    for p, ids in enumerate(job.prompts):
        room = limit - len(ids)
        max_tokens = min(wanted, room) if wanted else room
        try:
            params = body.sampling_params(max_tokens, num_logprobs)
        except ValueError as exc:
            raise bad_request(str(exc)) from None
        for i in range(body.n):
            index = p * body.n + i
            choice = Choice(index, f"{job.response_id}-{index}", ids, params)
            if job.is_chat:
                choice.state = state.chat.parser(body, job.rendered)
            job.choices.append(choice)


async def _respond(request: Request, job: Job, stream: ChatStream | CompletionStream) -> Any:
    state = job.state
    job.generation = Generation(state.require_engine(), state.admission, job.choices,
                                job.stamps.arrival)
    job.generation.start()
    job.start_anatomy()
    request.state.accounted = True
    if job.body.stream:
        return StreamingResponse(stream.events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Request-Id":
                                          job.response_id})
    watcher = asyncio.create_task(_watch_disconnect(request, job.generation))
    try:
        async for choice, out in job.generation.outputs():
            stream.absorb(choice, out)
    except Exception as exc:  # noqa: BLE001 - every failure becomes an OpenAI error
        job.stamps.mark("last_byte")
        error = _as_api_error(exc)
        job.account(job.record(error.status))
        raise error from None
    finally:
        watcher.cancel()
    await job.finish_anatomy()
    body = stream.full_response()
    job.stamps.mark("last_byte")
    record = job.record()
    body["timings"] = record.timings()
    job.account(record)
    return JSONResponse(body, headers={"Server-Timing": record.server_timing_header()})


async def _watch_disconnect(request: Request, generation: Generation) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            await generation.cancel()
            return


def _as_api_error(exc: BaseException) -> APIError:
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, Cancelled):
        return APIError(499, "the client closed the request", None, "client_closed")
    if isinstance(exc, ValueError):
        return bad_request(str(exc))
    return APIError(500, f"generation failed: {exc!r}", None, "internal_error")


class _Stream:
    """Shared by both endpoints: walks the merged outputs, emits chunks, ends with timings."""

    object_name = ""

    def __init__(self, job: Job):
        self.job = job

    def chunk(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {"id": self.job.response_id, "object": self.object_name,
                "created": self.job.created, "model": self.job.state.model_id,
                "choices": choices, **extra}

    def absorb(self, choice: Choice, out: RequestOutput) -> dict[str, Any] | None:
        raise NotImplementedError

    def opening(self) -> list[dict[str, Any]]:
        return []

    async def events(self) -> AsyncIterator[str]:
        job = self.job
        status = 200
        try:
            for c in self.opening():
                with job.stamps.writing():
                    yield sse(c)
            tail: list[dict[str, Any]] = []
            async for choice, out in job.generation.outputs():
                item = self.absorb(choice, out)
                if item is None:
                    continue
                if job.generation.finished:
                    tail.append(item)  # the last chunk carries the timings: hold it
                    continue
                with job.stamps.writing():
                    yield sse(item)
            await job.finish_anatomy()
            for item in self._closing(tail):
                with job.stamps.writing():
                    yield sse(item)
            with job.stamps.writing():
                yield sse("[DONE]")
        except (asyncio.CancelledError, Cancelled):
            status = 499
            raise
        except Exception as exc:  # noqa: BLE001 - the stream has started: report in-band
            error = _as_api_error(exc)
            status = error.status
            yield sse({"error": {"message": error.message, "type": "server_error",
                                 "param": None, "code": error.code}})
        finally:
            job.generation.cancel_nowait()  # no await: this may run inside a cancelled scope
            if not job.accounted:
                if job.stamps.last_byte is None:
                    job.stamps.mark("last_byte")
                job.account(job.record(status))

    def _closing(self, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
        job = self.job
        job.stamps.mark("last_byte")
        record = job.record()
        job.account(record)
        if job.body.include_usage:
            items.append(self.chunk([], usage=job.usage(), timings=record.timings()))
        elif items:
            items[-1]["timings"] = record.timings()
        else:
            items.append(self.chunk([], timings=record.timings()))
        return items

    def full_response(self) -> dict[str, Any]:
        raise NotImplementedError


class ChatStream(_Stream):
    object_name = "chat.completion.chunk"

    def __init__(self, job: Job):
        super().__init__(job)
        self.messages: dict[int, dict[str, Any]] = {
            c.index: {"content": "", "reasoning": "", "tool_calls": []} for c in job.choices}

    def opening(self) -> list[dict[str, Any]]:
        return [self.chunk([{"index": c.index, "delta": {"role": "assistant", "content": ""},
                             "logprobs": None, "finish_reason": None}])
                for c in self.job.choices]

    def absorb(self, choice: Choice, out: RequestOutput) -> dict[str, Any] | None:
        parser = choice.state
        was_reasoning = parser.in_reasoning
        delta = parser.feed(out.new_text)
        if was_reasoning or parser.in_reasoning or delta.reasoning:
            self.job.reasoning_tokens += len(out.new_token_ids)  # the tags count as reasoning
        elif self.job.reasoning_tokens:
            self._first_answer(out)
        finish = None
        if out.finished:
            delta = delta + parser.finish()
            finish = "tool_calls" if parser.saw_tool_calls else choice.finish_reason
            choice.finish_reason = finish
        self._remember(choice.index, delta)
        body = self._delta_body(delta)
        logprobs = (self.job.state.token_text.chat_logprobs(out.new_logprobs)
                    if choice.params.logprobs is not None else None)
        if not body and finish is None and logprobs is None:
            return None
        return self.chunk([{"index": choice.index, "delta": body, "logprobs": logprobs,
                            "finish_reason": finish}])

    def _first_answer(self, out: RequestOutput) -> None:
        """The first token after a reasoning section (of any choice)."""
        at = out.request.timeline.token_times[-1]
        if self.job.first_answer is None or at < self.job.first_answer:
            self.job.first_answer = at

    def _remember(self, index: int, delta: Delta) -> None:
        msg = self.messages[index]
        msg["content"] += delta.content
        msg["reasoning"] += delta.reasoning
        msg["tool_calls"].extend(delta.tool_calls)

    @staticmethod
    def _delta_body(delta: Delta) -> dict[str, Any]:
        body: dict[str, Any] = {}
        if delta.content:
            body["content"] = delta.content
        if delta.reasoning:
            body["reasoning_content"] = body["reasoning"] = delta.reasoning
        if delta.tool_calls:
            body["tool_calls"] = delta.tool_calls
        return body

    def full_response(self) -> dict[str, Any]:
        choices = []
        token_text = self.job.state.token_text
        for c in self.job.choices:
            msg = self.messages[c.index]
            message: dict[str, Any] = {"role": "assistant", "content": msg["content"] or None}
            if msg["reasoning"]:
                message["reasoning_content"] = message["reasoning"] = msg["reasoning"]
            if msg["tool_calls"]:
                message["tool_calls"] = _collapse_tool_calls(msg["tool_calls"])
            elif message["content"] is None:
                message["content"] = ""
            choices.append({"index": c.index, "message": message,
                            "logprobs": token_text.chat_logprobs(c.logprobs)
                            if c.params.logprobs is not None else None,
                            "finish_reason": c.finish_reason})
        return {"id": self.job.response_id, "object": "chat.completion",
                "created": self.job.created, "model": self.job.state.model_id,
                "choices": choices, "usage": self.job.usage()}


class CompletionStream(_Stream):
    object_name = "text_completion"

    def __init__(self, job: Job):
        super().__init__(job)
        self.offsets = {c.index: 0 for c in job.choices}

    def absorb(self, choice: Choice, out: RequestOutput) -> dict[str, Any] | None:
        logprobs = None
        if choice.params.logprobs is not None:
            logprobs = self.job.state.token_text.completion_logprobs(
                out.new_logprobs, self.offsets[choice.index])
        self.offsets[choice.index] += len(out.new_text)
        finish = choice.finish_reason if out.finished else None
        if not out.new_text and finish is None and logprobs is None:
            return None
        return self.chunk([{"index": choice.index, "text": out.new_text, "logprobs": logprobs,
                            "finish_reason": finish}])

    def full_response(self) -> dict[str, Any]:
        token_text = self.job.state.token_text
        choices = [{"index": c.index, "text": c.text,
                    "logprobs": token_text.completion_logprobs(c.logprobs, 0)
                    if c.params.logprobs is not None else None,
                    "finish_reason": c.finish_reason} for c in self.job.choices]
        return {"id": self.job.response_id, "object": "text_completion",
                "created": self.job.created, "model": self.job.state.model_id,
                "choices": choices, "usage": self.job.usage()}


def _collapse_tool_calls(deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Streamed tool-call deltas (by index, arguments in pieces) to whole tool calls."""
    calls: dict[int, dict[str, Any]] = {}
    for d in deltas:
        call = calls.setdefault(d.get("index", len(calls)), {
            "id": d.get("id"), "type": "function", "function": {"name": "", "arguments": ""}})
        call["id"] = call["id"] or d.get("id")
        fn = d.get("function") or {}
        call["function"]["name"] += fn.get("name") or ""
        call["function"]["arguments"] += fn.get("arguments") or ""
    return [calls[i] for i in sorted(calls)]
