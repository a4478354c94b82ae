"""JSON as the gateway reads and writes it for bodies it does not own: an upstream's answer (read
strictly: NaN, Infinity, numbers that overflow, unpaired surrogates and deep nesting are not
JSON an answer may carry) and a request or answer written out again.

A body up to `INLINE_BYTES` is read and written on the event loop by the C codec, whose cost
that size bounds. A larger one goes to the preparing thread (`off_loop`) and is read and written
by code that runs Python bytecode per value, so the thread hands the GIL back to the event loop
every switch interval: the C codec would hold it for the whole body (about 75 ms for 8 MB of
small values), and every stream and `/health` of the gateway would wait that long. Long strings
are written in pieces for the same reason."""
from __future__ import annotations

import json
import json.scanner
import math
from typing import Any

from lifeline.server.openai_api import off_loop

INLINE_BYTES = 64 << 10
"""A body of at most this many bytes is read and written on the event loop."""
MAX_DEPTH = 64
"""Nesting an upstream's answer may have (Lifeline's own bodies: `max_json_depth`, 64)."""
STRING_PIECE = 1 << 16
"""Characters of a long string encoded in one call when written off the loop."""
FLUSH_PARTS = 4096
"""Pieces of text gathered before they are joined and encoded to bytes."""


class BadJSON(ValueError):
    """Bytes that are not an answer's JSON: why, in words that name no internals."""


def _refuse_constant(name: str) -> Any:
    raise BadJSON(f"{name} is not a JSON number")


_DECODER = json.JSONDecoder(parse_constant=_refuse_constant)
_YIELDING = json.JSONDecoder(parse_constant=_refuse_constant)
_YIELDING.scan_once = json.scanner.py_make_scanner(_YIELDING)


def loads(raw: bytes | str, yielding: bool = False) -> Any:
    """Strict JSON: BadJSON for anything `check` refuses too."""
    try:
        text = raw.decode("utf-8") if isinstance(raw, bytes | bytearray) else raw
        value = (_YIELDING if yielding else _DECODER).decode(text)
    except BadJSON:
        raise
    except RecursionError:
        raise BadJSON(f"nested deeper than {MAX_DEPTH} levels") from None
    except UnicodeDecodeError:
        raise BadJSON("not UTF-8") from None
    except json.JSONDecodeError as exc:
        raise BadJSON(f"not JSON ({exc.msg} at character {exc.pos})") from None
    except ValueError:  # an integer literal past Python's digit limit
        raise BadJSON("a number is too long") from None
    check(value)
    return value


def check(value: Any, max_depth: int = MAX_DEPTH) -> None:
    """Nesting, finite numbers and encodable text, over the whole tree."""
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            if depth > max_depth:
                raise BadJSON(f"nested deeper than {max_depth} levels")
            for key, item in node.items():
                _text(key)
                stack.append((item, depth + 1))
        elif isinstance(node, list):
            if depth > max_depth:
                raise BadJSON(f"nested deeper than {max_depth} levels")
            stack.extend((item, depth + 1) for item in node)
        elif isinstance(node, str):
            _text(node)
        elif isinstance(node, float) and not math.isfinite(node):
            raise BadJSON("a number is not finite")


def _text(text: str) -> None:
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise BadJSON("text holds an unpaired UTF-16 surrogate") from None


async def decode(raw: bytes) -> Any:
    """`loads(raw)`, in the preparing thread when `raw` is large."""
    if len(raw) <= INLINE_BYTES:
        return loads(raw)
    return await off_loop(loads, raw, True)


def dumps(value: Any) -> bytes:
    """Compact JSON, UTF-8, by the C encoder (on the loop only for a small value)."""
    return json.dumps(value, ensure_ascii=False, allow_nan=False,
                      separators=(",", ":")).encode("utf-8")


def dumps_yielding(value: Any) -> bytes:
    """What `dumps` writes, by Python code that lets the event loop take the GIL."""
    parts: list[str] = []
    done: list[bytes] = []

    def write(v: Any) -> None:
        if isinstance(v, str):
            parts.append(_string(v))
        elif v is None:
            parts.append("null")
        elif v is True:
            parts.append("true")
        elif v is False:
            parts.append("false")
        elif isinstance(v, int):
            parts.append(int.__repr__(v))
        elif isinstance(v, float):
            if not math.isfinite(v):
                raise ValueError("a number is not finite")
            parts.append(float.__repr__(v))
        elif isinstance(v, dict):
            parts.append("{")
            first = True
            for key, item in v.items():
                if not first:
                    parts.append(",")
                first = False
                parts.append(_string(key if isinstance(key, str) else _key(key)))
                parts.append(":")
                write(item)
            parts.append("}")
        elif isinstance(v, list | tuple):
            parts.append("[")
            for i, item in enumerate(v):
                if i:
                    parts.append(",")
                write(item)
            parts.append("]")
        else:
            raise TypeError(f"{type(v).__name__} is not JSON")
        if len(parts) >= FLUSH_PARTS:
            done.append("".join(parts).encode("utf-8"))
            parts.clear()

    write(value)
    done.append("".join(parts).encode("utf-8"))
    return b"".join(done)


def _string(text: str) -> str:
    if len(text) <= STRING_PIECE:
        return json.dumps(text, ensure_ascii=False)
    pieces = ['"']
    for i in range(0, len(text), STRING_PIECE):
        pieces.append(json.dumps(text[i:i + STRING_PIECE], ensure_ascii=False)[1:-1])
    pieces.append('"')
    return "".join(pieces)


def _key(key: Any) -> str:
    if isinstance(key, bool) or key is None:
        return json.dumps(key)
    if isinstance(key, int | float):
        return json.dumps(key)
    raise TypeError(f"keys must be strings, not {type(key).__name__}")


async def encode(value: Any, size_hint: int) -> bytes:
    """`dumps(value)`; in the preparing thread, by the yielding writer, when the body it came
    from (`size_hint` bytes) was large."""
    if size_hint <= INLINE_BYTES:
        return dumps(value)
    return await off_loop(dumps_yielding, value)
