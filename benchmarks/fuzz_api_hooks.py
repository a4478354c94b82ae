"""Schemathesis hooks for benchmarks/fuzz_api.py (loaded by the `st` process through
SCHEMATHESIS_HOOKS; they run there, not in Lifeline's).

- `map_body`: generated `max_tokens` / `max_completion_tokens` capped at LIFELINE_FUZZ_MAX_TOKENS
  and `n` at 4, so a case costs the server milliseconds, not minutes; a generated `model` string is
  replaced by the served model's name in seven cases of eight (the eighth keeps its name: the
  unknown-model path is fuzzed too). Only values of the right type are touched: a negative case
  stays negative.
- `after_call`: every answered case appended to LIFELINE_FUZZ_LOG as one JSON line (operation,
  status, a 4xx's error code and param, and the body of anything that is not a 2xx/4xx), which fuzz_api.py counts.
- the check `openai_error_shape`: a 4xx answers `{"error": {"message", "type", "param", "code"}}`.
"""
from __future__ import annotations

import json
import os
import zlib

import schemathesis

CAP = int(os.environ.get("LIFELINE_FUZZ_MAX_TOKENS", "8"))
MODEL = os.environ.get("LIFELINE_FUZZ_MODEL", "")
LOG = os.environ.get("LIFELINE_FUZZ_LOG", "fuzz-calls.jsonl")


def _int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@schemathesis.hook
def map_body(context, body):
    if not isinstance(body, dict):
        return body
    for key in ("max_tokens", "max_completion_tokens"):
        if _int(body.get(key)) and body[key] > CAP:
            body[key] = CAP
    if _int(body.get("n")) and body["n"] > 4:
        body["n"] = 4
    if MODEL and isinstance(body.get("model"), str):
        keep = zlib.crc32(json.dumps(body, sort_keys=True, default=str).encode()) % 8 == 0
        if not keep:
            body["model"] = MODEL
    return body


@schemathesis.hook
def after_call(context, case, response):
    status = response.status_code
    line = {"operation": f"{case.operation.method.upper()} {case.operation.path}",
            "status": status}
    if case.path_parameters:
        line["path_parameters"] = {k: str(v)[:80] for k, v in case.path_parameters.items()}
    if 400 <= status < 500:
        try:
            error = json.loads(response.text).get("error") or {}
            line["code"], line["param"] = error.get("code"), error.get("param")
            line["message"] = str(error.get("message"))[:160]
        except (ValueError, AttributeError):
            line["code"] = "not JSON"
    if not (200 <= status < 300 or 400 <= status < 500):
        line["body"] = response.text[:2000]
        line["request"] = json.dumps(case.body, default=str)[:2000] if case.body is not None \
            else None
    with open(LOG, "a") as f:
        f.write(json.dumps(line) + "\n")


@schemathesis.check
def openai_error_shape(ctx, response, case):
    if 400 <= response.status_code < 500:
        try:
            error = json.loads(response.text).get("error")
        except (ValueError, AttributeError):
            error = None
        if not (isinstance(error, dict) and {"message", "type", "param", "code"} <= set(error)
                and isinstance(error["message"], str)):
            raise AssertionError(f"a {response.status_code} without the OpenAI error shape: "
                                 f"{response.text[:200]!r}")
    return None
