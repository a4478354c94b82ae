"""Stages 4 to 9 seen from the server: one HTTP request becomes one or more engine requests
(`n` choices, several prompts) whose outputs arrive merged, in the order the engine made them."""
from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from lifeline.engine.request import Timeline
from lifeline.engine.executor import TokenLogprobs
from lifeline.engine.sampling_params import SamplingParams
from lifeline.server.engine_client import EngineClient, GenerationOutput
from lifeline.server.gateway import Admission


@dataclass(slots=True, eq=False)
class Choice:
    """One engine request and what it has produced so far."""
    index: int
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    parts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    token_times: list[float] = field(default_factory=list)
    cached_tokens: int = 0
    snapshot: Timeline | None = None
    """The engine's timeline as of the latest output that carried one."""
    started: bool = False
    state: object = None
    """Per-choice parser state the endpoint keeps (reasoning, tool calls)."""
    cache_salt: str | None = None
    parent: str | None = None
    """The id of the response this choice belongs to."""
    images: tuple = ()
    """The prompt's images (lifeline.media.inputs.ImageSpan)."""

    @property
    def text(self) -> str:
        return "".join(self.parts)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def timeline(self) -> Timeline:
        """The timeline so far: the latest copy, with the token times of the outputs since."""
        snapshot = self.snapshot
        if snapshot is None:
            return Timeline()
        if len(snapshot.token_times) == len(self.token_times):
            return snapshot
        return dataclasses.replace(snapshot, token_times=list(self.token_times))

    def absorb(self, out: GenerationOutput) -> None:
        self.token_ids.extend(out.new_token_ids)
        self.logprobs.extend(out.new_logprobs)
        self.parts.append(out.new_text)
        if out.token_time is not None:
            self.token_times.append(out.token_time)
        if out.timeline is not None:
            self.snapshot = out.timeline
        self.cached_tokens = out.num_cached_tokens
        if out.finished:
            self.finish_reason = out.finish_reason or "stop"


class Cancelled(Exception):
    """The generation was cancelled (the client went away)."""


class Generation:
    """Runs every choice as its own task; `outputs()` yields (choice, output) as they come.
    Leaving the iteration early (client gone, error) cancels the tasks, which aborts the
    engine requests and frees their KV blocks.

    Choices that share a prompt (`n` > 1) start in two waves: the first choice alone, the others
    once it has its first token. By then its prompt blocks are in the prefix cache, so the
    others compute only what follows the last full block instead of the whole prompt again."""

    def __init__(self, client: EngineClient, admission: Admission, choices: list[Choice],
                 arrival: float, registry: set[Generation] | None = None, *,
                 deadline: float | None = None, fault: str | None = None):
        self.client = client
        self.admission = admission
        self.choices = choices
        self.arrival = arrival
        self.deadline = deadline
        """Engine-clock time by which every choice must end (`--request-timeout`)."""
        self.fault = fault
        self.registry = registry if registry is not None else set()
        """The server's running generations, for a shutdown to abort."""
        self.aborted = False
        self._queue: asyncio.Queue = asyncio.Queue()
        self._tasks: list[asyncio.Task] = []
        self._held: dict[int, list[Choice]] = {}
        """Choices waiting for the first choice of their prompt (by its index)."""

    def start(self) -> None:
        """Admit every choice (503 when the waiting queue is full) and hand them to the engine."""
        self.admission.enter(len(self.choices), "n")
        leaders: dict[int, Choice] = {}  # by the identity of the prompt's id list
        for choice in self.choices:
            leader = leaders.setdefault(id(choice.prompt_ids), choice)
            if leader is not choice:
                self._held.setdefault(leader.index, []).append(choice)
        for leader in leaders.values():
            self._launch(leader)
        self.registry.add(self)

    def _launch(self, choice: Choice) -> None:
        self._tasks.append(asyncio.create_task(self._pump(choice)))

    def _release_followers(self, leader: Choice) -> None:
        for choice in self._held.pop(leader.index, []):
            self._launch(choice)

    @property
    def finished(self) -> bool:
        return all(c.finished for c in self.choices)

    async def outputs(self) -> AsyncIterator[tuple[Choice, GenerationOutput]]:
        remaining = len(self.choices)
        try:
            while remaining:
                item = await self._queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            self.registry.discard(self)
            self.cancel_nowait()

    def abort(self) -> None:
        """End every unfinished choice now with finish_reason 'abort' (the server is shutting
        down); unlike `cancel`, `outputs()` then ends normally, so the answer is complete."""
        self.aborted = True
        for held in self._held.values():
            for choice in held:
                choice.finish_reason = "abort"
                self._queue.put_nowait(None)
        self.cancel_nowait()

    def cancel_nowait(self) -> list[asyncio.Task]:
        """Cancel every choice still running (usable where awaiting is not, e.g. in a stream
        that is itself being cancelled); each one aborts its engine request."""
        for held in self._held.values():
            for _ in held:
                self.admission.started()
                self.admission.left()
        self._held.clear()
        pending = [t for t in self._tasks if not t.done()]
        for task in pending:
            task.cancel()
        return pending

    async def cancel(self) -> None:
        pending = self.cancel_nowait()
        if pending:
            await asyncio.wait(pending, timeout=5)

    async def _pump(self, choice: Choice) -> None:
        try:
            async for out in self.client.generate(
                    choice.prompt_ids, choice.params, choice.request_id, arrival=self.arrival,
                    cache_salt=choice.cache_salt, deadline=self.deadline, fault=self.fault,
                    client_id=choice.parent,
                    choice_index=choice.index if len(self.choices) > 1 else None,
                    images=choice.images):
                if not choice.started:
                    choice.started = True
                    self.admission.started()
                    self._release_followers(choice)
                choice.absorb(out)
                self._queue.put_nowait((choice, out))
            self._queue.put_nowait(None)
        except asyncio.CancelledError:
            if self.aborted:
                choice.finish_reason = choice.finish_reason or "abort"
                self._queue.put_nowait(None)
            else:
                self._queue.put_nowait(Cancelled(f"{choice.request_id} was cancelled"))
            raise
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            timeline = getattr(exc, "timeline", None)
            if timeline is not None:  # the engine's last word on the request, for its record
                choice.snapshot = timeline
            self._queue.put_nowait(exc)
            self._release_followers(choice)  # they fail or finish on their own
        finally:
            if not choice.started:
                self.admission.started()
            self.admission.left()
