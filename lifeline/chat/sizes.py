"""Upper bounds on the length of what `str`, `repr`, `json.dumps` and `pprint.pformat` would
write for a value, computed without writing it.

A template can build a structure that is small in memory but huge when written out: one list
referenced a thousand times, a thousand times over. The bound walks each distinct object once
(by identity) and multiplies, so its cost grows with the structure's size in memory, not with the
size of its text."""
from __future__ import annotations

from collections.abc import ItemsView, KeysView, ValuesView
from dataclasses import dataclass
from typing import Any

import jinja2

_CONTROL_BYTES = bytes(range(32)) + b"\x7f"
_HIGH_BYTES = bytes(range(128, 256))
_CHUNK = 1 << 16
_OTHER = 200
"""What an object of no known kind may write (a macro, a loop, an undefined value)."""


@dataclass(slots=True, frozen=True)
class Style:
    """How a value is written: `repr` inside containers (`str` and `pprint`) or JSON."""

    json: bool = False
    ensure_ascii: bool = False
    item_sep: int = 2
    key_sep: int = 2
    indent: int | None = None
    """Characters of indentation per level; None: no newlines either."""


@dataclass(slots=True)
class _Tally:
    chars: int = 0
    items: int = 0
    """Items and containers, counted with multiplicity: each may start a line when indented."""
    depth: int = 0


class Sizer:
    """Bounds for one value; `tick` is called every so many objects (the render's deadline)."""

    __slots__ = ("_active", "_memo", "_seen", "style", "tick")

    def __init__(self, style: Style, tick: Any = None):
        self.style = style
        self.tick = tick
        self._memo: dict[int, _Tally] = {}
        self._active: set[int] = set()
        self._seen = 0

    def written(self, value: Any) -> int:
        """A bound on the length of the value written out in this style."""
        tally = self._tally(value)
        if self.style.indent is None:
            return tally.chars
        return tally.chars + tally.items * (1 + self.style.indent * (tally.depth + 1))

    def _tally(self, value: Any) -> _Tally:
        if isinstance(value, str):
            return _Tally(escaped_length(value, self.style), 0, 0)
        if isinstance(value, (list, tuple, set, frozenset, dict, KeysView, ValuesView, ItemsView,
                              jinja2.utils.Namespace)):
            return self._container(value)
        return _Tally(_scalar_length(value), 0, 0)

    def _container(self, value: Any) -> _Tally:
        key = id(value)
        if key in self._memo:
            return self._memo[key]
        if key in self._active:
            return _Tally(_OTHER, 1, 0)
        self._seen += 1
        if self.tick is not None and self._seen % 1024 == 0:
            self.tick()
        self._active.add(key)
        try:
            tally = self._sum(value)
        finally:
            self._active.discard(key)
        self._memo[key] = tally
        return tally

    def _sum(self, value: Any) -> _Tally:
        if isinstance(value, jinja2.utils.Namespace):
            value = value._Namespace__attrs  # type: ignore[attr-defined]
        total = _Tally(_OTHER if not isinstance(value, (list, tuple, dict)) else 4, 1, 0)
        pairs = value.items() if isinstance(value, dict) else None
        for item in (value if pairs is None else pairs):
            parts = item if pairs is not None else (item,)
            total.chars += self.style.item_sep
            total.items += 1
            for part in parts:
                sub = self._tally(part)
                total.chars += sub.chars
                total.items += sub.items
                total.depth = max(total.depth, sub.depth + 1)
            if pairs is not None:
                total.chars += self.style.key_sep
        return total


def escaped_length(text: str, style: Style) -> int:
    """A bound on the length of `text` written as a quoted string literal in `style`."""
    quotes = text.count("\\") + text.count('"') + (0 if style.json else text.count("'"))
    if text.isascii() and text.isprintable():
        return len(text) + 2 + quotes
    controls = high = 0
    for start in range(0, len(text), _CHUNK):
        data = text[start:start + _CHUNK].encode("utf-8", "surrogatepass")
        controls += len(data) - len(data.translate(None, _CONTROL_BYTES))
        high += len(data) - len(data.translate(None, _HIGH_BYTES))
    escapes_high = style.ensure_ascii if style.json else not text.isprintable()
    return len(text) + 2 + quotes + 5 * controls + (3 * high if escapes_high else 0)


def _scalar_length(value: Any) -> int:
    if isinstance(value, bool) or value is None:
        return 5
    if isinstance(value, int):
        return value.bit_length() * 30103 // 100000 + 2
    if isinstance(value, float):
        return 24
    if isinstance(value, bytes):
        return 4 * len(value) + 3
    return _OTHER


def str_length(value: Any, tick: Any = None) -> int:
    """A bound on `len(str(value))`."""
    if isinstance(value, str):
        return len(value)
    return Sizer(Style(), tick).written(value)


def repr_length(value: Any, tick: Any = None) -> int:
    return Sizer(Style(), tick).written(value)


def pformat_length(value: Any, tick: Any = None) -> int:
    """`pprint.pformat` writes `repr`, breaking lines (each indented by its depth) between items
    and inside long strings at whitespace, quoting each piece."""
    sizer = Sizer(Style(), tick)
    tally = sizer._tally(value)
    pieces = tally.items + tally.chars // 2 + 1
    return tally.chars + pieces * (tally.depth + 5)


def json_length(value: Any, *, ensure_ascii: bool, indent: Any, separators: Any,
                tick: Any = None) -> int:
    """A bound on `len(json.dumps(value, ...))` with the filter's arguments."""
    if isinstance(indent, int) and not isinstance(indent, bool):
        width = max(indent, 0)
    else:
        width = len(indent) if isinstance(indent, str) else 0
    item_sep, key_sep = ", ", ": "
    if isinstance(separators, (list, tuple)) and len(separators) == 2 \
            and all(isinstance(s, str) for s in separators):
        item_sep, key_sep = separators
    style = Style(json=True, ensure_ascii=bool(ensure_ascii), item_sep=len(item_sep),
                  key_sep=len(key_sep), indent=None if indent is None else width)
    return Sizer(style, tick).written(value)
