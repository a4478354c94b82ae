"""The render budget of a chat template, and the checks that keep one operation from building
something huge before the budget could notice (``"x" * 10**10``, ``center(10**10)``).

The budget counts operations (loop iterations, calls, filters, outputs) and watches a
deadline; sizes are checked before every operation that can build a string or a container
larger than its inputs (from the sizes of its inputs, see `lifeline.chat.sizes`), and the memory
of what operations build is added up, so that a loop cannot keep many large results alive."""
from __future__ import annotations

import re
import string
import sys
import time
from collections.abc import Callable, Iterable, Sized
from contextvars import ContextVar
from dataclasses import dataclass
from itertools import islice
from typing import Any

from lifeline.chat import sizes
from lifeline.chat.errors import TemplateTimeout

MAX_RANGE = 100_000
MAX_POWER_BITS = 1 << 20
_PERCENT_FIELD = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d*))?")
_DIGITS = re.compile(r"\d+")
_ASCII_SPACES = " \t\n\r\x0b\x0c\x1c\x1d\x1e\x1f"
"""The ASCII characters `str.split()` and the regex `\\s` split on."""
_STRFTIME_FIELD = re.compile(r"%[-_0^#]*(\d*)")
STRFTIME_FIELD_CHARS = 64
"""The most one strftime directive writes without a width ('%c' in the C locale: 24)."""
ENCODED_CHARS = 100
"""The most `str.encode` writes for one character (a Unicode name under 'namereplace')."""


@dataclass(slots=True, frozen=True)
class RenderLimits:
    """How much one render of a chat template may cost."""

    timeout_s: float = 2.0
    """Wall-clock seconds one render may take."""
    max_operations: int = 2_000_000
    """Loop iterations, calls, filters and outputs one render may perform."""
    max_output_chars: int = 8_000_000
    """Characters one render may emit in all (into buffers too), and the longest string one
    operation may build."""
    max_items: int = 1_000_000
    """The most items a list, tuple, dict or set built by one operation may hold."""
    max_alloc_bytes: int = 128 << 20
    """The memory (as `sys.getsizeof` counts it) of all strings and containers one render's
    operations build, added up whether or not they are still alive."""
    max_prompt_chars: int = 1 << 20
    """Characters of the rendered prompt, the text the tokenizer is then given: room for a
    request's messages and tools at their caps (`lifeline.server.limits`) written out with
    indentation, not for a template that repeats them."""

    def __post_init__(self) -> None:
        if not (self.timeout_s > 0 and min(self.max_operations, self.max_output_chars,
                                           self.max_items, self.max_alloc_bytes,
                                           self.max_prompt_chars) > 0):
            raise ValueError("render limits must be positive")


class Budget:
    """What is left of one render's limits."""

    __slots__ = ("allocated", "deadline", "emitted", "limits", "operations")

    def __init__(self, limits: RenderLimits):
        self.limits = limits
        self.deadline = time.monotonic() + limits.timeout_s
        self.operations = 0
        self.emitted = 0
        self.allocated = 0

    def check_deadline(self) -> None:
        if time.monotonic() > self.deadline:
            raise TemplateTimeout(f"chat template stopped after {self.limits.timeout_s:g} s")

    def tick(self) -> None:
        self.operations += 1
        if self.operations > self.limits.max_operations:
            raise TemplateTimeout(
                f"chat template stopped after {self.limits.max_operations} operations")
        if time.monotonic() > self.deadline:
            raise TemplateTimeout(f"chat template stopped after {self.limits.timeout_s:g} s")

    def emit(self, text: str) -> str:
        self.tick()
        self.emitted += len(text)
        if self.emitted > self.limits.max_output_chars:
            raise TemplateTimeout(
                f"chat template output exceeds {self.limits.max_output_chars} characters")
        return text

    def check_size(self, size: int, what: str = "str") -> None:
        limit = self.limits.max_output_chars if what in ("str", "bytes") else self.limits.max_items
        if size > limit:
            raise TemplateTimeout(f"chat template would build a {what} of size {size} "
                                  f"(limit {limit})")

    def check_result(self, value: Any, inputs: Iterable[Any] = (), built: bool = True) -> Any:
        """`value` once its size is checked; if the operation `built` it and it is none of its
        `inputs`, its memory counts toward `max_alloc_bytes`."""
        if isinstance(value, (str, bytes, list, tuple, dict, set, frozenset)):
            self.check_size(len(value), type(value).__name__)
            if built and not any(value is x for x in inputs):
                self.allocated += sys.getsizeof(value)
                if self.allocated > self.limits.max_alloc_bytes:
                    raise TemplateTimeout(f"chat template built more than "
                                          f"{self.limits.max_alloc_bytes} bytes")
        return value

    def check_str(self, value: Any) -> None:
        """`str(value)` would not be over the size limit."""
        if not isinstance(value, str):
            self.check_size(sizes.str_length(value, self.check_deadline))

    def check_count(self, count: int) -> None:
        self.check_size(count, "list")

    def check_ints(self, values: Any) -> None:
        for value in values:
            if isinstance(value, int) and abs(value) > self.limits.max_output_chars:
                raise TemplateTimeout(f"chat template argument {value} is over the size limit")


_CURRENT: ContextVar[Budget | None] = ContextVar("lifeline_chat_budget", default=None)


def current_budget() -> Budget:
    """The budget of the render in progress. Outside a render (e.g. Jinja folding constants
    at compile time) there is none, so the operation is left for run time."""
    budget = _CURRENT.get()
    if budget is None:
        raise RuntimeError("chat template operations run only inside render_bounded")
    return budget


def start_budget(limits: RenderLimits) -> tuple[Budget, Any]:
    budget = Budget(limits)
    return budget, _CURRENT.set(budget)


def end_budget(token: Any) -> None:
    _CURRENT.reset(token)


def bounded_range(*args: int) -> range:
    try:
        rng = range(*args)
        size = len(rng)
    except OverflowError:
        size = MAX_RANGE + 1
    if size > MAX_RANGE:
        raise TemplateTimeout(f"chat template range is over the limit of {MAX_RANGE} items")
    return rng


# --- size estimates made before an operation runs --------------------------------------------

def check_binop(budget: Budget, operator: str, left: Any, right: Any) -> None:
    if operator == "**" and _is_int(left) and _is_int(right) and right > 0 and abs(left) > 1:
        if abs(left).bit_length() * right > MAX_POWER_BITS:
            raise TemplateTimeout("chat template power is too large")
    elif operator == "*":
        if _is_int(left) and _is_int(right):
            if left.bit_length() + right.bit_length() > MAX_POWER_BITS:
                raise TemplateTimeout("chat template product is too large")
        _check_repeat(budget, left, right)
        _check_repeat(budget, right, left)
    elif operator == "+":
        if isinstance(left, (str, bytes, list, tuple)) and isinstance(right, type(left)):
            budget.check_size(len(left) + len(right), type(left).__name__)
    elif operator == "%" and isinstance(left, (str, bytes)):
        check_percent(budget, _as_text(left), right)


def _check_repeat(budget: Budget, seq: Any, times: Any) -> None:
    if isinstance(seq, (str, bytes, list, tuple)) and _is_int(times):
        budget.check_size(len(seq) * times, type(seq).__name__)


def _as_text(value: str | bytes) -> str:
    """Bytes as a str of the same length, for the checks that count characters."""
    return value.decode("latin-1") if isinstance(value, bytes) else value


def check_strftime(budget: Budget, fmt: Any) -> None:
    """`strftime(fmt)`: each directive writes at most its width or `STRFTIME_FIELD_CHARS`,
    whichever is more; the rest of the format is copied."""
    if not isinstance(fmt, str):
        return
    total = len(fmt)
    for count, match in enumerate(_STRFTIME_FIELD.finditer(fmt), 1):
        total += _width(budget, match.group(1)) + STRFTIME_FIELD_CHARS
        if total > budget.limits.max_output_chars:
            raise TemplateTimeout(f"chat template date format would write over "
                                  f"{budget.limits.max_output_chars} characters")
        if count % 4096 == 0:
            budget.check_deadline()


def _check_formatted(budget: Budget, fmt: str, fields: int, widths: int, args: Any) -> None:
    """Each field writes at most its width, or the longest argument written out."""
    values = list(args.values()) if isinstance(args, dict) else list(args)
    longest = max((sizes.repr_length(v, budget.check_deadline)
                   for v in ([args] if isinstance(args, dict) else values)), default=0)
    ints = sum(abs(v) for v in values if _is_int(v) and abs(v) <= budget.limits.max_output_chars)
    budget.check_ints(values)
    total = len(fmt) + widths + fields * (longest + 2) + ints
    if total > budget.limits.max_output_chars:
        raise TemplateTimeout(f"chat template format would write up to {total} characters "
                              f"(limit {budget.limits.max_output_chars})")


def _width(budget: Budget, digits: str | None) -> int:
    if not digits or digits == "*":
        return 0
    if len(digits) > 18 or int(digits) > budget.limits.max_output_chars:
        raise TemplateTimeout("chat template format width is over the size limit")
    return int(digits)


def check_percent(budget: Budget, fmt: str, args: Any) -> None:
    """`fmt % args` (and the `format` filter): the widths and fields in total."""
    fields = widths = 0
    for match in _PERCENT_FIELD.finditer(fmt):
        fields += 1
        widths += _width(budget, match.group(1)) + _width(budget, match.group(2))
        if fields % 4096 == 0:
            budget.check_deadline()
    values = args if isinstance(args, (tuple, dict)) else (args,)
    _check_formatted(budget, fmt, fields, widths, values)


def check_str_format(budget: Budget, fmt: str, args: Any) -> None:
    """`fmt.format(...)`: every replacement field, nested ones in format specs included."""
    fields = widths = 0
    try:
        parsed = list(string.Formatter().parse(fmt))
    except ValueError:
        return  # str.format refuses it too
    for _, name, spec, _ in parsed:
        if name is None:
            continue
        fields += 1 + (spec or "").count("{")
        widths += sum(_width(budget, d) for d in _DIGITS.findall(spec or ""))
        if fields % 4096 == 0:
            budget.check_deadline()
    _check_formatted(budget, fmt, fields, widths, args)


def replaced_size(text: Any, old: Any, new: Any, count: Any = -1) -> int:
    if not (isinstance(text, str) and isinstance(old, str) and isinstance(new, str)):
        return 0
    hits = text.count(old) if old else len(text) + 1
    if _is_int(count) and count >= 0:
        hits = min(hits, count)
    return len(text) + hits * max(0, len(new) - len(old))


def check_str_method(budget: Budget, text: str | bytes, name: str, args: tuple,
                     kwargs: dict) -> None:
    """A method of a str or bytes, from the sizes of its inputs. Bytes are checked as the
    str of their latin-1 characters (same length, same counts of ASCII separators), their
    arguments likewise."""
    check = _STR_CHECKS.get(name)
    if check is None:
        return
    if isinstance(text, bytes):
        text = _as_text(text)
        args = tuple(_as_text(a) if isinstance(a, bytes) else a for a in args)
        kwargs = {k: _as_text(v) if isinstance(v, bytes) else v for k, v in kwargs.items()}
    check(budget, text, *args, **kwargs)


def _widen(budget: Budget, text: str, width: Any = 0, *_: Any, **__: Any) -> None:
    budget.check_ints([width])
    if _is_int(width):
        budget.check_size(max(len(text), width), "str")


def _expandtabs(budget: Budget, text: str, tabsize: Any = 8, **_: Any) -> None:
    if _is_int(tabsize):
        budget.check_size(len(text) + text.count("\t") * tabsize, "str")


def _replace(budget: Budget, text: str, old: Any = "", new: Any = "", count: Any = -1) -> None:
    budget.check_size(replaced_size(text, old, new, count), "str")


def _format(budget: Budget, text: str, *args: Any, **kwargs: Any) -> None:
    check_str_format(budget, text, [*args, *kwargs.values()])


def _format_map(budget: Budget, text: str, mapping: Any = None, *_: Any) -> None:
    check_str_format(budget, text, mapping if isinstance(mapping, dict) else [mapping])


def _translate(budget: Budget, text: str, table: Any = None, *_: Any) -> None:
    """Each character becomes at most the longest string the table holds (any object with
    items: a dict, a list, a namespace)."""
    if table is None or isinstance(table, str):
        longest = 1
    elif isinstance(table, dict):
        longest = max((len(v) for v in table.values() if isinstance(v, str)), default=1)
    elif isinstance(table, (list, tuple)):
        longest = max((len(v) for v in table if isinstance(v, (str, bytes))), default=1)
    else:
        longest = sizes.str_length(table, budget.check_deadline)
    budget.check_size(len(text) * max(longest, 1), "str")


def _encode(budget: Budget, text: str, *_: Any, **__: Any) -> None:
    """`str.encode`: four bytes a character for ASCII text in any codec (UTF-32, escapes of
    control characters), `ENCODED_CHARS` for other text (escapes, character names)."""
    budget.check_size(len(text) * (4 if text.isascii() else ENCODED_CHARS) + 4, "bytes")


def _decode(budget: Budget, text: str, *_: Any, **__: Any) -> None:
    """`bytes.decode`: a byte becomes at most four characters ('backslashreplace')."""
    budget.check_size(4 * len(text), "str")


def _hex(budget: Budget, text: str, sep: Any = None, *_: Any, **__: Any) -> None:
    per = 2 + (len(sep) if isinstance(sep, (str, bytes)) else 0)
    budget.check_size(per * len(text), "str")


def _case(budget: Budget, text: str, *_: Any, **__: Any) -> None:
    """Changing case can lengthen a non-ASCII string up to threefold ('ﬃ' -> 'FFI')."""
    budget.check_size(len(text) if text.isascii() else 3 * len(text), "str")


def _join(budget: Budget, sep: str, items: Any = (), *_: Any) -> None:
    if isinstance(items, Sized) and not isinstance(items, str):
        total = sum(sizes.str_length(v, budget.check_deadline) for v in items)
        budget.check_size(total + len(sep) * max(len(items) - 1, 0), "str")
    elif isinstance(items, str):
        budget.check_size(len(items) * (len(sep) + 1), "str")


def _split(budget: Budget, text: str, sep: Any = None, maxsplit: Any = -1, **_: Any) -> None:
    if isinstance(sep, str) and sep:
        count = text.count(sep) + 1
    else:
        count = sum(text.count(c) for c in _ASCII_SPACES) + 1 if text.isascii() \
            else len(text) // 2 + 1
    if _is_int(maxsplit) and maxsplit >= 0:
        count = min(count, maxsplit + 1)
    budget.check_count(count)


def _splitlines(budget: Budget, text: str, *_: Any, **__: Any) -> None:
    count = sum(text.count(c) for c in "\n\r\x0b\x0c\x1c\x1d\x1e\x85") + 1 if text.isascii() \
        else len(text) + 1
    budget.check_count(count)


_STR_CHECKS: dict[str, Callable[..., None]] = {
    "center": _widen, "ljust": _widen, "rjust": _widen, "zfill": _widen,
    "expandtabs": _expandtabs, "replace": _replace, "format": _format,
    "format_map": _format_map, "translate": _translate, "join": _join,
    "split": _split, "rsplit": _split, "splitlines": _splitlines,
    "upper": _case, "lower": _case, "title": _case, "capitalize": _case, "swapcase": _case,
    "casefold": _case, "encode": _encode, "decode": _decode, "hex": _hex,
}
MATERIALIZED_STR_ARGS = frozenset({"join"})
"""String methods whose argument may be an iterator: made a list (within `max_items`) first, so
that its size can be checked."""


# --- filters ---------------------------------------------------------------------------------

def materialize(budget: Budget, value: Any) -> Any:
    """An iterator as a list (at most `max_items`); anything sized as it is."""
    if isinstance(value, (Sized, str)) or not isinstance(value, Iterable):
        return value
    items = list(islice(value, budget.limits.max_items + 1))
    budget.check_count(len(items))
    return items


MATERIALIZED_FILTERS = frozenset({"join", "list", "sort", "unique", "batch", "slice", "groupby",
                                  "reverse", "sum", "tojson", "string", "pprint"})
"""Filters whose input may be an iterator: made a list first, so that its size can be checked."""


def _text_size(budget: Budget, value: Any) -> int:
    return len(value) if isinstance(value, str) else sizes.str_length(value, budget.check_deadline)


def _filter_stringify(budget: Budget, value: Any, *_: Any, **__: Any) -> None:
    budget.check_str(value)


def _filter_words(budget: Budget, value: Any, *_: Any, **__: Any) -> None:
    """Filters that cut their text into a list of words or pieces first."""
    size = _text_size(budget, value)
    budget.check_size(size)
    budget.check_count(size)


def _filter_center(budget: Budget, value: Any, width: Any = 80, *_: Any, **__: Any) -> None:
    size = _text_size(budget, value)
    budget.check_size(max(size, width) if _is_int(width) else size, "str")


def _filter_urlize(budget: Budget, value: Any, trim_url_limit: Any = None, nofollow: Any = False,
                   target: Any = None, rel: Any = None, *_: Any, **__: Any) -> None:
    """The text is escaped (a character to at most five), and each word may become a link that
    writes it twice with a scheme and the escaped `target` and `rel` attributes."""
    _filter_words(budget, value)
    size = _text_size(budget, value)
    if isinstance(value, str) and value.isascii():
        words = sum(value.count(c) for c in _ASCII_SPACES) + 1
    else:
        words = size // 2 + 1
    extra = 5 * sum(len(v) for v in (target, rel) if isinstance(v, str)) + 64
    budget.check_size(10 * size + words * extra, "str")


def _filter_case(budget: Budget, value: Any, *_: Any, **__: Any) -> None:
    _filter_stringify(budget, value)
    if isinstance(value, str):
        _case(budget, value)
    else:
        budget.check_size(3 * _text_size(budget, value))


def _filter_indent(budget: Budget, text: Any, width: Any = 4, *_: Any, **__: Any) -> None:
    size = _text_size(budget, text)
    lines = text.count("\n") + 1 if isinstance(text, str) else size + 1
    per_line = len(width) if isinstance(width, str) else width if _is_int(width) else 0
    budget.check_size(size + lines * max(per_line, 0), "str")


def _filter_wordwrap(budget: Budget, text: Any, width: Any = 79, break_long_words: Any = True,
                     wrapstring: Any = None, *_: Any, **__: Any) -> None:
    size = _text_size(budget, text)
    budget.check_count(size)
    wrap = len(wrapstring) if isinstance(wrapstring, str) else 2
    budget.check_size(size * (1 + wrap), "str")


def _filter_escape(budget: Budget, value: Any, *_: Any, **__: Any) -> None:
    if isinstance(value, str):
        budget.check_size(len(value) + 4 * sum(value.count(c) for c in "&<>\"'"), "str")
    else:
        budget.check_size(5 * _text_size(budget, value), "str")


def _filter_urlencode(budget: Budget, value: Any, *_: Any, **__: Any) -> None:
    size = _text_size(budget, value)
    ascii_only = isinstance(value, str) and value.isascii()
    budget.check_size(size * (3 if ascii_only else 12), "str")


def _filter_xmlattr(budget: Budget, value: Any, *_: Any, **__: Any) -> None:
    budget.check_size(6 * _text_size(budget, value), "str")


def _filter_format(budget: Budget, value: Any, *args: Any, **kwargs: Any) -> None:
    if isinstance(value, str):
        check_percent(budget, value, kwargs if kwargs else tuple(args))


def _filter_replace(budget: Budget, text: Any, old: Any = "", new: Any = "",
                    count: Any = None) -> None:
    budget.check_str(text)
    if isinstance(text, str):
        budget.check_size(replaced_size(text, old, new, -1 if count is None else count), "str")
    elif isinstance(new, str):
        budget.check_size(_text_size(budget, text) * (len(new) + 1), "str")


def _filter_join(budget: Budget, value: Any, d: Any = "", attribute: Any = None) -> None:
    if attribute is None:
        _join(budget, str(d) if isinstance(d, str) else "", value)
    else:
        budget.check_size(sizes.repr_length(value, budget.check_deadline)
                          + len(str(d)) * len(value), "str")


def _filter_list(budget: Budget, value: Any, *_: Any) -> None:
    if isinstance(value, Sized):
        budget.check_count(len(value))


def _filter_tojson(budget: Budget, value: Any, ensure_ascii: Any = False, indent: Any = None,
                   separators: Any = None, sort_keys: Any = False) -> None:
    budget.check_size(sizes.json_length(value, ensure_ascii=ensure_ascii, indent=indent,
                                        separators=separators, tick=budget.check_deadline))


def _filter_pprint(budget: Budget, value: Any, *_: Any) -> None:
    budget.check_size(sizes.pformat_length(value, budget.check_deadline))


def _filter_batch(budget: Budget, value: Any, linecount: Any = 1, *_: Any, **__: Any) -> None:
    if _is_int(linecount):
        budget.check_count(linecount)


def _filter_slice(budget: Budget, value: Any, slices: Any = 1, *_: Any, **__: Any) -> None:
    if _is_int(slices) and slices > MAX_RANGE:
        raise TemplateTimeout(f"chat template slice count is over the limit of {MAX_RANGE}")


def _filter_sum(budget: Budget, value: Any, attribute: Any = None, start: Any = 0) -> None:
    if isinstance(start, (list, tuple)) and isinstance(value, Sized):
        total = len(start) + sum(len(v) for v in value if isinstance(v, Sized))
        budget.check_count(total)


FILTER_CHECKS: dict[str, Callable[..., None]] = {
    "indent": _filter_indent, "format": _filter_format, "replace": _filter_replace,
    "join": _filter_join, "list": _filter_list, "tojson": _filter_tojson,
    "string": _filter_stringify, "pprint": _filter_pprint, "center": _filter_center,
    "truncate": _filter_stringify, "trim": _filter_stringify, "safe": _filter_stringify,
    "upper": _filter_case, "lower": _filter_case, "capitalize": _filter_case,
    "title": _filter_words, "striptags": _filter_words, "urlize": _filter_urlize,
    "wordcount": _filter_words, "wordwrap": _filter_wordwrap, "escape": _filter_escape,
    "e": _filter_escape, "forceescape": _filter_escape, "urlencode": _filter_urlencode,
    "xmlattr": _filter_xmlattr, "batch": _filter_batch, "slice": _filter_slice,
    "sum": _filter_sum,
}
SELECTING_FILTERS = frozenset({"attr", "d", "default", "first", "last", "max", "min", "random"})
"""Filters that return (a part of) their input rather than build anything."""


def check_lipsum(budget: Budget, n: Any = 5, html: Any = True, min: Any = 20,
                 max: Any = 100) -> None:  # noqa: A002 - lipsum's own argument names
    if _is_int(n) and _is_int(max):
        budget.check_size(n * max * 16, "str")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
