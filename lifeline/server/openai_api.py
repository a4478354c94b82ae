"""`/v1/chat/completions` and `/v1/completions`: parse, template, tokenize, admit, generate,
answer as one JSON body or as SSE chunks, and account the request."""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.concurrency import run_in_threadpool

from lifeline.observe import ServerStamps
from lifeline.server.errors import APIError, bad_request, parse_json, validation_error
from lifeline.server.generation import Choice, Generation
from lifeline.server.job import Job, as_api_error
from lifeline.server.protocol import ChatCompletionRequest, CompletionRequest
from lifeline.server.state import ServerState, new_id
from lifeline.server.streams import ChatStream, CompletionStream

router = APIRouter()
THREAD_THRESHOLD_CHARS = 4096
"""Prompts longer than this are templated and tokenized off the event loop."""


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
    _check_room(state, body, job.prompts, "messages" if job.is_chat else "prompt")
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
            raise APIError(400, f"the prompt has {len(ids)} tokens; this model's context is "
                           f"{limit} tokens and needs room for at least one more", param,
                           "context_length_exceeded")


def _check_room(state: ServerState, body: Any, prompts: list[list[int]], param: str) -> None:
    """An explicit max_tokens that does not fit after the prompt is refused, as OpenAI and vLLM
    do (a default one is clamped to the room left)."""
    sent = body.model_fields_set & {"max_tokens", "max_completion_tokens"}
    wanted = (body.requested_max_tokens if isinstance(body, ChatCompletionRequest)
              else body.max_tokens) if sent else None
    limit = state.engine.max_model_len
    longest = max(len(ids) for ids in prompts)
    if wanted is not None and longest + wanted > limit:
        raise APIError(400, f"this model's context is {limit} tokens, but {longest + wanted} "
                       f"were asked for ({longest} in the {param}, {wanted} in the completion); "
                       "shorten the prompt or lower max_tokens", param,
                       "context_length_exceeded")


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
                                job.stamps.arrival, state.generations)
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
        error = as_api_error(exc)
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
