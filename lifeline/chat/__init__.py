"""Message assembly (stage 2): chat templates, prompt anatomy, reasoning and tool-call parsers."""
from __future__ import annotations

from lifeline.chat.anatomy import (
    PromptAnatomy,
    encode_prompt,
    prompt_add_special_tokens,
    prompt_anatomy,
)
from lifeline.chat.builtin import BUILTIN_TEMPLATES, builtin_family
from lifeline.chat.errors import ChatError, TemplateTimeout
from lifeline.chat.guards import RenderLimits
from lifeline.chat.reasoning import ReasoningParser, opens_reasoning
from lifeline.chat.templates import (
    ChatInputs,
    ChatTemplate,
    resolve_template,
    special_token_texts,
    template_for_request,
)
from lifeline.chat.tool_calls import ToolCall, ToolCallDelta, ToolCallParser

__all__ = [
    "BUILTIN_TEMPLATES",
    "ChatError",
    "ChatInputs",
    "ChatTemplate",
    "PromptAnatomy",
    "ReasoningParser",
    "RenderLimits",
    "TemplateTimeout",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallParser",
    "builtin_family",
    "encode_prompt",
    "opens_reasoning",
    "prompt_add_special_tokens",
    "prompt_anatomy",
    "resolve_template",
    "special_token_texts",
    "template_for_request",
]
