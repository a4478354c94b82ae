"""The offline API, shaped like vLLM's: `LLM(model).generate(prompts, SamplingParams(...))`."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lifeline.engine.engine import EngineConfig, LLMEngine
from lifeline.engine.parallel_sampling import child_params
from lifeline.engine.request import Request, Timeline
from lifeline.engine.executor import TokenLogprobs
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
    """`LLM()` serves the default model (Gemma 3 270M); `LLM(path)` a GGUF file or HF directory.
    `LLM(device="cuda")` runs it on a GPU, in bfloat16 (`EngineConfig`)."""

    def __init__(self, model: str | Path | LoadedModel | None = None, *,
                 dummy_weights: bool = False, **engine_kwargs: Any):
        if isinstance(model, LoadedModel):
            self.loaded = model
        else:
            self.loaded = load_model(model, dummy=dummy_weights,
                                     device=engine_kwargs.get("device"))
        self.engine = LLMEngine(self.loaded, EngineConfig(**engine_kwargs))
        self.tokenizer = self.loaded.tokenizer

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_progress: bool | None = None) -> list[GenerationResult]:
        """One result per prompt and sample: with `n` > 1, sample i of prompt p is result
        p * n + i. A prompt's first sample runs alone until it has its first token; then the
        others start and find the prompt's blocks in the prefix cache, as on the server."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        params = _per_prompt(sampling_params, len(prompts))
        groups = [[_Sample(_prompt_input(p), child_params(sp, i), _cache_salt(p),
                           tuple(p.get("images", ())) if isinstance(p, dict) else ())
                   for i in range(sp.n)] for p, sp in zip(prompts, params)]
        samples = [s for group in groups for s in group]
        try:
            held = {self._add(group[0]).request_id: group[1:] for group in groups}
            texts = self._run(held, len(samples), use_progress if use_progress is not None
                              else len(samples) > 1)
        except BaseException:
            for sample in samples:
                if sample.request is not None:
                    self.engine.abort_request(sample.request.request_id)
            raise
        return [_result(s.request, texts.get(s.request.request_id, "")) for s in samples]

    def prompt_logits(self, token_ids: list[int], images=()):
        """Logits at every position of `token_ids` (a float32 tensor `[T, vocab]`); `images`:
        the prompt's `ImageSpan`s (lifeline.media.inputs)."""
        return self.engine.prompt_logits(token_ids, images)

    def _add(self, sample: _Sample) -> Request:
        sample.request = self.engine.add_request(sample.prompt, sample.params,
                                                 cache_salt=sample.cache_salt,
                                                 images=sample.images)
        return sample.request

    def _run(self, held: dict[str, list[_Sample]], total: int, show: bool) -> dict[str, str]:
        """Step until every request has finished, starting the samples `held` behind a
        request once it has an output."""
        texts: dict[str, str] = {}
        progress = _progress(show)
        with progress:
            task = progress.add_task("generating", total=total)
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    for sample in held.pop(out.request_id, ()):
                        self._add(sample)
                    if out.finished:
                        texts[out.request_id] = out.text
                        progress.advance(task)
        return texts


@dataclass(slots=True, eq=False)
class _Sample:
    prompt: str | list[int]
    params: SamplingParams
    cache_salt: str | None
    images: tuple = ()
    request: Request | None = None


def _result(req: Request, text: str) -> GenerationResult:
    return GenerationResult(req.request_id, req.prompt, req.prompt_token_ids, text,
                            list(req.output_token_ids),
                            req.finish_reason.value if req.finish_reason else None,
                            req.stop_reason, req.timeline, req.num_cached_tokens,
                            req.num_preemptions, list(req.logprobs))


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
