"""One HTTP generation request on its way through the server: its prompts, its choices, its
stamps, and the record it leaves."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from starlette.concurrency import run_in_threadpool

from lifeline.observe import RequestRecord, ServerStamps, combine_timelines
from lifeline.server.chat_frontend import RenderedPrompt
from lifeline.server.errors import APIError, internal_error, refused
from lifeline.server.generation import Cancelled, Choice, Generation
from lifeline.server.protocol import ChatCompletionRequest
from lifeline.server.responses import usage
from lifeline.server.state import ServerState


@dataclass(slots=True, eq=False)
class Job:
    state: ServerState
    stamps: ServerStamps
    key: str
    endpoint: str
    body: Any
    response_id: str
    prompts: list[list[int]] = field(default_factory=list)
    rendered: RenderedPrompt | None = None
    images: tuple = ()
    """The chat prompt's images (lifeline.media.inputs.ImageSpan), shared by its choices."""
    anatomy: dict[str, int] | None = None
    anatomy_task: asyncio.Future | None = None
    choices: list[Choice] = field(default_factory=list)
    generation: Generation | None = None
    reasoning_tokens: int = 0
    first_answer: float | None = None
    accounted: bool = False
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def is_chat(self) -> bool:
        return isinstance(self.body, ChatCompletionRequest)

    def record(self, status: int = 200) -> RequestRecord:
        timeline = combine_timelines([c.timeline for c in self.choices])
        finish = [c.finish_reason for c in self.choices]
        return RequestRecord.build(
            self.stamps, timeline, request_id=self.response_id, model=self.state.model_id,
            endpoint=self.endpoint, prompt_tokens=self.prompt_tokens,
            cached_tokens=self.cached_tokens, completion_tokens=self.completion_tokens,
            reasoning_tokens=self.reasoning_tokens, first_answer_token_time=self.first_answer,
            finish_reason=finish[0] if finish and finish[0] else "abort",
            anatomy=self.anatomy, status=status, images=self.images)

    def start_anatomy(self) -> None:
        """Prompt anatomy renders the template twice more: it runs beside the generation."""
        if self.rendered is not None:
            self.anatomy_task = asyncio.ensure_future(run_in_threadpool(
                self.state.chat.anatomy, self.rendered, self.prompts[0]))

    async def finish_anatomy(self) -> None:
        if self.anatomy_task is None:
            return
        try:
            self.anatomy = await asyncio.wait_for(self.anatomy_task, 30)
        except Exception:  # noqa: BLE001 - the anatomy is a report; the answer stands
            self.anatomy = None

    def account(self, record: RequestRecord) -> None:
        if not self.accounted:
            self.accounted = True
            self.state.account(record)
            self.state.limiter.charge_tokens(self.key, self.completion_tokens)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def completion_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.choices)

    @property
    def cached_tokens(self) -> int:
        n = self.body.n
        return sum(self.choices[i * n].cached_tokens for i in range(len(self.prompts))
                   if i * n < len(self.choices))

    def usage(self) -> dict[str, Any]:
        return usage(self.prompt_tokens, self.completion_tokens, self.cached_tokens,
                     self.reasoning_tokens)


def as_api_error(exc: BaseException) -> APIError:
    """The error a client sees: ours as they are, the engine's refusals (ValueError, worded by
    `lifeline.engine.validation` or `LLMEngine.add_request`) as 400, anything else as a 500
    that names only an error id."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, Cancelled):
        return APIError(499, "the client closed the request", None, "client_closed")
    if isinstance(exc, ValueError):
        return refused(exc)
    return internal_error(exc, "generation")
