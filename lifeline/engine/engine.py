"""The engine loop, one step at a time: schedule, execute (`Executor`), update the scheduler,
then detokenize and check stop strings. Imports no torch: the model executor (the default) is
imported when the engine builds it."""
from __future__ import annotations

import heapq
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from lifeline.engine.executor import Executor, ExecutorFactory, ModelOutput, TokenLogprobs
from lifeline.engine.kv_layout import KVLayout, plan_kv
from lifeline.engine.request import FinishReason, Request, RequestError, RequestStatus
from lifeline.engine.sampling_params import SamplingParams
from lifeline.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from lifeline.engine.background_compile import BackgroundCompile
from lifeline.engine.startup import Startup, count_compiles
from lifeline.engine.step_log import StepLog, StepRecorder
from lifeline.engine.stop import StopChecker
from lifeline.engine.validation import ModelLimits, check_request
from lifeline.tokenizer import IncrementalDetokenizer

if TYPE_CHECKING:
    import torch

    from lifeline.engine.moe_usage import MoEAccounting
    from lifeline.engine.threads import ThreadGovernor
    from collections.abc import Sequence

    from lifeline.media.inputs import ImageSpan
    from lifeline.model.loader import LoadedModel

log = logging.getLogger("lifeline.engine")
KV_CACHE_DTYPES = {"auto": "auto", "fp32": "fp32", "float32": "fp32", "bf16": "bf16",
                   "bfloat16": "bf16", "fp16": "fp16", "float16": "fp16", "f16": "fp16"}
"""The KV cache formats by the names vLLM and llama.cpp give them, and the one each means."""
GPU_WEIGHTS = ("bf16", "fp32")
"""Weight formats on a GPU: the whole model in that dtype (the int8 formats are fbgemm's)."""
MAX_STEP_FAILURES = 3
"""A request in this many steps that raised, with no step of it alone succeeding in between,
fails even if it never raised alone."""


class InjectedFault(RuntimeError):
    """Raised inside a step that runs a request carrying `fault='step'` (tests, soak)."""


@dataclass(slots=True)
class EngineConfig:
    block_size: int = 16
    kv_cache_memory_bytes: int | None = None
    """Memory for the KV pools; None: sized by need, for the served context length
    (`max_model_len`, else the model's) shared by the running requests, sliding-window layers
    holding only their windows (lifeline.engine.kv_layout). The pools hold memory only where
    they are written."""
    num_kv_blocks: int | None = None
    """Overrides `kv_cache_memory_bytes` when set."""
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    sliding_window_kv: bool = True
    """Sliding-window layers give back the blocks their window left behind (hybrid models
    get a second block table and pool); False keeps every block for every layer."""
    kv_cache_dtype: str = "auto"
    """The KV pools' format: 'auto' (the activations': float32 on the CPU, bfloat16 for a
    bf16 model on a GPU), 'fp32', 'bf16' or 'fp16' (llama.cpp's default; half the bytes of
    float32, keys and values rounded once as they are written; docs/performance.md measures
    what that does to agreement)."""
    kv_dtype_bytes: float | None = None
    """Bytes of one cached K or V element; None: those of `kv_cache_dtype`. The planner sizes
    the cache of the format it prices (2 for bf16, 1 for fp8, per device under TP)."""
    num_threads: int | None = None
    adaptive_threads: bool = False
    """On the CPU: run each step with the cores the machine's other processes leave free (at
    least one, at most `num_threads`), read from /proc every quarter second
    (lifeline.engine.threads): a parallel kernel whose second thread shares a core with another
    process waits for it at every call. The command line's `serve` defaults to it."""
    device: str = "cpu"
    """Where weights, KV cache, attention and greedy sampling run ('cpu', 'cuda', 'cuda:N');
    scheduling, detokenizing and stop checks stay on the host."""
    weights: str | None = None
    """On the CPU: 'fp32' (as loaded, the exact reference path), 'bf16' or 'int8' (the LM
    head), 'int8-all' (the head and every layer projection), 'gguf' (every layer from a GGUF
    file's own blocks) or 'gguf-int8' (a lone row from the blocks, batches in int8); see
    model/weight_format.py; the command line defaults to gguf-int8. On a GPU: 'bf16' (every
    weight and the KV cache in bfloat16) or 'fp32'. None: the device's default, 'fp32' on the CPU and 'bf16' on a GPU.
    Applied to the loaded model in place."""

    compile: bool = False
    """Run the model's forward through `torch.compile` (CPU, dense families; others stay
    eager): fused small kernels and a faster decode (docs/performance.md), a compile at the
    start (`LLMEngine.warmup`). The command line's `serve` defaults to it."""
    compile_in_background: bool = False
    """With `compile`, where the on-disk cache has no graphs for this model yet: serve eagerly
    from the start while a child process compiles them, and run compiled from the step after
    they load (lifeline.engine.background_compile); False: compile before the engine is
    ready. The command line's `serve` defaults to it."""

    max_num_encoder_tokens: int | None = None
    """Image tokens one step may encode (vLLM's encoder budget); None: the token budget."""
    encoder_cache_mib: int = 512
    """Image embeddings the encoder cache keeps (a vision-language model), by image hash."""
    step_log_size: int = 4096
    """Steps the step log keeps (`LLMEngine.step_log`, the server's `/debug/steps`); 0 keeps
    none. Each request's own share of its steps is recorded either way."""

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError("block_size must be positive")
        if self.step_log_size < 0:
            raise ValueError("step_log_size must be non-negative")
        kind = self.device.partition(":")[0]
        if kind not in ("cpu", "cuda"):
            raise ValueError(f"device {self.device!r}: Lifeline runs on 'cpu' or 'cuda'")
        on_gpu = kind == "cuda"
        if self.weights is None:
            self.weights = "bf16" if on_gpu else "fp32"
        if on_gpu and self.weights not in GPU_WEIGHTS:
            raise ValueError(f"weights {self.weights!r} run on the CPU only (fbgemm's int8); "
                             f"on a GPU: {', '.join(GPU_WEIGHTS)}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype {self.kv_cache_dtype!r}: choose from "
                             f"{', '.join(KV_CACHE_DTYPES)}")
        self.kv_cache_dtype = KV_CACHE_DTYPES[self.kv_cache_dtype]
        if self.kv_dtype_bytes is None:
            kv = self.kv_cache_dtype
            self.kv_dtype_bytes = (4 if kv == "fp32" else 2 if kv in ("bf16", "fp16") else
                                   2 if on_gpu and self.weights == "bf16" else 4)

    def kv_torch_dtype(self, activations: torch.dtype) -> torch.dtype:
        """The KV pools' torch dtype for a model whose activations are `activations`."""
        import torch

        return {"fp32": torch.float32, "bf16": torch.bfloat16,
                "fp16": torch.float16}.get(self.kv_cache_dtype, activations)


@dataclass(slots=True)
class RequestOutput:
    """What one step produced for one request (deltas) plus its state so far."""
    request_id: str
    new_token_ids: list[int]
    new_text: str
    text: str
    """All output text, on the last output ('' before it)."""
    finished: bool
    request: Request
    new_logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    """On the first output of a request with `params.prompt_logprobs`: one entry per prompt
    token, None for the first (nothing predicts it)."""

    @property
    def error(self) -> RequestError | None:
        """Set when the engine ended the request without an answer."""
        return self.request.error

    @property
    def finish_reason(self) -> str | None:
        r = self.request.finish_reason
        return r.value if r else None


@dataclass(slots=True)
class StepErrors:
    """Steps that raised: each failed the requests it ran; the engine went on."""
    count: int = 0
    requests_failed: int = 0
    last_error: str | None = None
    """The exception type of the last failure (its traceback went to the log)."""
    last_time: float | None = None
    """Wall-clock time (`time.time()`) of the last failure."""


@dataclass(slots=True)
class _OutputState:
    detokenizer: IncrementalDetokenizer | None
    stop: StopChecker
    parts: list[str] = field(default_factory=list)
    """The emitted deltas (joined once, at the end: `+=` on an attribute copies every time)."""
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    """Filled position by position during prefill; handed out (and dropped) with the first
    output."""


class LLMEngine:
    """`loaded`: the model (its config and tokenizer; a `LoadedModel` for the default
    executor). `executor`: builds the executor from the KV layout; by default the model
    executor over `loaded`'s weights."""

    def __init__(self, loaded: LoadedModel, config: EngineConfig | None = None,
                 executor: ExecutorFactory | None = None):
        self.config = config = config or EngineConfig()
        self.model_config = mcfg = loaded.config
        self.tokenizer = loaded.tokenizer
        self.loaded = loaded
        self.kv_layout = layout = plan_kv(
            mcfg, config.block_size, memory_bytes=config.kv_cache_memory_bytes,
            num_blocks=config.num_kv_blocks, max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            dtype_bytes=config.kv_dtype_bytes, sliding_window_kv=config.sliding_window_kv,
            context_tokens=min(config.max_model_len or mcfg.max_position, mcfg.max_position))
        self.block_manager = layout.manager(config.enable_prefix_caching,
                                            config.max_num_batched_tokens)
        max_len = self._clamp_model_len(config.max_model_len, mcfg.max_position)
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens, max_len,
                            whole_images=bool(mcfg.vision and mcfg.vision.bidirectional),
                            max_num_encoder_tokens=config.max_num_encoder_tokens,
                            encoder_cache_tokens=(config.encoder_cache_mib << 20)
                            // (4 * mcfg.hidden_size)),
            self.block_manager)
        self.executor: Executor = (executor or self._model_executor)(layout)
        self.recorder = StepRecorder(layout, config.max_num_seqs, config.max_num_batched_tokens,
                                     config.step_log_size)
        self.moe: MoEAccounting | None = None
        """Routing accounting of an MoE model, from the first step whose executor reported
        routing counts (None for a dense model, or an executor that reports none)."""
        self.eos_token_ids = frozenset(getattr(self.tokenizer, "eos_token_ids", ()) or ())
        self.requests: dict[str, Request] = {}
        self._outputs: dict[str, _OutputState] = {}
        self._deadlines: list[tuple[float, int, str]] = []
        """(deadline, arrival order, request id) of the requests given a deadline: ids, not
        requests, since an entry outlives its request until the deadline passes, and a finished
        request must leave nothing of it (its images' frames and rows) referenced."""
        self._counter = itertools.count()
        self.step_errors = StepErrors()
        self.clock = time.perf_counter
        self.threads: ThreadGovernor | None = None
        """Intra-op threads by the cores free (`config.adaptive_threads`), from the first step
        after the warm-up; it sets the count of the thread that steps."""
        self.startup = Startup({"read_weights": loaded.load_seconds}
                              if getattr(loaded, "load_seconds", None) is not None else {})
        """Where this engine's start went, phase by phase (lifeline.engine.startup)."""
        self.startup.merge(getattr(self.executor, "startup", None))
        if self.compiled:
            count_compiles()  # the warm-up's compiles, and any later one, are counted
        with self.startup.phase("compile_warmup"):
            self.warmup()
        self.background_compile: BackgroundCompile | None = None
        """The compiled forward loading, or a child process compiling it, while this engine
        serves eagerly."""
        pending = getattr(self.executor, "pending_compile", None)
        if pending is not None:
            self.background_compile = BackgroundCompile(
                self.executor, pending, str(loaded.source), config.weights,
                deferred=getattr(self.executor, "deferred_weights", None))
        if config.adaptive_threads and config.device.partition(":")[0] == "cpu":
            import torch

            from lifeline.engine.threads import ThreadGovernor

            self.threads = ThreadGovernor(torch.get_num_threads())

    @property
    def compile_state(self) -> str:
        """How the forward runs: 'compiled', 'eager', 'loading' (eager while the cached graphs
        load), 'compiling' (eager while a child compiles) or 'failed' (eager: the background
        compile failed)."""
        if self.background_compile is not None:
            return self.background_compile.state
        return "compiled" if self.compiled else "eager"

    def close(self) -> None:
        """Stop what this engine started besides itself (a background compile)."""
        if self.background_compile is not None:
            self.background_compile.close()

    def _model_executor(self, layout: KVLayout) -> Executor:
        from lifeline.engine.model_executor import ModelExecutor

        return ModelExecutor(self.loaded, self.config, layout)

    @property
    def compiled(self) -> bool:
        """Whether the forward runs compiled (config.compile, where the model supports it)."""
        return self.executor.compiled

    def _clamp_model_len(self, asked: int | None, max_position: int) -> int:
        """The longest context served: what was asked (or the model's own), no more than the
        model's positions and no more than one request can hold alone in the KV cache, so a
        request admitted can always be run to its end (vLLM clamps the same way)."""
        wanted = min(asked or max_position, max_position)
        capacity = self.block_manager.capacity_tokens()
        self.max_model_len_reason = "model" if wanted == max_position else "max_model_len"
        if capacity < wanted:
            self.max_model_len_reason = "kv_cache"
            log.warning("max_model_len %d -> %d: the KV cache (%d blocks of %d tokens) holds "
                        "no more for one request; --kv-cache-memory-bytes sizes it", wanted,
                        int(capacity), self.block_manager.num_blocks,
                        self.block_manager.block_size)
            return int(capacity)
        return wanted

    def warmup(self) -> None:
        """Compile the forward's graphs before the first request: a step of several tokens
        (the graph of every batch and chunk size from 2 up) and one of a single token. A
        no-op when the forward runs eagerly on the CPU (on a GPU it loads the kernels and
        the matrix library's handles, the first step's second or two)."""
        if not self.compiled and self.config.device == "cpu":
            return
        params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
        for batch in (2, 1):  # 3-token prompts: no full block for the prefix cache to keep
            for i in range(batch):
                self.add_request([1 + i, 2, 3], params, request_id=f"warmup-{batch}-{i}")
            while self.has_unfinished_requests():
                self.step()
        self._counter = itertools.count()
        self.recorder.reset()

    @property
    def step_log(self) -> StepLog:
        """The recent steps, readable from any thread."""
        return self.recorder.log

    @property
    def max_model_len(self) -> int:
        return self.scheduler.config.max_model_len

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, arrival: float | None = None, *,
                    cache_salt: str | None = None, deadline: float | None = None,
                    fault: str | None = None, client_id: str | None = None,
                    choice_index: int | None = None, images: Sequence[ImageSpan] = ()
                    ) -> Request:
        """`cache_salt` (vLLM's): requests share prefix-cache blocks only if their salts are
        equal (no salt and the empty salt are the same). `deadline` (engine clock): a request
        still running then ends with finish reason 'length', one with no token yet fails with
        `RequestError.TIMEOUT`. `client_id` and `choice_index`: the response and choice this
        request serves, as the step log names it (default: `request_id`). `images`: the
        prompt's images, their tokens already in the prompt (lifeline.media.inputs)."""
        params = params or SamplingParams()
        now = self.clock()
        order = next(self._counter)
        request_id = request_id or f"req-{order}"
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        text = prompt if isinstance(prompt, str) else None
        ids = self._tokenize(prompt)
        req = Request(request_id, ids, params, prompt=text, eos_token_ids=self.eos_token_ids,
                      arrival_order=order, extra_hash_key=(cache_salt or "").encode(),
                      deadline=deadline, fault=fault, client_id=client_id,
                      choice_index=choice_index, images=tuple(images))
        req.timeline.arrival = arrival if arrival is not None else now
        req.timeline.arrival_wall = time.time()
        req.timeline.tokenized = self.clock()
        self._validate(req)
        req.want_prompt_logits = params.prompt_logprobs is not None
        self.scheduler.add_request(req)
        self.recorder.arrive(req, len(self.scheduler.running))
        req.timeline.queued = self.clock()
        self.requests[request_id] = req
        if deadline is not None:
            heapq.heappush(self._deadlines, (deadline, order, request_id))
        self._outputs[request_id] = _OutputState(self._detokenizer(params), StopChecker(
            params.stop, params.include_stop_str_in_output))
        if req.want_prompt_logits:
            self._outputs[request_id].prompt_logprobs = [None] * len(ids)
        return req

    def _tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass prompt_token_ids")
            return self.tokenizer.encode(prompt)
        return [int(t) for t in prompt]

    def _validate(self, req: Request) -> None:
        check_request(req.prompt_token_ids, req.params, ModelLimits(
            self.model_config.vocab_size, self.max_model_len))
        if req.images:
            if self.model_config.vision is None:
                raise ValueError(f"{self.model_config.name or 'this model'} takes no images")
            n = req.num_prompt_tokens
            last = -1
            for img in req.images:
                if not img.positions or img.offset <= last or img.end > n:
                    raise ValueError("an image's positions lie outside the prompt or overlap")
                last = img.end - 1

    def _detokenizer(self, params: SamplingParams) -> IncrementalDetokenizer | None:
        if self.tokenizer is None:
            return None
        return IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens)

    def prompt_logits(self, token_ids: list[int], images: Sequence[ImageSpan] = ()
                      ) -> torch.Tensor:
        """Logits `[T, vocab]` at every prompt position, computed through the normal step path
        (scheduler, chunked prefill, paged KV), bypassing the prefix cache. The model
        executor's: the chunks are its tensors."""
        import torch

        req = self.add_request(token_ids, SamplingParams(max_tokens=1, temperature=0),
                               images=images)
        req.want_prompt_logits = True
        while not req.is_finished:
            self.step()
        return torch.cat(req.prompt_logits).cpu()

    def abort_request(self, request_id: str) -> None:
        req = self.requests.get(request_id)
        if req is not None and not req.is_finished:
            self.scheduler.finish(req, FinishReason.ABORT)
            req.timeline.finished = self.clock()
            self._release(req)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """One step: requests past their deadline end, then the scheduled batch runs.

        A batch whose forward or sampling raises is isolated: its requests go back to the head
        of the queue to be recomputed, each in a step of its own, so a request that raises again
        fails alone (`RequestError.STEP_FAILED`, blocks freed) and the others go on."""
        if self.threads is not None:
            self.threads.poll()
        now = self.clock()
        ended = self._expire(now)
        out = self.scheduler.schedule(now)
        if out.is_empty:
            return ended + self._refuse_unschedulable()
        try:
            result, started, wall, done = self._execute(out)
        except Exception as exc:  # noqa: BLE001 - one request fails, not the engine
            return ended + self._fail_step(out, exc, isolate=len(out.scheduled) > 1)
        try:  # after sampling: a retry would draw seeded requests' tokens again
            if result.moe is not None:
                self._moe_accounting().end(result.moe)
            self._record_prompt_outputs(result)
            self._record_prefill(out, started, done)
            self.recorder.record(out, self.scheduler, self.block_manager, started, wall,
                                 done - started)
            requests = [self.requests[rid] for rid in result.request_ids]
            finished = self.scheduler.update(out, {id(r): t for r, t in zip(requests,
                                                                             result.token_ids)})
            return ended + self._process_outputs(requests, result, finished, done)
        except Exception as exc:  # noqa: BLE001 - state half-advanced: fail the batch
            return ended + self._fail_step(out, exc, isolate=False)

    def _execute(self, out: SchedulerOutput) -> tuple[ModelOutput, float, float, float]:
        """The executor's output, and its start (engine clock, wall clock) and end."""
        if any(s.request.fault == "step" for s in out.scheduled):
            raise InjectedFault("fault injected by a request (X-Lifeline-Fault: step)")
        wall, started = time.time(), self.clock()
        result = self.executor.execute(out)
        return result, started, wall, self.clock()

    def _moe_accounting(self) -> MoEAccounting:
        if self.moe is None:  # its counts are torch's, as the executor that made them
            from lifeline.engine import moe_usage

            self.moe = moe_usage.MoEAccounting(self.loaded.config)
        return self.moe

    def _record_prompt_outputs(self, result: ModelOutput) -> None:
        for rid, chunk in result.prompt_logits.items():
            self.requests[rid].prompt_logits.append(chunk)
        for rid, entries in result.prompt_logprobs.items():
            state = self._outputs[rid].prompt_logprobs
            if state is None:
                continue
            for pos, lp in entries:
                state[pos] = lp

    def _take_prompt_logprobs(self, req: Request) -> list[TokenLogprobs | None] | None:
        state = self._outputs[req.request_id]
        taken, state.prompt_logprobs = state.prompt_logprobs, None
        if taken is not None:
            req.want_prompt_logits = False  # a preempted re-run needs no logits, may hit cache
        return taken

    def _record_prefill(self, out: SchedulerOutput, start: float, end: float) -> None:
        for s in out.scheduled:
            if s.num_new_tokens > 1 or s.start < s.request.num_prompt_tokens:
                s.request.timeline.prefill_chunks.append((start, end, s.num_new_tokens))

    def _process_outputs(self, requests: list[Request], result: ModelOutput,
                         finished: list[Request], now: float) -> list[RequestOutput]:
        results = []
        for req, lp in zip(requests, result.logprobs):
            token = req.output_token_ids[-1]
            tl = req.timeline
            tl.token_times.append(now)
            if tl.first_token is None:
                tl.first_token = now
            if lp is not None:
                req.logprobs.append(lp)
            prompt_lps = self._take_prompt_logprobs(req)
            delta = self._detokenize(req, token)
            if req.status is RequestStatus.FINISHED:
                tl.finished = now
            text = "".join(self._outputs[req.request_id].parts) if req.is_finished else ""
            results.append(RequestOutput(req.request_id, [token], delta, text, req.is_finished,
                                         req, [lp] if lp is not None else [], prompt_lps))
            if req.is_finished:
                self._release(req)
        return results

    def _detokenize(self, req: Request, token: int) -> str:
        start = self.clock()
        try:
            return self._detokenize_token(req, token)
        finally:
            req.timeline.detokenize_s += self.clock() - start

    def _detokenize_token(self, req: Request, token: int) -> str:
        state = self._outputs[req.request_id]
        if state.detokenizer is None:
            return ""
        text = state.detokenizer.step([token])
        if req.is_finished:
            text += state.detokenizer.flush()
        result = state.stop.feed(text)
        delta = result.emit
        if result.stopped:
            req.stop_reason = result.stop_str
            if req.is_finished:
                req.finish_reason = FinishReason.STOP
            else:
                self.scheduler.finish(req, FinishReason.STOP)
        elif req.is_finished:
            delta += state.stop.flush()
        state.parts.append(delta)
        return delta

    def _release(self, req: Request) -> None:
        if self.moe is not None:
            req.timeline.moe = self.moe.finish(req.request_id)
        self.recorder.forget(req)
        self.requests.pop(req.request_id, None)
        self._outputs.pop(req.request_id, None)
        if len(self._deadlines) > 2 * len(self.requests) + 64:  # entries of ended requests
            self._deadlines = [e for e in self._deadlines if e[2] in self.requests]
            heapq.heapify(self._deadlines)

    def _end(self, req: Request, error: RequestError | None, now: float,
             reason: FinishReason = FinishReason.ABORT) -> RequestOutput:
        """End `req` now (blocks freed) with `error`, or with `reason` and its held-back text."""
        state = self._outputs.get(req.request_id)
        delta = ""
        if error is None and state is not None and state.detokenizer is not None:
            delta = state.stop.feed(state.detokenizer.flush()).emit + state.stop.flush()
            state.parts.append(delta)
        self.scheduler.finish(req, reason)
        req.error = error
        req.timeline.finished = now
        text = "".join(state.parts) if state is not None else ""
        self._release(req)
        return RequestOutput(req.request_id, [], delta, text, True, req)

    def _expire(self, now: float) -> list[RequestOutput]:
        ended = []
        while self._deadlines and self._deadlines[0][0] <= now:
            _, order, request_id = heapq.heappop(self._deadlines)
            req = self.requests.get(request_id)
            if req is None or req.arrival_order != order or req.is_finished:
                continue
            if req.num_output_tokens:
                req.stop_reason = "timeout"
                ended.append(self._end(req, None, now, FinishReason.LENGTH))
            else:
                ended.append(self._end(req, RequestError.TIMEOUT, now))
        return ended

    def _refuse_unschedulable(self) -> list[RequestOutput]:
        """Nothing ran although requests wait and none runs: the head of the queue cannot fit
        the KV cache even with every block free, and would wait forever."""
        sched = self.scheduler
        if sched.running or not sched.waiting:
            return []
        return [self._end(sched.waiting[0], RequestError.UNSCHEDULABLE, self.clock())]

    def _fail_step(self, out: SchedulerOutput, exc: Exception, isolate: bool
                   ) -> list[RequestOutput]:
        """Isolate the batch of a step that raised, or fail it: a lone request, a step whose
        state had begun to advance, and requests already in MAX_STEP_FAILURES failed steps."""
        reqs = [s.request for s in out.scheduled]
        errors = self.step_errors
        errors.count += 1
        errors.last_error, errors.last_time = type(exc).__name__, time.time()
        for req in reqs:
            req.num_step_failures += 1
        retry = [r for r in reqs if isolate and r.num_step_failures < MAX_STEP_FAILURES]
        failed = [r for r in reqs if r not in retry]
        if retry:
            log.warning("a step of %d requests failed (%s); %d are recomputed, each in a step "
                        "of its own", len(reqs), type(exc).__name__, len(retry), exc_info=exc)
            for req in retry:
                req.prompt_logits.clear()
            self.scheduler.isolate(retry, self.clock())
        if not failed:
            return []
        errors.requests_failed += len(failed)
        log.error("a step failed (%s); %d requests end with an error (%s), the engine goes on",
                  type(exc).__name__, len(failed), ", ".join(r.request_id for r in failed),
                  exc_info=None if retry else exc)
        now = self.clock()
        return [self._end(req, RequestError.STEP_FAILED, now) for req in failed]
