"""Stage 2 seen from the server: messages to prompt ids (with their anatomy) and generated text
back to content, reasoning and tool calls. The work is `lifeline.chat`'s; this file adapts it
to the endpoints."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lifeline.model.loader import LoadedModel
from lifeline.server.config import ServerConfig


@dataclass(slots=True)
class RenderedPrompt:
    token_ids: list[int]
    text: str
    anatomy: dict[str, int] | None = None


@dataclass(slots=True)
class Delta:
    """What one piece of generated text adds to a chat message."""
    content: str = ""
    reasoning: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls)


class PlainParser:
    """No reasoning or tool-call parser: all text is content."""
    in_reasoning = False
    saw_tool_calls = False

    def feed(self, text: str) -> Delta:
        return Delta(content=text)

    def finish(self) -> Delta:
        return Delta()


class ChatFrontend:
    def __init__(self, loaded: LoadedModel, config: ServerConfig):
        self.loaded = loaded
        self.config = config
        self.tokenizer = loaded.tokenizer

    def render(self, body: Any) -> RenderedPrompt:
        raise NotImplementedError

    def parser(self, body: Any) -> PlainParser:
        return PlainParser()
