"""`/v1/chat/completions` and `/v1/completions`: parse, template, tokenize, admit, generate,
answer as one JSON body or as SSE chunks, and account the request."""
from __future__ import annotations

import asyncio
import dataclasses
import weakref
from collections.abc import Callable
from typing import Any

import anyio.to_thread
from anyio import CapacityLimiter
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ValidationError

from lifeline.engine.parallel_sampling import child_params
from lifeline.engine.validation import (
    InvalidRequest,
    check_max_tokens,
    check_prompt,
    check_token_params,
    max_tokens_within,
)
from lifeline.observe import ServerStamps
from lifeline.server.errors import APIError, bad_request, parse_json, refused, validation_error
from lifeline.server.generation import Choice, Generation
from lifeline.server.job import Job, as_api_error
from lifeline.server.limits import INLINE_BODY_BYTES, INLINE_JSON_COMMAS
from lifeline.server.protocol import ChatCompletionRequest, CompletionRequest
from lifeline.server.state import ServerState, new_id
from lifeline.server.streams import ChatStream, CompletionStream
from lifeline.server.tenants import tenant_salt

router = APIRouter()
FAULT_HEADER = "x-lifeline-fault"
"""With `--enable-fault-injection`: 'step' makes the engine step that runs the request raise."""
_PREPARING: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""Per event loop, one worker thread prepares large requests: several CPU-bound threads would
queue for the GIL ahead of the event loop, each taking a switch interval, and stretch every
answer."""
_WITH_IMAGES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
IMAGE_THREADS = 8
"""Per event loop, the worker threads that prepare requests carrying images, beside the
preparing thread: fetching an image URL waits on another host (up to --media-fetch-timeout-s),
which must hold neither the loop nor the thread every other large request is prepared in.
`lifeline.media.fetch` bounds the fetches themselves (`MAX_CONCURRENT_FETCHES`)."""


async def off_loop(fn: Callable[..., Any], *args: Any, images: bool = False) -> Any:
    """`fn(*args)` in the preparing thread (parsing, templating, tokenizing, detokenizing), or
    for a request carrying `images` in one of the image threads."""
    loop = asyncio.get_running_loop()
    threads = _WITH_IMAGES if images else _PREPARING
    limiter = threads.get(loop)
    if limiter is None:
        limiter = threads[loop] = CapacityLimiter(IMAGE_THREADS if images else 1)
    return await anyio.to_thread.run_sync(fn, *args, limiter=limiter)


def carries_images(state: ServerState, messages: list[Any], small: bool) -> bool:
    """Whether a chat's messages may hold images for the served model to fetch, decode and
    preprocess (a large body is not scanned on the loop: it may)."""
    if getattr(state.chat, "preparer", None) is None:
        return False
    return not small or any(
        isinstance(m.content, list)
        and any(isinstance(p, dict) and p.get("type") == "image_url" for p in m.content)
        for m in messages)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Any:
    job = await _prepare(request, ChatCompletionRequest, "/v1/chat/completions")
    return await _respond(request, job, ChatStream(job))


@router.post("/v1/completions")
async def completions(request: Request) -> Any:
    job = await _prepare(request, CompletionRequest, "/v1/completions")
    return await _respond(request, job, CompletionStream(job))


async def parse_body(request: Request, model: type[BaseModel]) -> Any:
    """The validated body. A body of many JSON values is parsed and validated in a worker
    thread by the yielding parser: the C parser holds the GIL for as long as it runs."""
    state: ServerState = request.app.state.lifeline
    raw = await request.body()
    depth = state.config.max_json_depth
    if raw.count(b",") <= INLINE_JSON_COMMAS:
        return _validated(model, parse_json(raw, depth))
    return await off_loop(lambda: _validated(model, parse_json(raw, depth, True)))


def _validated(model: type[BaseModel], data: dict[str, Any]) -> Any:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc) from None


async def is_small(request: Request) -> bool:
    """Whether the request's body is small enough that the work it asks for before the engine
    (templating, tokenizing, checking) may run on the event loop."""
    return len(await request.body()) <= INLINE_BODY_BYTES


async def _prepare(request: Request, model: type[BaseModel], endpoint: str) -> Job:
    state: ServerState = request.app.state.lifeline
    stamps: ServerStamps = request.state.stamps
    state.require_client()
    body = await parse_body(request, model)
    state.check_model(body.model)
    if body.n > state.config.max_n:
        raise bad_request(f"n must be at most {state.config.max_n}", "n")
    stamps.mark("parsed")
    state.limiter.admit_request(request.state.key)
    job = Job(state, stamps, request.state.key, endpoint, body,
              new_id("chatcmpl" if model is ChatCompletionRequest else "cmpl"))
    small = await is_small(request)
    images = job.is_chat and carries_images(state, body.messages, small)
    offload = images or not small or (job.is_chat and body.chat_template is not None)
    await _off_loop(_encode, offload, state, job, images=images)
    state.limiter.admit_tokens(job.key, job.prompt_tokens * body.n,
                               "messages" if job.is_chat else "prompt")
    _make_choices(job)
    return job


async def _off_loop(fn: Callable[..., Any], offload: bool, *args: Any,
                   images: bool = False) -> Any:
    """`fn(*args)` in a worker thread when `offload`, else here (its cost is then bounded by
    `INLINE_BODY_BYTES`); a ValueError or TypeError it raises (the template's, the
    tokenizer's, ours) is the request's fault: a 400."""
    try:
        if offload:
            return await off_loop(fn, *args, images=images)
        return fn(*args)
    except APIError:
        raise
    except (ValueError, TypeError) as exc:
        raise refused(exc) from None


def _encode(state: ServerState, job: Job) -> None:
    """Template, tokenize and check the prompts of `job` (on the loop or in a worker)."""
    body, stamps = job.body, job.stamps
    if job.is_chat:
        job.rendered = state.chat.render(body)
        stamps.mark("templated")
        job.prompts = [state.chat.encode(job.rendered)]
        job.images = state.chat.spans(job.rendered, job.prompts[0])
    else:
        stamps.templated = stamps.parsed
        job.prompts = [_tokenize(state, p) for p in body.prompts]
    stamps.mark("tokenized")
    _check_prompts(state, job, "messages" if job.is_chat else "prompt")


def _tokenize(state: ServerState, prompt: str | list[int]) -> list[int]:
    if isinstance(prompt, list):
        return list(prompt)
    if not prompt:
        raise bad_request("the prompt is empty", "prompt")
    if state.client.tokenizer is None:
        raise bad_request("this model has no tokenizer: send token ids", "prompt")
    return state.client.tokenize(prompt)


def _check_prompts(state: ServerState, job: Job, param: str) -> None:
    """Each prompt against the model; an explicit max_tokens against the room after the
    longest (a default one is clamped instead, in `_make_choices`)."""
    body, limits = job.body, state.model.limits
    for ids in job.prompts:
        check_prompt(ids, limits, param)
    sent = body.model_fields_set & {"max_tokens", "max_completion_tokens"}
    if sent:
        wanted = body.requested_max_tokens if job.is_chat else body.max_tokens
        check_max_tokens(max(len(ids) for ids in job.prompts), wanted, limits, param)


def _make_choices(job: Job) -> None:
    body, state = job.body, job.state
    limits = state.model.limits
    wanted = body.requested_max_tokens if job.is_chat else body.max_tokens
    wanted = wanted or state.config.default_max_tokens
    num_logprobs = body.num_logprobs if job.is_chat else body.logprobs
    try:
        params = body.with_defaults(body.sampling_params(None, num_logprobs),
                                    state.config.sampling_defaults)
    except ValueError as exc:
        raise bad_request(str(exc)) from None
    try:
        check_token_params(params, limits)
    except InvalidRequest as exc:
        raise refused(exc) from None
    salt = _cache_salt(job)
    for p, ids in enumerate(job.prompts):
        prompt_params = dataclasses.replace(
            params, max_tokens=max_tokens_within(wanted, len(ids), limits))
        for i in range(body.n):
            index = p * body.n + i
            choice = Choice(index, f"{job.response_id}-{index}", ids,
                            child_params(prompt_params, i), cache_salt=salt,
                            parent=job.response_id, images=job.images)
            if job.is_chat:
                choice.state = state.chat.parser(body, job.rendered)
            job.choices.append(choice)


def _cache_salt(job: Job) -> str | None:
    """The request's prefix-cache salt; under `salt_cache_by_api_key` it always starts with a
    keyed digest of the caller's key, so no request of one tenant can share another's blocks
    or image embeddings."""
    salt = job.body.cache_salt
    if not job.state.config.salt_cache_by_api_key:
        return salt
    return tenant_salt(job.key, salt)


async def _respond(request: Request, job: Job, stream: ChatStream | CompletionStream) -> Any:
    state = job.state
    timeout = state.config.request_timeout
    job.generation = Generation(
        state.require_client(), state.admission, job.choices, job.stamps.arrival,
        state.generations, deadline=job.stamps.arrival + timeout if timeout else None,
        fault=request.headers.get(FAULT_HEADER) if state.config.enable_fault_injection else None)
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
