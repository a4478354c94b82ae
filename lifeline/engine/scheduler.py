"""Continuous batching as in vLLM V1: one token budget per step, running requests first.

There is no prefill phase and no decode phase: each request has `num_computed_tokens`, and a step
gives it as many of its remaining tokens as the budget allows (prefill chunks and decodes share a
step). Pure Python, no torch and no clock: the caller passes `now`, so the planner can drive it
with virtual time.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field

from lifeline.engine.block_manager import BlockManager, KVCacheBlocks, KVCacheManager
from lifeline.engine.request import FinishReason, Request, RequestStatus


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    """Most requests running at once."""
    max_num_batched_tokens: int = 512
    """Token budget of one step (prefill chunk tokens plus one per decode)."""
    max_model_len: int = 32768
    whole_images: bool = False
    """Never end a prefill chunk inside an image's tokens: a model whose image tokens attend
    to each other both ways (Gemma 3) must compute an image in one chunk, over the token
    budget where the budget left is smaller than the image."""

    max_num_encoder_tokens: int | None = None
    """Image tokens a step may encode (vLLM's encoder budget; None: `max_num_batched_tokens`).
    A chunk that would need more is cut before the first image over it; an image larger than
    the budget is encoded in a step that encodes nothing else."""
    encoder_cache_tokens: int = 1 << 20
    """Image tokens the scheduler counts as encoded (the encoder cache's size in rows)."""

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    start: int
    """Position of the first token this step computes."""
    samples: bool
    """Whether this step completes every known token, so the next token is sampled."""
    blocks: KVCacheBlocks
    """The request's block table in each cache group."""


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    limit: str | None = None
    """What kept waiting requests out of this step: 'max_num_seqs' (the batch was full),
    'kv_cache' (the head's blocks did not fit, or running requests were preempted),
    'token_budget' (the step's tokens were spent) or 'encoder_budget' (its image tokens
    were); None when nothing waited or all fit."""
    encoder_tokens: int = 0
    """Image tokens this step encodes (images its chunks reach that are not yet encoded)."""
    encoding: set[str] = field(default_factory=set)
    """Their keys (`Request.image_key`)."""

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager | KVCacheManager):
        self.config = config
        self.kv = block_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.encoded: OrderedDict[str, int] = OrderedDict()
        """Images counted as encoded (`Request.image_key` → tokens), least recently used
        first: the executor's encoder cache as the budget sees it (an image it evicted sooner
        is encoded again, correctly, just off the budget)."""
        self.encoder_budget = config.max_num_encoder_tokens or config.max_num_batched_tokens

    def add_request(self, req: Request) -> None:
        capacity = self.kv.capacity_tokens()
        if req.num_prompt_tokens + 1 > capacity:
            raise ValueError(
                f"prompt of {req.num_prompt_tokens} tokens needs more KV blocks than the cache "
                f"has ({self.kv.num_blocks} blocks of {self.kv.block_size} tokens)")
        req.status = RequestStatus.WAITING
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, now: float) -> SchedulerOutput:
        out = SchedulerOutput()
        if self.waiting and self.waiting[0].suspect and self._schedule_alone(out, now):
            return out
        budget = self.config.max_num_batched_tokens
        budget = self._schedule_running(out, budget, now)
        if out.preempted:
            out.limit = "kv_cache"
        else:
            out.limit = self._schedule_waiting(out, budget, now)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int, now: float) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            if req.images:
                num_new = self._image_chunk(req, req.num_computed_tokens, num_new, budget, out)
                if not num_new:
                    i += 1
                    continue
            while not self.kv.allocate(req, num_new):
                victim = self.running[-1]
                self._preempt(victim, now)
                out.preempted.append(victim)
                if victim is req:
                    return budget
            out.scheduled.append(self._scheduled(req, num_new))
            budget -= num_new
            i += 1
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int, now: float) -> str | None:
        """Admit from the head of the queue while it fits; the limit that stopped it."""
        while self.waiting:
            if len(self.running) >= self.config.max_num_seqs:
                return "max_num_seqs"
            if budget <= 0:
                return "token_budget"
            if self.waiting[0].suspect:
                return None  # it runs alone, in a step of its own
            num_new = self._admit_head(out, budget, now)
            if num_new < 0:
                return "encoder_budget"
            if not num_new:
                return "kv_cache"
            budget -= num_new
        return None

    def _admit_head(self, out: SchedulerOutput, budget: int, now: float) -> int:
        """Move the head of the queue to running with up to `budget` tokens this step; the
        tokens scheduled, 0 when its blocks do not fit, -1 when the step's encoder budget
        cannot take its first image."""
        req = self.waiting[0]
        fresh = req.num_computed_tokens == 0 and not req.want_prompt_logits
        prefix = self.kv.find_cached_prefix(req) if fresh else []
        cached = len(prefix) * self.kv.block_size
        num_new = min(req.num_tokens - cached, budget)
        if req.images:
            num_new = self._image_chunk(req, cached, num_new, budget, out)
            if not num_new:
                return -1
        if not self.kv.allocate(req, num_new, prefix):
            return 0
        self.waiting.popleft()
        req.num_computed_tokens = cached
        if req.timeline.first_scheduled is None:
            req.timeline.first_scheduled = now
            req.num_cached_tokens = cached
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        out.scheduled.append(self._scheduled(req, num_new))
        return num_new

    def _image_chunk(self, req: Request, start: int, num_new: int, budget: int,
                     out: SchedulerOutput) -> int:
        """The chunk of a request with images: whole images where the model needs them, and
        within the step's encoder budget (0: not this step)."""
        if self.config.whole_images:
            num_new = self._whole_images(req, start, num_new, budget)
        end = start + num_new
        for img in req.images:
            if img.end <= start or img.offset >= end:
                continue
            key = req.image_key(img)
            if key in self.encoded or key in out.encoding:
                continue
            if out.encoder_tokens and out.encoder_tokens + img.num_embeds > self.encoder_budget:
                return max(img.offset - start, 0)
            out.encoder_tokens += img.num_embeds
            out.encoding.add(key)
        return num_new

    def _remember_images(self, req: Request, start: int, end: int) -> None:
        for img in req.images:
            if img.end <= start or img.offset >= end:
                continue
            key = req.image_key(img)
            self.encoded[key] = img.num_embeds
            self.encoded.move_to_end(key)
        total = sum(self.encoded.values())
        while total > self.config.encoder_cache_tokens and len(self.encoded) > 1:
            total -= self.encoded.popitem(last=False)[1]

    def _whole_images(self, req: Request, start: int, num_new: int, budget: int) -> int:
        """`num_new` cut back to the start of an image the chunk would end inside; a chunk
        that starts at (or inside) such an image takes all of it, over the budget if need be
        (by less than one image's tokens: no image waits for a budget it cannot get)."""
        end = start + num_new
        for img in req.images:
            if img.offset < end < img.end and start < img.end:
                return img.offset - start if img.offset > start else img.end - start
        return num_new

    def _schedule_alone(self, out: SchedulerOutput, now: float) -> bool:
        """A step of the suspect at the head of the queue and nothing else (the running
        requests wait one step). False when it does not fit now: the others run meanwhile."""
        if len(self.running) >= self.config.max_num_seqs:
            return False
        return self._admit_head(out, self.config.max_num_batched_tokens, now) > 0

    def isolate(self, reqs: list[Request], now: float) -> None:
        """The requests of a step that raised go back to the head of the queue, in order, to be
        recomputed each in a step of its own: one that raises again fails alone."""
        for req in reversed(reqs):
            if req in self.running:
                self._preempt(req, now)
            req.suspect = True

    def _scheduled(self, req: Request, num_new: int) -> ScheduledRequest:
        start = req.num_computed_tokens
        if req.images:
            self._remember_images(req, start, start + num_new)
        return ScheduledRequest(req, num_new, start, start + num_new == req.num_tokens,
                                self.kv.get_blocks(req))

    def _preempt(self, req: Request, now: float) -> None:
        self.running.remove(req)
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        req.timeline.preemptions.append(now)
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def update(self, out: SchedulerOutput, sampled: dict[int, int] | None = None) -> list[Request]:
        """Advance computed counts, append sampled tokens (keyed by `id(request)`), finish
        requests that hit EOS, a stop token or their length. Returns the finished ones."""
        finished = []
        for s in out.scheduled:
            req = s.request
            if req.suspect:  # it ran alone and did not raise: not the culprit
                req.suspect, req.num_step_failures = False, 0
            req.num_computed_tokens += s.num_new_tokens
            self.kv.commit(req)
            if not s.samples or sampled is None:
                continue
            req.output_token_ids.append(sampled[id(req)])
            reason = self.check_stop(req)
            if reason is not None:
                self.finish(req, reason)
                finished.append(req)
        return finished

    def check_stop(self, req: Request) -> FinishReason | None:
        params = req.params
        token = req.output_token_ids[-1]
        n = req.num_output_tokens
        if n >= params.min_tokens:
            if not params.ignore_eos and token in req.eos_token_ids:
                req.stop_reason = None
                return FinishReason.STOP
            if token in req.sampling_plan.stop_token_ids:
                req.stop_reason = token
                return FinishReason.STOP
        if params.max_tokens is not None and n >= params.max_tokens:
            return FinishReason.LENGTH
        if req.num_tokens >= self.config.max_model_len:
            return FinishReason.LENGTH
        return None

    def finish(self, req: Request, reason: FinishReason) -> None:
        if req.status is RequestStatus.FINISHED:
            return
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.free(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
