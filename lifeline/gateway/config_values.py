"""Reading one table of a gateway file: typed values, defaults, and errors that name the key
(`backends.a.timeout: unknown key (known here: ...)`)."""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

_MISSING = object()


class ConfigError(ValueError):
    """A configuration that cannot be served; the message names the file and the key."""


class Table:
    """One mapping of the file, read key by key; `done` rejects the keys nobody read."""

    def __init__(self, data: Any, path: str, source: str):
        if not isinstance(data, dict):
            raise ConfigError(f"{source}: {path or 'the file'}: expected a table, "
                              f"got {kind_of(data)}")
        self.data, self.path, self.source = dict(data), path, source
        self.known: list[str] = []

    def key(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def fail(self, key: str, message: str) -> ConfigError:
        return ConfigError(f"{self.source}: {self.key(key)}: {message}")

    def get(self, key: str, check: Callable[[Any], Any], default: Any = _MISSING) -> Any:
        self.known.append(key)
        if key not in self.data:
            if default is _MISSING:
                raise self.fail(key, "required")
            return default
        value = self.data.pop(key)
        try:
            return check(value)
        except (TypeError, ValueError) as exc:
            raise self.fail(key, str(exc)) from None

    def table(self, key: str, default: Any = _MISSING) -> Table | None:
        self.known.append(key)
        if key not in self.data:
            if default is _MISSING:
                raise self.fail(key, "required")
            return default
        return Table(self.data.pop(key), self.key(key), self.source)

    def done(self) -> None:
        for key in self.data:
            known = ", ".join(sorted(self.known)) or "none"
            raise self.fail(str(key), f"unknown key (known here: {known})")


def kind_of(value: Any) -> str:
    return {dict: "a table", list: "a list", str: "a string", bool: "a boolean",
            int: "an integer", float: "a number"}.get(type(value), type(value).__name__)


def text(value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"expected a non-empty string, got {kind_of(value)}")
    return value


def boolean(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"expected true or false, got {kind_of(value)}")
    return value


def integer(low: int) -> Callable[[Any], int]:
    def check(value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"expected an integer, got {kind_of(value)}")
        if value < low:
            raise ValueError(f"must be at least {low}, got {value}")
        return value
    return check


def positive(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"expected a number, got {kind_of(value)}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"must be a positive number, got {value}")
    return float(value)


def non_negative(value: Any) -> float:
    if isinstance(value, int | float) and not isinstance(value, bool) and value == 0:
        return 0.0
    return positive(value)


def names(value: Any) -> tuple[str, ...]:
    if not isinstance(value, list):
        raise ValueError(f"expected a list of names, got {kind_of(value)}")
    for i, item in enumerate(value):
        if not isinstance(item, str) or not item:
            raise ValueError(f"item {i}: expected a non-empty string, got {kind_of(item)}")
    return tuple(value)


def _sticky_sources(value: Any) -> tuple[str, ...]:
    if value is True:
        return ("x-session-id", "user")
    if value is False:
        return ()
    if isinstance(value, str):
        value = [value]
    sources = names(value)
    return tuple(s if s == "user" else s.lower() for s in sources)


def size(value: Any) -> int:
    if isinstance(value, str):
        from lifeline.cli import parse_bytes

        try:
            return parse_bytes(value)
        except Exception as exc:  # argparse.ArgumentTypeError
            raise ValueError(str(exc)) from None
    return integer(1)(value)


def choice(options: tuple[str, ...]) -> Callable[[Any], str]:
    def check(value: Any) -> str:
        if value not in options:
            raise ValueError(f"expected one of {', '.join(options)}, got {value!r}")
        return value
    return check


def tables(value: Any) -> list[Any]:
    if not isinstance(value, list) or not value:
        raise ValueError(f"expected a non-empty list of tables, got {kind_of(value)}")
    return value


def sticky(value: Any) -> tuple[str, ...]:
    if not isinstance(value, bool | str | list):
        raise ValueError(f"expected true, false, 'user', a header name or a list of them, "
                         f"got {kind_of(value)}")
    return _sticky_sources(value)


def at_least_one(value: Any) -> float:
    number = positive(value)
    if number < 1:
        raise ValueError(f"must be at least 1, got {value}")
    return number
