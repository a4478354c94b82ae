"""The model executor: a step of real weights in torch (the forward through `ModelRunner`,
prompt logits and logprobs, sampling), handed back as an immutable `ModelOutput`."""
from __future__ import annotations

from collections.abc import Callable
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import torch

from lifeline.engine.executor import ModelOutput, MoECounts, TokenLogprobs
from lifeline.engine.kv_layout import KVLayout
from lifeline.engine.model_runner import ModelRunner, StepInputs
from lifeline.engine.prompt_logprobs import gather_prompt_logprobs
from lifeline.engine.sampler import Sampler, SamplerOutput, SamplingInput
from lifeline.engine.scheduler import SchedulerOutput
from lifeline.engine.startup import Startup
from lifeline.model.device import gpu_dtype, place_model, runs_on_gpu
from lifeline.model.loader import lazy_load_for, materialize_weights
from lifeline.model.native import native_ops
from lifeline.model.weight_format import (
    DeferredWeights,
    apply_weight_format,
    finish_weight_format,
    pending_weights,
    release_freed_memory,
)

if TYPE_CHECKING:
    from lifeline.engine.engine import EngineConfig
    from lifeline.model.compiled import CachedForward
    from lifeline.model.loader import LoadedModel


class ModelExecutor:
    """Owns the loaded model from here on: moves it to `config.device`, applies
    `config.weights` in place, lays its KV pools out as `layout` says and compiles its forward
    where `config.compile` asks and the family supports it."""

    def __init__(self, loaded: LoadedModel, config: EngineConfig, layout: KVLayout,
                 dtype: torch.dtype | None = None):
        """`dtype`: the whole model's and its KV pools' dtype; None: on a GPU the weight
        format's (bf16 or fp32), on the CPU float32 with `config.weights` applied. Given on
        the CPU, it runs the GPU's arithmetic there (tests)."""
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.startup = startup = Startup()
        """The phases of the start spent here (lifeline.engine.startup)."""
        model = loaded.model
        if dtype is not None or not lazy_load_for(config.weights, config.device):
            materialize_weights(model)  # float32 layers where a lazy load left the file's
        if dtype is None and runs_on_gpu(config.device):
            dtype = gpu_dtype(config.weights)
        if dtype is not None:
            with startup.phase("weight_format"):
                place_model(model, config.device, dtype)
            loaded.weight_format = f"{loaded.weight_format}->{config.weights}@{config.device}"
        else:
            if not getattr(model, "lazy_weights", None):  # else on the CPU already
                model.to(config.device)
            if config.weights != "fp32" or config.compile:
                with startup.phase("native_ops"):
                    native_ops()  # built or found here, so that the phases tell it apart
            if config.weights != "fp32":
                with startup.phase("weight_format"):
                    apply_weight_format(model, config.weights,
                                        defer_batches=_defers_batches(config))
                    release_freed_memory()
                if not loaded.weight_format.endswith(f"->{config.weights}"):
                    loaded.weight_format = f"{loaded.weight_format}->{config.weights}"
        self.dtype = dtype or torch.float32
        """The activations' and the KV pools' dtype."""
        with startup.phase("kv_pools"):
            self.runner = ModelRunner(model, loaded.config, layout,
                                      kv_dtype=config.kv_torch_dtype(self.dtype),
                                      device=config.device)
        self.compiled = False
        """Whether the forward runs compiled (config.compile, where the model supports it)."""
        self.pending_compile: Callable[[], CachedForward] | None = None
        """What gives the compiled forward a background compile will fill or load
        (config.compile_in_background): until then the forward runs eagerly. Where the weight
        format left its copies for batches to build (`deferred_weights`), calling it builds
        them first: the compiled graphs, and their key, are those of the whole format."""
        self.deferred_weights: DeferredWeights | None = None
        """The weight format's copies for batches that `pending_compile` builds first."""
        pending = pending_weights(model)
        if pending is not None and _defers_batches(config) and self.runner.compiles():
            # (a model shared with an engine that deferred them: built here before this
            # engine runs, unless it compiles in the background)
            self.deferred_weights = pending

            def prepare() -> CachedForward:
                finish_weight_format(model)
                return self.runner.compiled_forward()

            self.pending_compile = prepare
        else:
            if pending is not None:  # no background compile to build them in
                with startup.phase("weight_format"):
                    finish_weight_format(model)
            self.compiled = config.compile and self.runner.compile()
            if self.compiled and config.compile_in_background:
                forward = self.runner.forward
                if hasattr(forward, "cached"):  # a CachedForward
                    self.runner.forward, self.compiled = self.runner.model, False
                    self.pending_compile = lambda: forward
        self.moe_stats = getattr(model, "moe_stats", None)
        """The routing counts of an MoE model (None for a dense one)."""
        self.sampler = Sampler(getattr(loaded.tokenizer, "eos_token_ids", ()) or ())
        self.vision = getattr(loaded, "vision", None)
        """The vision tower of a vision-language model (lifeline.model.vision), else None."""
        if self.vision is not None:
            place_model(self.vision, config.device, dtype)
            self.vision.eval()
        self.encoder_cache = EncoderCache(config.encoder_cache_mib << 20)

    def execute(self, scheduled: SchedulerOutput) -> ModelOutput:
        inputs = self.runner.prepare(scheduled)
        if inputs.images:
            inputs.image_embeds = self._image_embeds(inputs)
        tokens = [s.num_new_tokens for s in inputs.order]
        if self.moe_stats is not None:
            # Segment i (the i-th scheduled request) labels its tokens in the flattened step.
            self.moe_stats.reset(torch.repeat_interleave(torch.arange(len(tokens)),
                                                         torch.tensor(tokens)), len(tokens))
        logits, argmax = self.runner.execute(inputs)
        moe = None
        if self.moe_stats is not None:
            moe = MoECounts(self.moe_stats.counts.cpu(),
                            tuple(s.request.request_id for s in inputs.order), tuple(tokens))
        prompt_logprobs, prompt_logits = self._prompt_outputs(inputs, logits)
        sampled = self._sample(inputs, logits, argmax)
        return ModelOutput(
            tuple(r.request_id for r in inputs.sampling), tuple(sampled.token_ids),
            tuple(sampled.logprobs), tuple(sampled.token_ids) if sampled.from_shortlist else None,
            prompt_logprobs, prompt_logits, moe)

    def _image_embeds(self, inputs: StepInputs) -> torch.Tensor:
        """The rows of each image this step needs: the image's own once encoded, else from
        the encoder cache or encoded now (the whole image). Either way the image keeps its rows
        and drops its frames (`ImageSpan.encoded`): a later chunk, a recomputation after
        preemption and the other choices of its request need no frames."""
        if self.vision is None:
            raise ValueError("this model has no vision tower: it cannot take images")
        parts = []
        for req, img, rows, _ in inputs.images:
            embeds = img.embeds if img.encoder is self.encoder_cache else None
            if embeds is None:
                embeds = self._embeds_of(req, img)
                img.encoded(embeds, self.encoder_cache)
            parts.append(embeds[torch.tensor(rows, dtype=torch.long, device=embeds.device)])
        return torch.cat(parts)

    def _embeds_of(self, req: Any, img: Any) -> torch.Tensor:
        """One image's rows from the encoder cache, or from its frames through the tower."""
        key = req.image_key(img)
        embeds = self.encoder_cache.get(key)
        if embeds is not None:
            img.timings.setdefault("encoder_cache_hit", 1.0)
            return embeds
        if img.pixels is None:
            raise ValueError("an image's frames were freed once another engine encoded them: "
                             "prepare the image again for this one")
        pixels = torch.as_tensor(img.pixels)
        embeds, encode_s, project_s = self.vision.encode_stages(
            pixels.to(self.runner.device, self.dtype))
        del pixels
        if embeds.shape[0] != img.num_embeds:
            raise ValueError(f"an image's tower gives {embeds.shape[0]} rows for its "
                             f"{img.num_embeds} tokens")
        self.encoder_cache.put(key, embeds)
        img.timings["encode_s"] = img.timings.get("encode_s", 0.0) + encode_s
        img.timings["project_s"] = img.timings.get("project_s", 0.0) + project_s
        return embeds

    def _prompt_outputs(self, inputs: StepInputs, logits: torch.Tensor
                        ) -> tuple[MappingProxyType[str, tuple[tuple[int, TokenLogprobs], ...]],
                                   MappingProxyType[str, Any]]:
        """Logprobs of the prompt tokens this step's chunks predict, for the requests that ask
        for them; the chunks' raw logits for the others recording prompt logits."""
        logprobs, raw = {}, {}
        for req, first, count in inputs.prompt_logit_spans:
            rows = logits[first:first + count]
            top_n = req.params.prompt_logprobs
            if top_n is not None:  # the chunk starts at the request's computed tokens
                logprobs[req.request_id] = tuple(gather_prompt_logprobs(
                    rows, req.num_computed_tokens, req.prompt_token_ids, top_n))
            else:
                raw[req.request_id] = rows.clone()
        return MappingProxyType(logprobs), MappingProxyType(raw)

    def _sample(self, inputs: StepInputs, logits: torch.Tensor, argmax: torch.Tensor | None
                ) -> SamplerOutput:
        # sample_rows rise strictly below len(logits): as many as rows means every row, in order
        every = len(inputs.sample_rows) == logits.shape[0]
        rows = logits if every else logits[inputs.sample_rows]  # a decode step: no 16 MB copy
        if argmax is not None and not every:
            argmax = argmax[inputs.sample_rows]
        batch = [SamplingInput(r.params, r.prompt_token_ids, r.output_token_ids,
                               r.sampling_plan.generator(), r.sampling_plan)
                 for r in inputs.sampling]
        return self.sampler(rows, batch, argmax)


class EncoderCache:
    """Image embeddings by the image's key (`Request.image_key`: its hash, salted as the
    request's prefix cache is), least recently used first out past `max_bytes`: the same image
    in another request, or in the next turn, is not encoded again. It holds embeddings only,
    never frames; a request's own images keep their rows while it lives (`ImageSpan.embeds`),
    so an eviction never needs the frames again."""

    def __init__(self, max_bytes: int):
        from collections import OrderedDict

        self.max_bytes = max_bytes
        self.entries: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.bytes = 0
        self.hits = self.misses = 0

    def get(self, key: str) -> torch.Tensor | None:
        found = self.entries.get(key)
        if found is None:
            self.misses += 1
            return None
        self.hits += 1
        self.entries.move_to_end(key)
        return found

    def put(self, key: str, value: torch.Tensor) -> None:
        size = value.numel() * value.element_size()
        if size > self.max_bytes:
            return
        old = self.entries.pop(key, None)
        if old is not None:
            self.bytes -= old.numel() * old.element_size()
        self.entries[key] = value
        self.bytes += size
        while self.bytes > self.max_bytes:
            _, gone = self.entries.popitem(last=False)
            self.bytes -= gone.numel() * gone.element_size()


def _defers_batches(config: EngineConfig) -> bool:
    """Whether the weight format may leave its int8 copies for batches (`gguf-int8`) to the
    background compile's thread, after `/ready`: where the forward compiles in the background
    from the on-disk cache (a server's start), ~1.5 s of a SmolLM2 start on 2 cores."""
    from lifeline.model.compiled import compile_cache_dir

    return (config.weights == "gguf-int8" and config.compile and config.compile_in_background
            and compile_cache_dir() is not None)
