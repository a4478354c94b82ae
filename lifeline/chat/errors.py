"""Errors of message assembly: each names the request field (`param`) that caused it."""
from __future__ import annotations


class ChatError(ValueError):
    """A request the chat template cannot turn into a prompt (an HTTP 400).

    `param` names the request field at fault, as OpenAI's error object does."""

    def __init__(self, message: str, *, param: str = "messages"):
        super().__init__(message)
        self.param = param


class TemplateTimeout(ChatError):
    """The template exceeded its render budget (time, operations, output or range size)."""

    def __init__(self, message: str, *, param: str = "chat_template"):
        super().__init__(message, param=param)
