"""Jinja2's immutable sandbox, set up as Hugging Face sets it up for chat templates, with a hard
render budget.

Every `for` loop iterates through a counting wrapper, every output (into buffers too) is counted
and measured, every call, filter and size-changing operator ticks the budget, and the deadline
is checked as the budget ticks. A tight loop such as ``{% for i in range(10**9) %}`` therefore
stops by itself: no thread or process has to be killed."""
from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Iterator
from datetime import datetime
from typing import Any, ClassVar

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError
from jinja2.visitor import NodeTransformer

from lifeline.chat import guards, sizes
from lifeline.chat.errors import ChatError, TemplateTimeout
from lifeline.chat.guards import RenderLimits

_ITER, _EMIT, _CONCAT = "_lifeline_iter", "_lifeline_emit", "_lifeline_concat"
_SLICED = "_lifeline_sliced"


class TemplateRaised(jinja2.TemplateError):
    """`raise_exception(...)` called by the template: the template rejects the messages."""


class _GenerationTag(Extension):
    """`{% generation %}…{% endgeneration %}` marks assistant text for training masks; the
    prompt is the body, unchanged."""

    tags: ClassVar[set[str]] = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


class _Instrument(NodeTransformer):
    """Routes loop iterables, outputs, `~` concatenations and slices through the budget
    filters."""

    def visit_For(self, node: nodes.For) -> nodes.Node:
        self.generic_visit(node)
        node.iter = _wrap(node.iter, _ITER)
        return node

    def visit_Output(self, node: nodes.Output) -> nodes.Node:
        self.generic_visit(node)
        node.nodes = [_wrap(child, _EMIT) for child in node.nodes]
        return node

    def visit_Getitem(self, node: nodes.Getitem) -> nodes.Node:
        self.generic_visit(node)
        return _wrap(node, _SLICED) if isinstance(node.arg, nodes.Slice) else node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Node:
        self.generic_visit(node)
        return _wrap(nodes.List(node.nodes, lineno=node.lineno), _CONCAT)


def _wrap(node: nodes.Expr, name: str) -> nodes.Filter:
    return nodes.Filter(node, name, [], [], None, None, lineno=node.lineno)


@jinja2.pass_context
def _iterate(context: Any, iterable: Iterable[Any]) -> Iterator[Any]:
    budget = guards.current_budget()
    for item in iterable:
        budget.tick()
        yield item


@jinja2.pass_context
def _emit(context: Any, value: Any) -> str:
    budget = guards.current_budget()
    budget.check_str(value)
    return budget.emit(value if isinstance(value, str) else str(value))


@jinja2.pass_eval_context
def _concat(eval_ctx: Any, values: list[Any]) -> str:
    """`a ~ b ~ ...`, its length checked before it is built."""
    budget = guards.current_budget()
    budget.tick()
    budget.check_size(sum(sizes.str_length(v, budget.check_deadline) for v in values))
    join = jinja2.runtime.markup_join if eval_ctx.autoescape else jinja2.runtime.str_join
    return budget.check_result(join(values), values)


@jinja2.pass_context
def _sliced(context: Any, value: Any) -> Any:
    """A slice (Jinja writes `x[a:b]` as Python's own subscript): a copy, which counts."""
    budget = guards.current_budget()
    budget.tick()
    return budget.check_result(value)


def _guard_filter(name: str, func: Any) -> Any:
    offset = 2 if getattr(func, "jinja_pass_arg", None) is not None else 1
    precheck = guards.FILTER_CHECKS.get(name)
    materialize = name in guards.MATERIALIZED_FILTERS
    built = name not in guards.SELECTING_FILTERS

    @functools.wraps(func)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        budget = guards.current_budget()
        budget.tick()
        budget.check_ints([*args[offset:], *kwargs.values()])
        if materialize and len(args) >= offset:
            args = (*args[:offset - 1], guards.materialize(budget, args[offset - 1]),
                    *args[offset:])
        if precheck is not None:
            precheck(budget, *args[offset - 1:], **kwargs)
        return budget.check_result(func(*args, **kwargs), args[offset - 1:offset], built)

    return guarded


def _lipsum(*args: Any, **kwargs: Any) -> str:
    budget = guards.current_budget()
    budget.tick()
    budget.check_ints([*args, *kwargs.values()])
    guards.check_lipsum(budget, *args, **kwargs)
    return budget.check_result(jinja2.utils.generate_lorem_ipsum(*args, **kwargs))


def _raise_exception(message: str) -> None:
    raise TemplateRaised(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: Any = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                      separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    """Hugging Face's helper, its output bounded from the format before it is written."""
    budget = guards.current_budget()
    guards.check_strftime(budget, fmt)
    return budget.check_result(datetime.now().strftime(fmt))


class _Namespace(jinja2.utils.Namespace):
    """`namespace(...)` that refuses underscore names, as Hugging Face's does."""

    def __init__(*args: Any, **kwargs: Any):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _check_public(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _check_public(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)


class _TemplateDict:
    """`dict(...)` without access to the `dict` type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args)


def _check_public(name: Any) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise SecurityError(f"namespace attribute {name!r} may not start with '_'")


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """Hugging Face's chat-template environment, with every operation on a budget."""

    intercepted_binops = frozenset({"*", "**", "%", "+"})

    def __init__(self) -> None:
        super().__init__(trim_blocks=True, lstrip_blocks=True,
                         extensions=[loopcontrols, _GenerationTag])
        self.filters["tojson"] = _tojson
        self.filters = {name: _guard_filter(name, f) for name, f in self.filters.items()}
        self.filters.update({_ITER: _iterate, _EMIT: _emit, _CONCAT: _concat,
                             _SLICED: _sliced})
        self.globals.update(range=guards.bounded_range, raise_exception=_raise_exception,
                            lipsum=_lipsum,
                            strftime_now=_strftime_now, namespace=_Namespace, dict=_TemplateDict())

    def _parse(self, source: str, name: str | None, filename: str | None) -> nodes.Template:
        tree = _Instrument().visit(super()._parse(source, name, filename))
        tree.set_environment(self)
        return tree

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        budget = guards.current_budget()
        budget.tick()
        guards.check_binop(budget, operator, left, right)
        return budget.check_result(super().call_binop(context, operator, left, right),
                                   (left, right))

    def call(self, context: Any, obj: Any, /, *args: Any, **kwargs: Any) -> Any:
        budget = guards.current_budget()
        budget.tick()
        target = getattr(obj, "__wrapped__", obj)
        owner = getattr(target, "__self__", None)
        if isinstance(owner, (str, bytes)):
            name = getattr(target, "__name__", "")
            if name in guards.MATERIALIZED_STR_ARGS and args:
                args = (guards.materialize(budget, args[0]), *args[1:])
            guards.check_str_method(budget, owner, name, args, kwargs)
        result = super().call(context, obj, *args, **kwargs)
        built = not isinstance(owner, (dict, list, tuple))
        return budget.check_result(result, (owner, *args, *kwargs.values()), built)


_ENV = BoundedSandbox()


@functools.lru_cache(maxsize=64)
def compile_template(source: str) -> jinja2.Template:
    """The compiled template; a syntax error is a `ChatError` on `chat_template`."""
    try:
        return _ENV.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatError(f"chat template syntax error (line {exc.lineno}): {exc.message}",
                        param="chat_template") from None
    except (RecursionError, MemoryError):
        raise ChatError("chat template is too deeply nested", param="chat_template") from None


def render_bounded(template: jinja2.Template, context: dict[str, Any],
                   limits: RenderLimits) -> str:
    """Render within `limits`; every failure is a `ChatError` (a `TemplateTimeout` when a limit
    was hit)."""
    _, token = guards.start_budget(limits)
    try:
        return template.render(context)
    except ChatError:
        raise
    except TemplateRaised as exc:
        raise ChatError(f"chat template rejected the messages: {exc.message}") from None
    except SecurityError as exc:
        raise ChatError(f"chat template blocked by the sandbox: {exc}",
                        param="chat_template") from None
    except (RecursionError, MemoryError) as exc:
        raise TemplateTimeout(f"chat template stopped: {type(exc).__name__}") from None
    except Exception as exc:  # noqa: BLE001 - any failure of a template is the request's 400
        raise ChatError(f"chat template failed: {type(exc).__name__}: {exc}") from None
    finally:
        guards.end_budget(token)
