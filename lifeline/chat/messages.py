"""OpenAI-style chat inputs checked and reduced to the plain data chat templates expect.

- Roles: system, developer (rendered as system), user, assistant, tool.
- Content: a string, or a list of `{"type": "text", "text": ...}` parts; for a model that takes
  images, `image_url` parts too (each becomes a `{"type": "image"}` part, as vision templates
  read it); other part types are refused. A list reaches the template as the template reads
  content (`reads_content_parts`): a template that loops over a message's parts gets the list,
  as transformers hands it over; one that prints content whole gets the text parts joined with
  "\\n" (vLLM's 'openai' and 'string' content formats). A list with images stays a list.
  `null` content is allowed only for an assistant message that carries `tool_calls`.
- An assistant's `tool_calls[].function.arguments` arrive as a JSON string (OpenAI) and are
  handed to the template as a dict (Hugging Face templates call `tojson` on them).
- A message's reasoning, sent as `reasoning_content` or `reasoning`, is passed as
  `reasoning_content`."""
from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from typing import Any

from jinja2 import nodes

from lifeline.chat.errors import ChatError
from lifeline.chat.sandbox import compile_template

ROLES = ("system", "developer", "user", "assistant", "tool")
RESERVED_KWARGS = frozenset({"messages", "tools", "tool_choice", "add_generation_prompt",
                             "bos_token", "eos_token", "documents"})


def normalize_messages(messages: Any, images: list[tuple[str, str]] | None = None, *,
                       parts: bool = False) -> list[dict[str, Any]]:
    """`images`: a list to collect the `image_url` parts' (field, url) into, for a model that
    takes images; their place in a message becomes a `{"type": "image"}` part, as Hugging
    Face's vision templates read it. None: image parts are refused. `parts`: the template
    loops over content parts (`reads_content_parts`), so a list of text parts stays a list."""
    if not isinstance(messages, list) or not messages:
        raise ChatError("'messages' must be a non-empty list")
    return [_message(i, m, images, parts) for i, m in enumerate(messages)]


@functools.lru_cache(maxsize=64)
def reads_content_parts(source: str) -> bool:
    """Whether a chat template loops over a message's content (`{% for part in
    message['content'] %}`, directly or through a variable set from it), as SmolVLM's and
    most vision templates do. Such a template shows nothing of a content given as a list of
    parts and then joined into a string, so it must get the list."""
    tree = compile_template(source).environment.parse(source)
    names = {node.target.name for node in tree.find_all(nodes.Assign)
             if isinstance(node.target, nodes.Name) and _is_content(node.node, set())}
    return any(_is_content(node.iter, names) for node in tree.find_all(nodes.For))


def _is_content(expr: nodes.Node, names: set[str]) -> bool:
    """`x.content`, `x['content']` or a name set from one, under any filters."""
    while isinstance(expr, nodes.Filter) and expr.node is not None:
        expr = expr.node
    if isinstance(expr, nodes.Getattr):
        return expr.attr == "content"
    if isinstance(expr, nodes.Getitem):
        return isinstance(expr.arg, nodes.Const) and expr.arg.value == "content"
    return isinstance(expr, nodes.Name) and expr.name in names


def _message(i: int, message: Any, images: list[tuple[str, str]] | None = None,
             parts: bool = False) -> dict[str, Any]:
    where = f"messages[{i}]"
    if not isinstance(message, Mapping):
        raise ChatError(f"{where} must be an object")
    role = message.get("role")
    if role not in ROLES:
        raise ChatError(f"{where}.role must be one of {', '.join(ROLES)}; got {role!r}")
    out: dict[str, Any] = {"role": "system" if role == "developer" else role}
    content = message.get("content")
    tool_calls = message.get("tool_calls") if role == "assistant" else None
    if content is not None:
        out["content"] = _content(where, content, images, parts)
    elif not tool_calls:
        raise ChatError(f"{where}.content is required for a {role} message")
    if tool_calls:
        out["tool_calls"] = _tool_calls(where, tool_calls)
    reasoning = message.get("reasoning_content", message.get("reasoning"))
    if role == "assistant" and reasoning is not None:
        out["reasoning_content"] = _string(f"{where}.reasoning_content", reasoning)
    for key in ("name", "tool_call_id"):
        if message.get(key) is not None:
            out[key] = _string(f"{where}.{key}", message[key])
    return out


def _content(where: str, content: Any, images: list[tuple[str, str]] | None = None,
             keep_parts: bool = False) -> str | list[dict[str, str]]:
    """A string; a list of text and image parts where the content has images or the template
    reads parts (the text parts' strings otherwise joined with newlines)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ChatError(f"{where}.content must be a string or a list of parts")
    parts: list[dict[str, str]] = []
    for j, part in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
        if kind == "image_url" and images is not None:
            url = part.get("image_url")
            url = url.get("url") if isinstance(url, Mapping) else url
            field = f"{at}.image_url.url"
            images.append((field, _string(field, url, param=field)))
            parts.append({"type": "image"})
        elif kind == "image_url":
            raise ChatError(f"{at}: this model takes no images (part type 'image_url')")
        elif kind != "text":
            raise ChatError(f"{at}: part type {kind!r} is not supported (only 'text'"
                            f"{' and image_url' if images is not None else ''})")
        else:
            parts.append({"type": "text", "text": _string(f"{at}.text", part.get("text"))})
    if keep_parts or any(p["type"] == "image" for p in parts):
        return parts
    return "\n".join(p["text"] for p in parts)


def _tool_calls(where: str, calls: Any) -> list[dict[str, Any]]:
    if not isinstance(calls, list):
        raise ChatError(f"{where}.tool_calls must be a list")
    out = []
    for j, call in enumerate(calls):
        at = f"{where}.tool_calls[{j}]"
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping):
            raise ChatError(f"{at}.function must be an object")
        name = _string(f"{at}.function.name", function.get("name"))
        entry = {"type": "function",
                 "function": {"name": name, "arguments": _arguments(at, function.get("arguments"))}}
        if call.get("id") is not None:
            entry["id"] = _string(f"{at}.id", call["id"])
        out.append(entry)
    return out


def _arguments(at: str, arguments: Any) -> dict[str, Any]:
    if arguments is None or arguments == "":
        return {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            raise ChatError(f"{at}.function.arguments is not valid JSON") from None
    if not isinstance(arguments, dict):
        raise ChatError(f"{at}.function.arguments must be a JSON object")
    return arguments


def _string(where: str, value: Any, param: str = "messages") -> str:
    if not isinstance(value, str):
        raise ChatError(f"{where} must be a string", param=param)
    return value


def normalize_tools(tools: Any) -> list[dict[str, Any]] | None:
    """`None` for no tools (an empty list included)."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise ChatError("'tools' must be a list", param="tools")
    out = []
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(function, Mapping) or tool.get("type", "function") != "function":
            raise ChatError(f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}",
                            param="tools")
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise ChatError(f"tools[{i}].function.name must be a non-empty string", param="tools")
        if not isinstance(function.get("parameters", {}), Mapping):
            raise ChatError(f"tools[{i}].function.parameters must be an object", param="tools")
        out.append({"type": "function", "function": dict(function)})
    return out or None


def check_tool_choice(tool_choice: Any, tools: list[dict[str, Any]] | None) -> None:
    if tool_choice is None:
        return
    if tools is None:
        raise ChatError("'tool_choice' requires 'tools'", param="tool_choice")
    if tool_choice in ("none", "auto", "required"):
        return
    function = tool_choice.get("function") if isinstance(tool_choice, Mapping) else None
    name = function.get("name") if isinstance(function, Mapping) else None
    if not isinstance(name, str):
        raise ChatError("'tool_choice' must be 'none', 'auto', 'required' or "
                        "{'type': 'function', 'function': {'name': ...}}", param="tool_choice")
    if name not in {t["function"]["name"] for t in tools}:
        raise ChatError(f"'tool_choice' names {name!r}, which is not among the tools",
                        param="tool_choice")


def check_template_kwargs(kwargs: Any) -> dict[str, Any]:
    if kwargs is None:
        return {}
    if not isinstance(kwargs, Mapping) or not all(isinstance(k, str) for k in kwargs):
        raise ChatError("'chat_template_kwargs' must be an object", param="chat_template_kwargs")
    reserved = sorted(RESERVED_KWARGS.intersection(kwargs))
    if reserved:
        raise ChatError(f"'chat_template_kwargs' may not set {', '.join(reserved)}",
                        param="chat_template_kwargs")
    return dict(kwargs)
