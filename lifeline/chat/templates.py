"""Chat templates: where the server's template comes from, and rendering messages with it.

Source order (`resolve_template`): the `--chat-template` file, the GGUF file's
`tokenizer.chat_template`, the Hugging Face directory (`chat_template.jinja`, then
`tokenizer_config.json`'s `chat_template`, a string or a list of named templates), then the
built-in template of the model's family."""
from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lifeline.chat.builtin import BUILTIN_TEMPLATES
from lifeline.chat.errors import ChatError
from lifeline.chat.guards import RenderLimits
from lifeline.chat.messages import (
    check_template_kwargs,
    check_tool_choice,
    normalize_messages,
    normalize_tools,
    reads_content_parts,
)
from lifeline.chat.sandbox import compile_template, render_bounded

if TYPE_CHECKING:
    from lifeline.tokenizer import Tokenizer

_CONTINUE_MARK = "\ue010lifeline-continue\ue011"


@dataclass(slots=True, frozen=True)
class ChatInputs:
    """A chat request's template inputs, checked and reduced to plain data."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    kwargs: dict[str, Any] = field(default_factory=dict)
    escaped: bool = False
    """Whether special-token spellings in the strings are already placeholders
    (`ChatTemplate.escaped`)."""

    @classmethod
    def from_request(cls, messages: Any, *, tools: Any = None, tool_choice: Any = None,
                     add_generation_prompt: bool = True, continue_final_message: bool = False,
                     chat_template_kwargs: Any = None,
                     images: list[tuple[str, str]] | None = None,
                     content_parts: bool = False) -> ChatInputs:
        """`images`: where a model that takes images collects the image parts' URLs.
        `content_parts`: the template reads content as parts (`ChatTemplate.reads_parts`)."""
        messages = normalize_messages(messages, images, parts=content_parts)
        tools = normalize_tools(tools)
        check_tool_choice(tool_choice, tools)
        if continue_final_message:
            if add_generation_prompt:
                raise ChatError("'continue_final_message' and 'add_generation_prompt' cannot "
                                "both be true", param="continue_final_message")
            if messages[-1]["role"] != "assistant" or "content" not in messages[-1]:
                raise ChatError("'continue_final_message' needs a final assistant message "
                                "with content", param="continue_final_message")
        return cls(messages, tools, tool_choice, bool(add_generation_prompt),
                   bool(continue_final_message), check_template_kwargs(chat_template_kwargs))


@dataclass(slots=True, frozen=True)
class ChatTemplate:
    """A compiled chat template and the special tokens it may write."""

    source: str
    origin: str
    """Where the template came from: 'file:PATH', 'gguf', 'hf:PATH', 'builtin:FAMILY', 'request'."""
    bos_token: str = ""
    eos_token: str = ""
    limits: RenderLimits = field(default_factory=RenderLimits)
    tool_use_source: str | None = None
    """A second template for requests with tools (Hugging Face's named 'tool_use' template)."""
    escape: Callable[[str], str] | None = None
    """The tokenizer's `escape_specials`: applied to every request string before rendering, so
    that text in messages never becomes a control token (see `encode_prompt`)."""

    def __post_init__(self) -> None:
        compile_template(self.source)
        if self.tool_use_source is not None:
            compile_template(self.tool_use_source)

    @property
    def reads_parts(self) -> bool:
        """The template loops over a message's content parts, so a list of parts reaches it
        as a list (lifeline.chat.messages)."""
        return reads_content_parts(self.source) or (
            self.tool_use_source is not None and reads_content_parts(self.tool_use_source))

    def render(self, messages: Any, *, tools: Any = None, tool_choice: Any = None,
               add_generation_prompt: bool = True, continue_final_message: bool = False,
               chat_template_kwargs: Any = None, bos_token: str | None = None,
               eos_token: str | None = None) -> str:
        """The prompt text. Raises `ChatError` (with `param`) for a request the template cannot
        render, `TemplateTimeout` when rendering goes over `limits`."""
        inputs = ChatInputs.from_request(
            messages, tools=tools, tool_choice=tool_choice,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            chat_template_kwargs=chat_template_kwargs, content_parts=self.reads_parts)
        return self.render_inputs(inputs, bos_token=bos_token, eos_token=eos_token)

    def escaped(self, inputs: ChatInputs) -> ChatInputs:
        """`inputs` with every string (keys too) passed through `escape`."""
        if self.escape is None or inputs.escaped:
            return inputs
        esc = functools.partial(_escape_strings, self.escape)
        return replace(inputs, messages=esc(inputs.messages), tools=esc(inputs.tools),
                       tool_choice=esc(inputs.tool_choice), kwargs=esc(inputs.kwargs),
                       escaped=True)

    def render_inputs(self, inputs: ChatInputs, *, bos_token: str | None = None,
                      eos_token: str | None = None) -> str:
        """The prompt text, request strings escaped (see `escaped`)."""
        inputs = self.escaped(inputs)
        messages = inputs.messages
        if inputs.continue_final_message:
            content = messages[-1]["content"]
            content = (content + _CONTINUE_MARK if isinstance(content, str)
                       else [*content, {"type": "text", "text": _CONTINUE_MARK}])
            last = dict(messages[-1], content=content)
            messages = [*messages[:-1], last]
        source = self.source
        if inputs.tools and self.tool_use_source is not None:
            source = self.tool_use_source
        context = {
            **inputs.kwargs, "messages": messages, "tools": inputs.tools,
            "tool_choice": inputs.tool_choice,
            "add_generation_prompt": inputs.add_generation_prompt,
            "bos_token": self.bos_token if bos_token is None else bos_token,
            "eos_token": self.eos_token if eos_token is None else eos_token,
        }
        text = render_bounded(compile_template(source), context, self.limits)
        if len(text) > self.limits.max_prompt_chars:
            raise ChatError(f"the chat template renders these messages as {len(text)} "
                            f"characters; at most {self.limits.max_prompt_chars} are allowed")
        if inputs.continue_final_message:
            cut = text.rfind(_CONTINUE_MARK)
            if cut < 0:
                raise ChatError("the chat template does not show the final assistant message, "
                                "so it cannot be continued", param="continue_final_message")
            text = text[:cut]
        return text


def _escape_strings(escape: Callable[[str], str], value: Any) -> Any:
    if isinstance(value, str):
        return escape(value)
    if isinstance(value, dict):
        return {_escape_strings(escape, k): _escape_strings(escape, v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_escape_strings(escape, v) for v in value]
    return value


def special_token_texts(tokenizer: Tokenizer) -> dict[str, str]:
    """`bos_token` and `eos_token` as templates write them: `resolve_template(...,
    **special_token_texts(tokenizer))`."""
    texts = {}
    for name, token_id in (("bos_token", tokenizer.bos_token_id),
                           ("eos_token", tokenizer.eos_token_id)):
        texts[name] = "" if token_id is None else tokenizer.token_to_bytes(token_id).decode(
            "utf-8", "replace")
    return texts


def resolve_template(*, template_file: str | os.PathLike[str] | None = None,
                     gguf_template: str | None = None,
                     hf_dir: str | os.PathLike[str] | None = None, family: str,
                     bos_token: str = "", eos_token: str = "",
                     limits: RenderLimits | None = None,
                     escape: Callable[[str], str] | None = None) -> ChatTemplate:
    """The server's template, from the first source that has one; `escape` is the tokenizer's
    `escape_specials`."""
    return replace(_resolve(template_file, gguf_template, hf_dir, family, bos_token, eos_token,
                            limits or RenderLimits()), escape=escape)


def _resolve(template_file: str | os.PathLike[str] | None, gguf_template: str | None,
             hf_dir: str | os.PathLike[str] | None, family: str, bos_token: str, eos_token: str,
             limits: RenderLimits) -> ChatTemplate:
    if template_file is not None:
        source = Path(template_file).read_text(encoding="utf-8")
        return ChatTemplate(source, f"file:{template_file}", bos_token, eos_token, limits)
    if gguf_template:
        return ChatTemplate(gguf_template, "gguf", bos_token, eos_token, limits)
    found = _hf_template(Path(hf_dir)) if hf_dir is not None else None
    if found is not None:
        source, tool_use = found
        return ChatTemplate(source, f"hf:{hf_dir}", bos_token, eos_token, limits, tool_use)
    if family not in BUILTIN_TEMPLATES:
        raise ValueError(f"no built-in chat template for {family!r}; "
                         f"known: {', '.join(BUILTIN_TEMPLATES)}")
    return ChatTemplate(BUILTIN_TEMPLATES[family], f"builtin:{family}", bos_token, eos_token,
                        limits)


def _hf_template(hf_dir: Path) -> tuple[str, str | None] | None:
    jinja_file = hf_dir / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8"), None
    config_file = hf_dir / "tokenizer_config.json"
    if not config_file.is_file():
        return None
    template = json.loads(config_file.read_text(encoding="utf-8")).get("chat_template")
    if isinstance(template, list):
        named = {t["name"]: t["template"] for t in template}
        default = named.get("default", next(iter(named.values()), None))
        return (default, named.get("tool_use")) if default else None
    return (template, None) if template else None


def template_for_request(server: ChatTemplate, request_template: str | None, *,
                         allow_request_template: bool) -> ChatTemplate:
    """The template a request renders with: its own `chat_template` only where the server was
    started to allow that (it renders under the same limits)."""
    if request_template is None:
        return server
    if not allow_request_template:
        raise ChatError("this server does not accept a chat template in the request",
                        param="chat_template")
    if not isinstance(request_template, str) or not request_template:
        raise ChatError("'chat_template' must be a non-empty string", param="chat_template")
    return replace(server, source=request_template, origin="request", tool_use_source=None)
