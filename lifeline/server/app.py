"""`create_app(loaded_model, ServerConfig)`: the FastAPI application behind `lifeline serve`."""
from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool

from lifeline.engine.engine import LLMEngine
from lifeline.engine.validation import InvalidRequest, check_token_ids
from lifeline.model.loader import LoadedModel
from lifeline.server.async_engine import AsyncEngine
from lifeline.server.config import ServerConfig
from lifeline.server.debug import router as debug_router
from lifeline.server.engine_client import EngineClient
from lifeline.server.errors import APIError, bad_request, install_handlers, refused
from lifeline.server.middleware import GatewayMiddleware
from lifeline.server.openai_api import carries_images, is_small, off_loop, parse_body, router
from lifeline.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from lifeline.server.state import ServerState, short_gil_turns, thaw_heap

JSON_PIECE = 8192
"""Token ids serialized by one `json.dumps` call in a `/tokenize` answer."""


LoadedOrLoader = LoadedModel | Callable[[], LoadedModel]
"""A loaded model, or how to load it (in the background, while the server answers)."""


LOAD_POLL_S = 0.25


def create_app(loaded_model: LoadedOrLoader, config: ServerConfig | None = None) -> FastAPI:
    """A server for `loaded_model`, or for what a loader callable returns: then the server
    answers at once and `/ready` says 503 until the model has loaded in the background."""
    config = config or ServerConfig()
    loaded = loaded_model if isinstance(loaded_model, LoadedModel) else None
    state = ServerState.build(loaded, config)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        client = _in_process_engine(
            lambda: loaded if loaded is not None else loaded_model(), config)
        loader = None
        if loaded is not None:
            client.wait_started()
            state.attach(client)
            # the start's phases and the KV cache's size, as after a load
            state.became_ready(getattr(loaded, "load_seconds", None) or 0.0)
        else:
            state.admission.loading = True
            loader = asyncio.create_task(_load(state, client))
        try:
            with short_gil_turns():
                yield
        finally:
            if loader is not None:
                loader.cancel()
            client.stop()
            state.tracer.shutdown()
            thaw_heap()

    app = FastAPI(title="Lifeline", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.lifeline = state
    install_handlers(app)
    app.include_router(router)
    app.include_router(debug_router)
    _add_routes(app, state)
    app.add_middleware(GatewayMiddleware, state=state)
    _add_cors(app, config)
    app.openapi = lambda: _openapi(app)
    return app


def _add_cors(app: FastAPI, config: ServerConfig) -> None:
    """Outside the gateway, so a preflight is answered before the key check and the gateway's
    own errors (401, 413) carry the CORS headers too."""
    if config.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=config.allowed_origins,
                           allow_methods=config.allowed_methods,
                           allow_headers=config.allowed_headers,
                           allow_credentials=config.allow_credentials)


REQUEST_BODIES: dict[str, type[BaseModel]] = {
    "/v1/chat/completions": ChatCompletionRequest, "/v1/completions": CompletionRequest,
    "/tokenize": TokenizeRequest, "/detokenize": DetokenizeRequest}
"""The handlers parse their bodies themselves (`parse_body`); the schema still shows them."""


def _openapi(app: FastAPI) -> dict[str, Any]:
    if app.openapi_schema is not None:
        return app.openapi_schema
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for path, model in REQUEST_BODIES.items():
        body = model.model_json_schema(ref_template="#/components/schemas/{model}")
        components.update(body.pop("$defs", {}))
        components[model.__name__] = body
        schema["paths"][path]["post"]["requestBody"] = {"required": True, "content": {
            "application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
    app.openapi_schema = schema
    return schema


def _in_process_engine(load: Callable[[], LoadedModel], config: ServerConfig) -> AsyncEngine:
    """Start the engine thread; it runs `load` and builds the engine. Loading there keeps
    PyTorch's parallel kernels on one thread (see `lifeline.server.async_engine`)."""
    engine_config = config.engine
    client = AsyncEngine(lambda: LLMEngine(load(), engine_config))
    client.start()
    return client


async def _load(state: ServerState, client: EngineClient) -> None:
    """Load in the background; a model that cannot be loaded stops the server (`state.fail`:
    `lifeline serve` prints why and exits non-zero)."""
    try:
        # in short waits: a server stopped while loading exits now, not once the load (minutes,
        # with a compile) has ended and freed a worker thread that waits for it
        while not await run_in_threadpool(client.wait_started, LOAD_POLL_S):
            pass
        await run_in_threadpool(state.attach, client)  # reads the chat template: off the loop
    except Exception as exc:  # noqa: BLE001 - whatever stops the load stops the server
        state.fail(exc)
        return
    state.became_ready()
    state.admission.loading = False


def readiness(load_error: str | None, draining: bool, waiting: dict[str, Any] | None,
              detail: dict[str, Any]) -> JSONResponse:
    """`/ready`'s answer, here and at the gateway: 503 (with Retry-After where waiting helps)
    while loading failed, draining or `waiting` says why not; 200 with `detail` otherwise."""
    if load_error is not None:
        return JSONResponse({"status": "failed", "error": load_error}, 503)
    if draining:
        return JSONResponse({"status": "draining"}, 503, {"Retry-After": "1"})
    if waiting is not None:
        return JSONResponse(waiting, 503, {"Retry-After": "1"})
    return JSONResponse({"status": "ready", **detail})


def forward_state(state: Any) -> str | None:
    """How a server's engine runs its forward (`LLMEngine.compile_state`: compiled, eager, or
    eager while its graphs load or a child compiles them); None before the engine is built or
    where it is remote."""
    engine = getattr(getattr(state, "client", None), "engine", None)
    return getattr(engine, "compile_state", None)


def _add_routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/health")
    async def health() -> JSONResponse:
        body = state.health()
        return JSONResponse(body, 200 if body["status"] == "ok" else 503)

    @app.get("/ready")
    async def ready() -> JSONResponse:
        detail = {"startup_seconds": state.startup} if state.startup else {}
        forward = forward_state(state)
        if forward is not None:
            detail["forward"] = forward
        return readiness(state.load_error, state.admission.draining,
                         None if state.ready else {"status": "loading"}, detail)

    @app.get("/metrics")
    async def metrics() -> Response:
        if state.client is not None:
            state.metrics.update_stats(state.client.stats())
        body, content_type = state.metrics.render()
        return Response(body, media_type=content_type)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [_model_card(state)]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        state.check_model(model_id)
        return _model_card(state)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        client = state.require_client()
        body: TokenizeRequest = await parse_body(request, TokenizeRequest)
        state.check_model(body.model)
        state.limiter.admit_request(request.state.key)  # charged as completions are
        if body.messages is not None:
            chat = ChatCompletionRequest(messages=body.messages, tools=body.tools,
                                         add_generation_prompt=body.add_generation_prompt,
                                         continue_final_message=body.continue_final_message,
                                         chat_template_kwargs=body.chat_template_kwargs)
            images = carries_images(state, chat.messages, await is_small(request))
            ids, anatomy = await off_loop(_tokenize_chat, state, chat, images=images)
        elif client.tokenizer is None:
            raise bad_request("this model has no tokenizer", "prompt")
        else:
            ids = await off_loop(client.tokenize, body.prompt, body.add_special_tokens)
            anatomy = None
        state.limiter.admit_tokens(request.state.key, len(ids),
                                   "prompt" if body.messages is None else "messages")
        out = {"tokens": ids, "count": len(ids), "max_model_len": state.model.max_model_len}
        if anatomy is not None:
            out["prompt_anatomy"] = anatomy
        if len(ids) <= JSON_PIECE:
            return JSONResponse(out)
        return Response(await off_loop(_tokens_json, out),
                        media_type="application/json")

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        client = state.require_client()
        body: DetokenizeRequest = await parse_body(request, DetokenizeRequest)
        state.check_model(body.model)
        if client.tokenizer is None:
            raise bad_request("this model has no tokenizer", "tokens")
        state.limiter.admit_request(request.state.key)
        state.limiter.admit_tokens(request.state.key, len(body.tokens), "tokens")
        if await is_small(request):
            return {"prompt": _detokenize(state, body.tokens)}
        return {"prompt": await off_loop(_detokenize, state, body.tokens)}


def _tokens_json(out: dict[str, Any]) -> bytes:
    """`out` as JSON, its token list dumped in pieces (in a worker thread): one `json.dumps`
    of a long list would hold the GIL, and so stop the event loop, for as long as it runs."""
    ids = out.pop("tokens")
    pieces = [json.dumps(ids[i:i + JSON_PIECE])[1:-1] for i in range(0, len(ids), JSON_PIECE)]
    return f'{json.dumps(out)[:-1]}, "tokens": [{",".join(pieces)}]}}'.encode()


def _detokenize(state: ServerState, tokens: list[int]) -> str:
    try:
        check_token_ids(tokens, state.model.vocab_size, "tokens")
    except InvalidRequest as exc:
        raise refused(exc) from None
    return state.client.detokenize(tokens)


def _tokenize_chat(state: ServerState, body: ChatCompletionRequest
                   ) -> tuple[list[int], dict[str, int]]:
    try:
        rendered = state.chat.render(body)
        ids = state.chat.encode(rendered)
        return ids, state.chat.anatomy(rendered, ids)
    except ValueError as exc:
        raise bad_request(str(exc), getattr(exc, "param", None)) from None


def _model_card(state: ServerState) -> dict[str, Any]:
    """The served model as `/v1/models` shows it: its id (also its `root`: never the file or
    directory it was loaded from, a path on the server's disk), its limits and its shape."""
    card: dict[str, Any] = {"id": state.model_id, "object": "model", "created": state.created,
                            "owned_by": "lifeline"}
    model = state.model
    if model is None:
        return card
    card.update({
        "root": state.model_id, "max_model_len": model.max_model_len,
        "max_model_len_limited_by": model.max_model_len_limited_by,
        "context_length": model.context_length, "architecture": model.architecture,
        "parameters": {"total": model.num_params, "active": model.num_active_params},
        "weight_format": model.weight_format,
    })
    return card


__all__ = ["APIError", "create_app"]
