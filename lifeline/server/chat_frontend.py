"""Stage 2 seen from the server: messages to prompt ids (and their anatomy), and generated text
back to content, reasoning and tool calls. The work is `lifeline.chat`'s; this file picks the
server's template and parsers and adapts them to the endpoints."""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lifeline.chat import (
    ChatError,
    ChatInputs,
    ChatTemplate,
    ReasoningParser,
    ToolCallDelta,
    ToolCallParser,
    builtin_family,
    encode_prompt,
    opens_reasoning,
    resolve_template,
    template_for_request,
)
from lifeline.chat.anatomy import anatomy_of_inputs
from lifeline.server.config import ServerConfig
from lifeline.server.engine_client import ModelInfo

REASONING_PARSERS = ("think",)
TOOL_CALL_PARSERS = ("hermes",)


@dataclass(slots=True)
class RenderedPrompt:
    """A chat request's prompt: its text (request strings escaped, see `encode_prompt`), and
    what anatomy needs to be computed later."""
    text: str
    template: ChatTemplate
    inputs: ChatInputs
    images: list[Any] = field(default_factory=list)
    """The request's images in prompt order (lifeline.media.prepare.PreparedImage)."""


@dataclass(slots=True)
class Delta:
    """What one piece of generated text adds to a chat message."""
    content: str = ""
    reasoning: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)

    def __add__(self, other: Delta) -> Delta:
        return Delta(self.content + other.content, self.reasoning + other.reasoning,
                     self.tool_calls + other.tool_calls)


class OutputParser:
    """Reasoning first (`<think>…</think>`), then tool calls in what is left as content."""

    def __init__(self, reasoning: ReasoningParser | None, tools: ToolCallParser | None):
        self.reasoning = reasoning
        self.tools = tools
        self.saw_tool_calls = False

    @property
    def in_reasoning(self) -> bool:
        return self.reasoning is not None and self.reasoning.in_reasoning

    def feed(self, text: str) -> Delta:
        if self.reasoning is None:
            return self._content(text, final=False)
        reasoning, content = self.reasoning.feed(text)
        delta = self._content(content, final=False)
        delta.reasoning = reasoning
        return delta

    def finish(self) -> Delta:
        if self.reasoning is None:
            return self._content("", final=True)
        reasoning, content = self.reasoning.flush()
        delta = self._content(content, final=True)
        delta.reasoning = reasoning
        return delta

    def _content(self, text: str, final: bool) -> Delta:
        if self.tools is None:
            return Delta(content=text)
        events = self.tools.feed(text) if text else []
        if final:
            events += self.tools.flush()
        delta = Delta()
        for event in events:
            if isinstance(event, ToolCallDelta):
                delta.tool_calls.append(event.as_dict())
                self.saw_tool_calls = True
            else:
                delta.content += event
        return delta


class ChatFrontend:
    def __init__(self, model: ModelInfo, tokenizer: Any, config: ServerConfig):
        if config.reasoning_parser not in (None, *REASONING_PARSERS):
            raise ValueError(f"unknown reasoning parser {config.reasoning_parser!r}")
        if config.tool_call_parser not in (None, *TOOL_CALL_PARSERS):
            raise ValueError(f"unknown tool-call parser {config.tool_call_parser!r}")
        self.config = config
        self.tokenizer = tokenizer
        self.preparer = None
        """A vision-language model's image path (lifeline.media.prepare); None: text only."""
        if model.vision is not None:
            from lifeline.media.prepare import ImagePreparer

            from lifeline.media.fetch import FetchPolicy
            from lifeline.server.image_budget import ImageBudget

            self.preparer = ImagePreparer(model.vision)
            self.image_budget = ImageBudget(config.max_queued_image_bytes)
            self.fetch_policy = FetchPolicy(tuple(config.allowed_media_domains),
                                            config.max_image_bytes, config.media_fetch_timeout_s)
        self.template = resolve_template(
            template_file=config.chat_template,
            gguf_template=(_gguf_template(model.source) if model.chat_template is None
                           else model.chat_template or None),
            hf_dir=model.source if Path(model.source).is_dir() else None,
            family=builtin_family(model.architecture),
            bos_token=self._special_text("bos_token_id"),
            eos_token=self._special_text("eos_token_id"),
            escape=getattr(self.tokenizer, "escape_specials", None))

    def _special_text(self, name: str) -> str:
        token = getattr(self.tokenizer, name, None)
        if token is None:
            return ""
        return self.tokenizer.token_to_bytes(token).decode("utf-8", "replace")

    def render(self, body: Any) -> RenderedPrompt:
        """The prompt text of a chat request (raises `ChatError`, a ValueError, with `param`)."""
        template = template_for_request(
            self.template, body.chat_template,
            allow_request_template=self.config.allow_request_chat_template)
        messages = [m.model_dump(exclude_none=True) for m in body.messages]
        urls: list[tuple[str, str]] | None = [] if self.preparer is not None else None
        inputs = ChatInputs.from_request(
            messages, tools=body.tools, tool_choice=body.tool_choice,
            add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message,
            chat_template_kwargs=body.chat_template_kwargs, images=urls,
            content_parts=template.reads_parts)
        inputs = template.escaped(inputs)
        text = template.render_inputs(inputs)
        if not urls:
            return RenderedPrompt(text, template, inputs)
        charge = self.image_budget.request()
        images = [self._image(field_name, url, charge) for field_name, url in
                  _at_most(urls, self.config.max_images)]
        try:
            text = self.preparer.expand_text(text, images)
        except ValueError as exc:
            raise ChatError(f"the chat template placed the images wrongly: {exc}") from None
        return RenderedPrompt(text, template, inputs, images)

    def _image(self, field_name: str, url: str, charge: Any) -> Any:
        """Decoded and processed under the server's limits, each stage timed; the decoded
        picture is charged to `charge` (lifeline.server.image_budget.RequestImages) while it is
        processed, then freed; the frames and the encoded bytes until the frames are freed."""
        from lifeline.media.fetch import fetch_image
        from lifeline.media.images import ImageLimits, MediaError, decode_image, parse_data_url

        timings = {}
        t0 = time.perf_counter()
        if url.startswith("data:"):
            declared, data = parse_data_url(url, param=field_name)
        elif url.split(":", 1)[0].lower() in ("http", "https"):
            declared, data = None, fetch_image(url, self.fetch_policy, param=field_name)
            timings["fetch_s"] = time.perf_counter() - t0
            t0 = time.perf_counter()
        else:
            scheme = url.split(":", 1)[0][:16]
            raise MediaError(f"image URLs with scheme {scheme!r} are not fetched: send a "
                             "data: URL (data:image/png;base64,...)", param=field_name,
                             code="unsupported_image_url")
        limits = ImageLimits(max_bytes=self.config.max_image_bytes,
                             max_pixels=self.config.max_image_pixels)
        with charge.reserving() as reserve:
            decoded = decode_image(data, limits, declared=declared, param=field_name,
                                   reserve=reserve)
            timings["decode_s"] = time.perf_counter() - t0
            prepared = self.preparer.prepare(decoded, timings)
            del decoded
        frames = prepared.processed.pixel_values
        charge.tie(frames, frames.nbytes + len(data))
        return prepared

    def spans(self, prompt: RenderedPrompt, ids: list[int]) -> tuple[Any, ...]:
        """The prompt's images where its tokens put them (empty for a text prompt)."""
        if not prompt.images:
            return ()
        spans = tuple(self.preparer.spans(ids, prompt.images))
        prompt.images = [i.without_frames() for i in prompt.images]  # the spans own them now
        return spans

    def encode(self, prompt: RenderedPrompt) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer, so it cannot serve chat")
        return encode_prompt(self.tokenizer, prompt.text)

    def anatomy(self, prompt: RenderedPrompt, ids: list[int]) -> dict[str, int]:
        """Prompt tokens by origin; with images, an `images` part: the images' placeholders
        (their tokens and the markers around them), the rest split as the text alone."""
        if not prompt.images:
            return anatomy_of_inputs(prompt.template, self.tokenizer, prompt.inputs,
                                     ids).as_dict()
        messages = [{**m, "content": "".join(p.get("text", "") for p in m["content"])}
                    if isinstance(m.get("content"), list) else m for m in prompt.inputs.messages]
        text = dataclasses.replace(prompt.inputs, messages=messages)
        out = anatomy_of_inputs(prompt.template, self.tokenizer, text).as_dict()
        out["images"] = sum(len(self.tokenizer.encode(p.placeholder, add_special_tokens=False))
                            for p in prompt.images)
        out["template"] += len(ids) - out["total"] - out["images"]  # what joining moved
        out["total"] = len(ids)
        return out

    def parser(self, body: Any, prompt: RenderedPrompt) -> OutputParser:
        reasoning = None
        if self.config.reasoning_parser == "think":
            reasoning = ReasoningParser(starts_in_reasoning=opens_reasoning(prompt.text))
        tools = None
        if self.config.tool_call_parser == "hermes" and body.tools and body.tool_choice != "none":
            tools = ToolCallParser()
        return OutputParser(reasoning, tools)


def _gguf_template(source: str) -> str | None:
    path = Path(source)
    if not path.is_file() or path.suffix != ".gguf":
        return None
    from lifeline.model.gguf_file import GGUFFile

    value = GGUFFile(path).metadata.get("tokenizer.chat_template")
    return value if isinstance(value, str) and value else None


def _at_most(urls: list[tuple[str, str]], limit: int) -> list[tuple[str, str]]:
    if len(urls) > limit:
        raise ChatError(f"a request may carry at most {limit} images; this one has "
                        f"{len(urls)}")
    return urls
