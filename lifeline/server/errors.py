"""Every failure leaves the server as an OpenAI-format error: `{"error": {message, type, param,
code}}` with the status a client can act on."""
from __future__ import annotations

import json
import json.scanner
import logging
import math
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("lifeline.server")

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error",
          405: "invalid_request_error", 409: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
          503: "service_unavailable"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, retry_after: float | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.retry_after = retry_after
        self.timeline = None
        """Where an engine ended the request with this error: a copy of its timeline (the
        request's record reads it)."""

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, self.param, self.code, self.retry_after)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param, "invalid_value")


def refused(exc: Exception) -> APIError:
    """A 400 for a request refused with a ValueError or TypeError: its `param` and `code` when
    it names them (`ParamError`, `lifeline.engine.validation.InvalidRequest`)."""
    code = getattr(exc, "code", None)
    return APIError(400, str(exc), getattr(exc, "param", None),
                    code if isinstance(code, str) else "invalid_value")


def internal_error(exc: BaseException, where: str) -> APIError:
    """A 500 that tells the client only an error id; the exception goes to the server log under
    that id (its text may hold paths, tensors or other internals)."""
    error_id = f"err-{uuid.uuid4().hex[:16]}"
    log.error("%s: %s failed", error_id, where, exc_info=(type(exc), exc, exc.__traceback__))
    return APIError(500, f"internal server error (error id {error_id}; the server log has "
                    "the details)", None, "internal_error")


def error_body(status: int, message: str, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": _TYPES.get(status, "server_error"),
                      "param": param, "code": code}}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   retry_after: float | None = None) -> JSONResponse:
    headers = {}
    if retry_after is not None:
        headers["Retry-After"] = str(max(1, math.ceil(retry_after)))
    return JSONResponse(error_body(status, message, param, code), status, headers)


def validation_error(exc: ValidationError | RequestValidationError) -> APIError:
    """The first problem pydantic found, named by its dotted field path."""
    errors = exc.errors()
    if not errors:
        return bad_request("invalid request")
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    cause = (first.get("ctx") or {}).get("error")
    param = ".".join(loc) or getattr(cause, "param", None)
    message = str(cause) if isinstance(cause, Exception) else first.get("msg", "invalid value")
    if loc:
        message = f"{param}: {message}"
    return bad_request(message, param)


class ParamError(ValueError):
    """A validation failure that names the request field at fault."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


_YIELDING = json.JSONDecoder()
_YIELDING.scan_once = json.scanner.py_make_scanner(_YIELDING)
"""The pure-Python scanner (strings still decoded in C): slower than `json.loads`, but it runs
bytecode per value, so a worker thread that parses a large body lets the event loop run."""


def parse_json(body: bytes, max_depth: int, yielding: bool = False) -> dict[str, Any]:
    """A JSON object, or a 400 that says why not (syntax, nesting, surrogates, not an object).
    `yielding` parses with the pure-Python scanner (for a worker thread)."""
    try:
        if yielding:
            value = _YIELDING.decode(body.decode(json.detect_encoding(body), "surrogatepass"))
        else:
            value = json.loads(body)
    except RecursionError:
        raise bad_request("the JSON body is nested too deeply") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise APIError(400, f"the body is not valid JSON: {exc}", None, "invalid_json") from None
    except ValueError:  # e.g. an integer literal past Python's digit limit
        raise APIError(400, "the body is not valid JSON: a number is too long", None,
                       "invalid_json") from None
    if not isinstance(value, dict):
        raise bad_request("the body must be a JSON object")
    _check_tree(value, max_depth)
    return value


def _check_tree(value: Any, max_depth: int) -> None:
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > max_depth:
            raise bad_request(f"the JSON body is nested deeper than {max_depth} levels")
        if isinstance(node, dict):
            for key, item in node.items():
                _check_text(key)
                stack.append((item, depth + 1))
        elif isinstance(node, list):
            stack.extend((item, depth + 1) for item in node)
        elif isinstance(node, str):
            _check_text(node)
        elif isinstance(node, float) and not math.isfinite(node):
            raise bad_request("numbers must be finite (NaN and Infinity are not JSON)")


def _check_text(text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise bad_request("text contains an unpaired UTF-16 surrogate") from None


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _request_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc).response()

    @app.exception_handler(ValidationError)
    async def _validation(request: Request, exc: ValidationError) -> JSONResponse:
        return validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else "error"
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}"
        return error_response(exc.status_code, message)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        return internal_error(exc, f"{request.method} {request.url.path}").response()
