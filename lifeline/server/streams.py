"""Stage 10: the merged outputs of a job as SSE chunks or one JSON body, ending with the
timings of the request."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from lifeline.engine.executor import TokenLogprobs
from lifeline.server.chat_frontend import Delta
from lifeline.server.engine_client import GenerationOutput
from lifeline.server.generation import Cancelled, Choice
from lifeline.server.job import Job, as_api_error
from lifeline.server.responses import sse


class _Stream:
    """Shared by both endpoints: walks the merged outputs, emits chunks, ends with timings."""

    object_name = ""

    def __init__(self, job: Job):
        self.job = job
        self.closed: set[int] = set()
        """Choices whose finish_reason was sent."""
        options = job.body.stream_options
        self.continuous_usage = bool(options and options.include_usage
                                     and options.continuous_usage_stats)
        """vLLM's `stream_options.continuous_usage_stats`: usage so far on every chunk, as vLLM
        adds it only where `include_usage` asks for usage at all."""

    def chunk(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {"id": self.job.response_id, "object": self.object_name,
                "created": self.job.created, "model": self.job.state.model_id,
                "choices": choices, **extra}

    def absorb(self, choice: Choice, out: GenerationOutput) -> dict[str, Any] | None:
        raise NotImplementedError

    def cut_off(self, choice: Choice) -> dict[str, Any]:
        """The last choice entry of a choice that ended without a final output (aborted by a
        shutdown)."""
        raise NotImplementedError

    def opening(self) -> list[dict[str, Any]]:
        return []

    async def events(self) -> AsyncIterator[str]:
        job = self.job
        status = 200
        try:
            for c in self.opening():
                with job.stamps.writing():
                    yield sse(self._with_usage(c))
            tail: list[dict[str, Any]] = []
            async for choice, out in job.generation.outputs():
                item = self.absorb(choice, out)
                if item is None:
                    continue
                if job.generation.finished:
                    tail.append(item)  # the last chunk carries the timings: hold it
                    continue
                with job.stamps.writing():
                    yield sse(self._with_usage(item))
            await job.finish_anatomy()
            for item in self._closing(tail):
                with job.stamps.writing():
                    yield sse(self._with_usage(item))
            with job.stamps.writing():
                yield sse("[DONE]")
        except (asyncio.CancelledError, Cancelled):
            status = 499
            raise
        except Exception as exc:  # noqa: BLE001 - the stream has started: report in-band
            error = as_api_error(exc)
            status = error.status
            yield sse({"error": {"message": error.message, "type": "server_error",
                                 "param": None, "code": error.code}})
        finally:
            job.generation.cancel_nowait()  # no await: this may run inside a cancelled scope
            if not job.accounted:
                if job.stamps.last_byte is None:
                    job.stamps.mark("last_byte")
                job.account(job.record(status))

    def _with_usage(self, item: dict[str, Any]) -> dict[str, Any]:
        if self.continuous_usage and "usage" not in item:
            item["usage"] = self.job.usage()
        return item

    def _closing(self, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
        job = self.job
        job.stamps.mark("last_byte")
        items += [self.chunk([self.cut_off(c)]) for c in job.choices if c.index not in self.closed]
        record = job.record()
        job.account(record)
        if job.body.include_usage:
            items.append(self.chunk([], usage=job.usage(), timings=record.timings()))
        elif items:
            items[-1]["timings"] = record.timings()
        else:
            items.append(self.chunk([], timings=record.timings()))
        return items

    def full_response(self) -> dict[str, Any]:
        raise NotImplementedError


class ChatStream(_Stream):
    object_name = "chat.completion.chunk"

    def __init__(self, job: Job):
        super().__init__(job)
        self.messages: dict[int, dict[str, Any]] = {
            c.index: {"content": [], "reasoning": [], "tool_calls": []} for c in job.choices}
        """Each choice's pieces so far, joined once for a full response."""

    def opening(self) -> list[dict[str, Any]]:
        return [self.chunk([{"index": c.index, "delta": {"role": "assistant", "content": ""},
                             "logprobs": None, "finish_reason": None}])
                for c in self.job.choices]

    def absorb(self, choice: Choice, out: GenerationOutput) -> dict[str, Any] | None:
        parser = choice.state
        was_reasoning = parser.in_reasoning
        delta = parser.feed(out.new_text)
        if was_reasoning or parser.in_reasoning or delta.reasoning:
            self.job.reasoning_tokens += len(out.new_token_ids)  # the tags count as reasoning
        elif self.job.reasoning_tokens:
            self._first_answer(out)
        finish = None
        if out.finished:
            delta = delta + parser.finish()
            finish = "tool_calls" if parser.saw_tool_calls else choice.finish_reason
            choice.finish_reason = finish
            self.closed.add(choice.index)
        self._remember(choice.index, delta)
        body = self._delta_body(delta)
        logprobs = (self.job.state.token_text.chat_logprobs(out.new_logprobs)
                    if choice.params.logprobs is not None else None)
        if not body and finish is None and logprobs is None:
            return None
        return self.chunk([{"index": choice.index, "delta": body, "logprobs": logprobs,
                            "finish_reason": finish}])

    def cut_off(self, choice: Choice) -> dict[str, Any]:
        delta = choice.state.finish()
        self._remember(choice.index, delta)
        self.closed.add(choice.index)
        return {"index": choice.index, "delta": self._delta_body(delta), "logprobs": None,
                "finish_reason": choice.finish_reason or "abort"}

    def _first_answer(self, out: GenerationOutput) -> None:
        """The first token after a reasoning section (of any choice)."""
        at = out.token_time
        if at is None:
            return
        if self.job.first_answer is None or at < self.job.first_answer:
            self.job.first_answer = at

    def _remember(self, index: int, delta: Delta) -> None:
        msg = self.messages[index]
        msg["content"].append(delta.content)
        msg["reasoning"].append(delta.reasoning)
        msg["tool_calls"].extend(delta.tool_calls)

    @staticmethod
    def _delta_body(delta: Delta) -> dict[str, Any]:
        body: dict[str, Any] = {}
        if delta.content:
            body["content"] = delta.content
        if delta.reasoning:
            body["reasoning_content"] = body["reasoning"] = delta.reasoning
        if delta.tool_calls:
            body["tool_calls"] = delta.tool_calls
        return body

    def full_response(self) -> dict[str, Any]:
        choices = []
        token_text = self.job.state.token_text
        for c in self.job.choices:
            if c.index not in self.closed:
                self.cut_off(c)
            msg = self.messages[c.index]
            content, reasoning = "".join(msg["content"]), "".join(msg["reasoning"])
            message: dict[str, Any] = {"role": "assistant", "content": content or None}
            if reasoning:
                message["reasoning_content"] = message["reasoning"] = reasoning
            if msg["tool_calls"]:
                message["tool_calls"] = _collapse_tool_calls(msg["tool_calls"])
            elif message["content"] is None:
                message["content"] = ""
            choices.append({"index": c.index, "message": message,
                            "logprobs": token_text.chat_logprobs(c.logprobs)
                            if c.params.logprobs is not None else None,
                            "finish_reason": c.finish_reason})
        return {"id": self.job.response_id, "object": "chat.completion",
                "created": self.job.created, "model": self.job.state.model_id,
                "choices": choices, "usage": self.job.usage()}


class CompletionStream(_Stream):
    object_name = "text_completion"

    def __init__(self, job: Job):
        super().__init__(job)
        self.offsets = {c.index: 0 for c in job.choices}
        self.echo = bool(job.body.echo)
        self.echoed: dict[int, list[TokenLogprobs | None] | None] = {}
        """Choices whose prompt was echoed, with its logprobs (when asked for)."""
        self.prompt_pieces: dict[int, list[str]] = {}
        """Each echoed prompt, as the text each of its tokens adds, by the identity of its id
        list (which the choices of one prompt share)."""

    def absorb(self, choice: Choice, out: GenerationOutput) -> dict[str, Any] | None:
        text, offset = out.new_text, self.offsets[choice.index]
        logprobs = None
        if choice.params.logprobs is not None:
            logprobs = self.job.state.token_text.completion_logprobs(out.new_logprobs, offset)
        if self.echo and choice.index not in self.echoed:
            self.echoed[choice.index] = out.prompt_logprobs
            prompt = self._prompt_text(choice)
            text = prompt + text
            if logprobs is not None:
                logprobs = _joined(self._prompt_logprobs(choice),
                                   self.job.state.token_text.completion_logprobs(
                                       out.new_logprobs, len(prompt)))
        self.offsets[choice.index] += len(text)
        finish = choice.finish_reason if out.finished else None
        if finish is not None:
            self.closed.add(choice.index)
        if not text and finish is None and logprobs is None:
            return None
        return self.chunk([{"index": choice.index, "text": text, "logprobs": logprobs,
                            "finish_reason": finish}])

    def _prompt_text(self, choice: Choice) -> str:
        """The prompt's ids decoded (`skip_special_tokens` as the request says), a text prompt
        and a token-id one alike, so that the echoed text and its tokens agree."""
        return "".join(self._pieces(choice))

    def _pieces(self, choice: Choice) -> list[str]:
        pieces = self.prompt_pieces.get(id(choice.prompt_ids))
        if pieces is None:
            token_text = self.job.state.token_text
            pieces = token_text.pieces(choice.prompt_ids, self.job.body.skip_special_tokens)
            self.prompt_pieces[id(choice.prompt_ids)] = pieces
        return pieces

    def _prompt_logprobs(self, choice: Choice) -> dict[str, Any]:
        """The echoed prompt's tokens, each as the text it adds at its offset in the echoed
        prompt: the first unscored, the others with their logprobs."""
        items = self.echoed.get(choice.index) or []
        if len(items) != len(choice.prompt_ids) or any(lp is None for lp in items[1:]):
            raise RuntimeError(f"{choice.request_id}: the prompt logprobs are incomplete")
        return self.job.state.token_text.completion_logprobs(
            items[1:], 0, unscored=choice.prompt_ids[0], texts=self._pieces(choice))

    def cut_off(self, choice: Choice) -> dict[str, Any]:
        self.closed.add(choice.index)
        return {"index": choice.index, "text": "", "logprobs": None,
                "finish_reason": choice.finish_reason or "abort"}

    def full_response(self) -> dict[str, Any]:
        choices = [self._full_choice(c) for c in self.job.choices]
        return {"id": self.job.response_id, "object": "text_completion",
                "created": self.job.created, "model": self.job.state.model_id,
                "choices": choices, "usage": self.job.usage()}

    def _full_choice(self, c: Choice) -> dict[str, Any]:
        token_text = self.job.state.token_text
        echoed = self.echo and c.index in self.echoed
        prompt = self._prompt_text(c) if echoed else ""
        logprobs = None
        if c.params.logprobs is not None:
            logprobs = token_text.completion_logprobs(c.logprobs, len(prompt))
            if echoed:
                logprobs = _joined(self._prompt_logprobs(c), logprobs)
        return {"index": c.index, "text": prompt + c.text, "logprobs": logprobs,
                "finish_reason": c.finish_reason}


def _joined(first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
    """Two legacy logprobs objects as one, in order."""
    return {key: first[key] + second[key] for key in first}


def _collapse_tool_calls(deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Streamed tool-call deltas (by index, arguments in pieces) to whole tool calls."""
    calls: dict[int, dict[str, Any]] = {}
    for d in deltas:
        call = calls.setdefault(d.get("index", len(calls)), {
            "id": d.get("id"), "type": "function", "function": {"name": "", "arguments": ""}})
        call["id"] = call["id"] or d.get("id")
        fn = d.get("function") or {}
        call["function"]["name"] += fn.get("name") or ""
        call["function"]["arguments"] += fn.get("arguments") or ""
    return [calls[i] for i in sorted(calls)]
