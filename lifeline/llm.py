"""The offline API, shaped like vLLM's: `LLM(model).generate(prompts, SamplingParams(...))`."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lifeline.engine.engine import EngineConfig, LLMEngine
from lifeline.engine.request import Timeline
from lifeline.engine.sampler import TokenLogprobs
from lifeline.engine.sampling_params import SamplingParams
from lifeline.model.loader import LoadedModel, load_model

PromptType = str | dict[str, Any]


@dataclass(slots=True)
class GenerationResult:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | str | None
    timeline: Timeline
    num_cached_tokens: int
    num_preemptions: int
    logprobs: list[TokenLogprobs] = field(default_factory=list)


class LLM:
    """`LLM()` serves the default model (Gemma 3 270M); `LLM(path)` a GGUF file or HF directory."""

    def __init__(self, model: str | Path | LoadedModel | None = None, *,
                 dummy_weights: bool = False, **engine_kwargs: Any):
        if isinstance(model, LoadedModel):
            self.loaded = model
        else:
            self.loaded = load_model(model, dummy=dummy_weights)
        self.engine = LLMEngine(self.loaded, EngineConfig(**engine_kwargs))
        self.tokenizer = self.loaded.tokenizer

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_progress: bool | None = None) -> list[GenerationResult]:
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        params = _per_prompt(sampling_params, len(prompts))
        reqs = []
        try:
            for p, sp in zip(prompts, params):
                reqs.append(self.engine.add_request(_prompt_input(p), sp,
                                                    cache_salt=_cache_salt(p)))
        except Exception:
            for r in reqs:
                self.engine.abort_request(r.request_id)
            raise
        texts = self._run(len(reqs), use_progress if use_progress is not None else len(reqs) > 1)
        return [GenerationResult(r.request_id, r.prompt, r.prompt_token_ids, texts[r.request_id],
                                 list(r.output_token_ids), r.finish_reason.value if r.finish_reason
                                 else None, r.stop_reason, r.timeline, r.num_cached_tokens,
                                 r.num_preemptions, list(r.logprobs)) for r in reqs]

    def prompt_logits(self, token_ids: list[int]):
        """Logits at every position of `token_ids` (a float32 tensor `[T, vocab]`)."""
        return self.engine.prompt_logits(token_ids)

    def _run(self, total: int, show: bool) -> dict[str, str]:
        texts: dict[str, str] = {}
        progress = _progress(show)
        with progress:
            task = progress.add_task("generating", total=total)
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        texts[out.request_id] = out.text
                        progress.advance(task)
        return texts


def _per_prompt(sp: SamplingParams | Sequence[SamplingParams] | None, n: int
                ) -> list[SamplingParams]:
    if sp is None:
        return [SamplingParams() for _ in range(n)]
    if isinstance(sp, SamplingParams):
        return [sp] * n
    if len(sp) != n:
        raise ValueError(f"{len(sp)} sampling params for {n} prompts")
    return list(sp)


def _prompt_input(prompt: PromptType) -> str | list[int]:
    if isinstance(prompt, str):
        return prompt
    if "prompt_token_ids" in prompt:
        return list(prompt["prompt_token_ids"])
    if "prompt" in prompt:
        return prompt["prompt"]
    raise ValueError("a prompt dict needs 'prompt_token_ids' or 'prompt'")


def _cache_salt(prompt: PromptType) -> str | None:
    """vLLM's `{"prompt": ..., "cache_salt": ...}`: only equal salts share prefix-cache blocks."""
    salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise ValueError("cache_salt must be a non-empty string")
    return salt


def _progress(show: bool):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), disable=not show, transient=True)
