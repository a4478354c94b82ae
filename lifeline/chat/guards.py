"""The render budget of a chat template, and the checks that keep one operation from building
something huge before the budget could notice (``"x" * 10**10``, ``center(10**10)``).

The budget counts operations (loop iterations, calls, filters, outputs) and watches a
deadline; sizes are checked before an operation that can grow its input many times over and
after every other one that builds a string or a container."""
from __future__ import annotations

import re
import time
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from lifeline.chat.errors import TemplateTimeout

MAX_RANGE = 100_000
MAX_POWER_BITS = 1 << 20


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

    def __post_init__(self) -> None:
        if not (self.timeout_s > 0 and min(self.max_operations, self.max_output_chars,
                                           self.max_items) > 0):
            raise ValueError("render limits must be positive")


class Budget:
    """What is left of one render's limits."""

    __slots__ = ("deadline", "emitted", "limits", "operations")

    def __init__(self, limits: RenderLimits):
        self.limits = limits
        self.deadline = time.monotonic() + limits.timeout_s
        self.operations = 0
        self.emitted = 0

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

    def check_result(self, value: Any) -> Any:
        if isinstance(value, (str, bytes, list, tuple, dict, set, frozenset)):
            self.check_size(len(value), type(value).__name__)
        return value

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
        _check_repeat(budget, left, right)
        _check_repeat(budget, right, left)
    elif operator == "%" and isinstance(left, str):
        args = right if isinstance(right, tuple) else (right,)
        check_format(budget, left, args if "*" in left else ())


def _check_repeat(budget: Budget, seq: Any, times: Any) -> None:
    if isinstance(seq, (str, list, tuple)) and _is_int(times):
        budget.check_size(len(seq) * times, type(seq).__name__)


def check_format(budget: Budget, fmt: str, ints: Any = ()) -> None:
    """Widths and precisions written in a format string, and the ints it may take them from."""
    for digits in re.findall(r"\d+", fmt):
        if len(digits) > 18 or int(digits) > budget.limits.max_output_chars:
            raise TemplateTimeout("chat template format width is over the size limit")
    budget.check_ints(ints)


def replaced_size(text: Any, old: Any, new: Any, count: Any = -1) -> int:
    if not (isinstance(text, str) and isinstance(old, str) and isinstance(new, str)):
        return 0
    hits = text.count(old)
    if _is_int(count) and count >= 0:
        hits = min(hits, count)
    return len(text) + hits * max(0, len(new) - len(old))


def check_str_method(budget: Budget, text: str, name: str, args: tuple, kwargs: dict) -> None:
    check = _STR_CHECKS.get(name)
    if check is not None:
        check(budget, text, *args, **kwargs)


def _widen(budget: Budget, text: str, width: Any = 0, *_: Any, **__: Any) -> None:
    budget.check_ints([width])


def _expandtabs(budget: Budget, text: str, tabsize: Any = 8, **_: Any) -> None:
    if _is_int(tabsize):
        budget.check_size(len(text) + text.count("\t") * tabsize, "str")


def _replace(budget: Budget, text: str, old: Any = "", new: Any = "", count: Any = -1) -> None:
    budget.check_size(replaced_size(text, old, new, count), "str")


def _format(budget: Budget, text: str, *args: Any, **kwargs: Any) -> None:
    nested = re.search(r"\{[^{}]*\{", text) is not None
    check_format(budget, text, [*args, *kwargs.values()] if nested else ())


def _translate(budget: Budget, text: str, table: Any = None, *_: Any) -> None:
    if isinstance(table, dict):
        longest = max((len(v) for v in table.values() if isinstance(v, str)), default=1)
        budget.check_size(len(text) * longest, "str")


_STR_CHECKS: dict[str, Callable[..., None]] = {
    "center": _widen, "ljust": _widen, "rjust": _widen, "zfill": _widen,
    "expandtabs": _expandtabs, "replace": _replace, "format": _format,
    "format_map": lambda budget, text, mapping=None: _format(budget, text),
    "translate": _translate,
}


def _filter_indent(budget: Budget, text: Any, width: Any = 4, *_: Any, **__: Any) -> None:
    if isinstance(width, str) and isinstance(text, str):
        budget.check_size(len(width) * (text.count("\n") + 1) + len(text), "str")


def _filter_format(budget: Budget, value: Any, *args: Any, **kwargs: Any) -> None:
    if isinstance(value, str):
        check_format(budget, value, args if "*" in value else ())


def _filter_replace(budget: Budget, text: Any, old: Any = "", new: Any = "",
                    count: Any = None) -> None:
    budget.check_size(replaced_size(str(text), old, new, -1 if count is None else count), "str")


FILTER_CHECKS: dict[str, Callable[..., None]] = {
    "indent": _filter_indent, "format": _filter_format, "replace": _filter_replace,
}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
