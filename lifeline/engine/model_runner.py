"""Runs one scheduled step on the model: flattened inputs, paged KV pool, logits where needed."""
from __future__ import annotations

import dataclasses
import math
import mmap
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lifeline.engine.kv_layout import KVLayout
from lifeline.engine.request import Request
from lifeline.engine.scheduler import ScheduledRequest, SchedulerOutput
from lifeline.model import registry
from lifeline.model.config import ModelConfig
from lifeline.model.context import forward_context
from lifeline.model.layers.attention import AttentionMetadata, PrefillSeq, set_native_decode_step
from lifeline.model.weight_format import has_shortlist


def kv_pool(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed KV pool that holds memory only where it is written. On the CPU its pages come
    from an anonymous mapping: the kernel hands them out zeroed as the blocks are first written,
    so a 2 GiB pool that serves 100 tokens costs the process a few MiB, not 2 GiB
    (`torch.zeros` writes, and so keeps, every page at start). Elsewhere `torch.zeros`."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    count = math.prod(shape)
    buf = mmap.mmap(-1, max(count * dtype.itemsize, 1))
    if hasattr(mmap, "MADV_HUGEPAGE"):
        buf.madvise(mmap.MADV_HUGEPAGE)  # as the rest of the heap under --huge-pages
    return torch.frombuffer(buf, dtype=dtype, count=count).view(shape)


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    order: list[ScheduledRequest]
    """Scheduled requests in flattened order: decodes first, then prefill chunks."""
    logit_rows: torch.Tensor
    """Rows of the hidden states whose logits are needed."""
    sample_rows: list[int]
    """Index into the logits of each sampling request (in `sampling`)."""
    sampling: list[Request]
    prompt_logit_spans: list[tuple[Request, int, int]]
    """(request, first logits row, count) for requests that record their prompt logits."""
    images: list[tuple[Request, Any, list[int], list[int]]] = field(default_factory=list)
    """(request, image, rows of its embeddings, rows of the step's tokens they replace) of
    each image with tokens in this step's prefill chunks."""
    image_embeds: torch.Tensor | None = None
    """Set by the executor: the embeddings of `images`' rows, in their order."""


class ModelRunner:
    """Each layer's K and V pools have the blocks of its cache group in `layout`. The first
    group's tables give the attention metadata; a hybrid layout's second group (the
    sliding-window layers) gives `meta.window_meta`."""

    def __init__(self, model: nn.Module, config: ModelConfig, layout: KVLayout,
                 kv_dtype: torch.dtype = torch.float32, device: str = "cpu"):
        self.model = model
        self.forward = model
        """`model`, or its compiled forward (`compile`)."""
        self.config = config
        family = registry.find(config.architecture)
        self.plain_head = family is not None and family.plain_head
        """The family's logits are its head's alone, so the head's argmax may come with them."""
        self.both_ways = bool(config.vision and config.vision.bidirectional)
        """An image's tokens attend to each other both ways (Gemma 3's language model)."""
        self.block_size = block_size = layout.block_size
        self.device = torch.device(device)
        if len(layout.groups) > 2:
            raise ValueError("attention reads at most two cache groups (full and sliding)")
        kinds: list[set[str]] = [set() for _ in layout.groups]
        for layer_type in config.layer_types:
            kinds[layout.group_index(layer_type)].add(layer_type)
        self.windows = [config.sliding_window if k == {"sliding"} and config.sliding_window
                        else None for k in kinds]
        """Per group, the window its layers all slide by (None: not all of them slide), even
        where the pool keeps every block (`sliding_window_kv=False`)."""
        self.kv_caches = []
        for layer_type in config.layer_types:
            blocks = layout.groups[layout.group_index(layer_type)].num_blocks
            shape = (blocks * block_size, config.num_kv_heads, config.head_dim)
            self.kv_caches.append((kv_pool(shape, kv_dtype, self.device),
                                   kv_pool(shape, kv_dtype, self.device)))

    def compile(self) -> bool:
        """Run the model's forward through `torch.compile` from now on, where its family
        supports it (lifeline.model.compiled); False where it does not."""
        if not self.compiles():
            return False
        self.forward = self.compiled_forward()
        return True

    def compiles(self) -> bool:
        """Whether the model's forward can run compiled here (a dense family, on the CPU)."""
        from lifeline.model.compiled import supports_compile

        return self.device.type == "cpu" and supports_compile(self.model)

    def compiled_forward(self) -> Any:
        """The model's forward through `torch.compile` (lifeline.model.compiled), not yet in
        use; only where `compiles()`."""
        from lifeline.model.compiled import compile_forward

        # the configuration less its name: models of one shape share their compiled graphs
        identity = repr(dataclasses.replace(self.config, name=""))
        return compile_forward(self.model, identity=identity)

    def slots(self, table: list[int], start: int, end: int) -> torch.Tensor:
        """Cache slots of positions [start, end); given-back window blocks (-1) read block 0,
        which the window mask hides."""
        positions = torch.arange(start, end)
        blocks = torch.tensor(table, dtype=torch.long).clamp_min_(0)
        return blocks[positions // self.block_size] * self.block_size + positions % self.block_size

    def prepare(self, out: SchedulerOutput) -> StepInputs:
        order = sorted(out.scheduled, key=lambda s: s.num_new_tokens != 1)
        ids: list[int] = []
        positions = []
        for s in order:
            req, start, end = s.request, s.start, s.start + s.num_new_tokens
            ids.extend(req.all_token_ids[start:end] if s.num_new_tokens > 1 else [req.token_at(start)])
            positions.append(torch.arange(start, end))
        meta = self._attention_meta(order, 0, self.windows[0])
        if len(self.windows) > 1:
            meta.window_meta = self._attention_meta(order, 1, self.windows[1])
        inputs = self._logit_plan(order, torch.tensor(ids, dtype=torch.long),
                                  torch.cat(positions), meta)
        inputs.images = self._image_rows(order)
        return inputs

    @staticmethod
    def _image_rows(order: list[ScheduledRequest]) -> list[tuple[Request, Any, list[int],
                                                                 list[int]]]:
        """Which of the step's rows are image tokens, and which embedding of which image each
        takes."""
        found = []
        offset = 0
        for s in order:
            start, end = s.start, s.start + s.num_new_tokens
            for img in s.request.images:
                if img.offset >= end or img.end <= start:
                    continue
                rows = [i for i, p in enumerate(img.positions) if start <= p < end]
                if rows:
                    found.append((s.request, img, rows,
                                  [offset + img.positions[i] - start for i in rows]))
            offset += s.num_new_tokens
        return found

    def _attention_meta(self, order: list[ScheduledRequest], group: int,
                        window: int | None = None) -> AttentionMetadata:
        """Slots through the block tables of cache group `group`. With a `window`, every layer
        of the group slides, so each query's context starts at the oldest position its window
        reaches."""
        slot_parts, prefills = [], []
        decodes = [s for s in order if s.num_new_tokens == 1]
        offset = 0
        for s in order:
            block_table = s.blocks.block_ids[group]
            start, end = s.start, s.start + s.num_new_tokens
            if s.num_new_tokens == 1:
                slot_parts.append(self.slots(block_table, start, end))
            else:
                first = max(0, start - window + 1) if window else 0
                ctx_slots = self.slots(block_table, first, end)
                slot_parts.append(ctx_slots[start - first:])
                runs = _image_runs(s.request, first, end) if self.both_ways else ()
                prefills.append(PrefillSeq(offset, s.num_new_tokens, end - first, ctx_slots,
                                           runs))
            offset += s.num_new_tokens
        meta = AttentionMetadata(slot_mapping=torch.cat(slot_parts), num_decodes=len(decodes),
                                 prefills=prefills)
        if decodes:
            self._decode_meta(meta, decodes, group, window)
        return meta

    def _decode_meta(self, meta: AttentionMetadata, decodes: list[ScheduledRequest],
                     group: int, window: int | None) -> None:
        """Each decode's context slots, padded to the longest; positions count from the first
        gathered one (with a window: the oldest position the window reaches)."""
        bs = self.block_size
        ends = torch.tensor([s.start + 1 for s in decodes])
        firsts = (ends - window).clamp_min(0) if window else torch.zeros_like(ends)
        first_blocks = firsts // bs
        spans = -(-ends // bs) - first_blocks
        table = torch.zeros(len(decodes), int(spans.max()), dtype=torch.long)
        for i, s in enumerate(decodes):
            lo, n = int(first_blocks[i]), int(spans[i])
            table[i, :n] = torch.tensor(s.blocks.block_ids[group][lo:lo + n])
        table.clamp_min_(0)
        slots = (table.unsqueeze(-1) * bs + torch.arange(bs)).reshape(len(decodes), -1)
        skip = firsts - first_blocks * bs  # positions before `firsts` in the first block
        lengths = ends - firsts
        length = int((skip + lengths).max())
        cols = torch.arange(length).unsqueeze(0)
        meta.decode_slots = slots[:, :length].contiguous()
        meta.decode_valid = (cols >= skip.unsqueeze(1)) & (cols < (skip + lengths).unsqueeze(1))
        meta.decode_positions = skip + lengths - 1

    def _logit_plan(self, order: list[ScheduledRequest], input_ids: torch.Tensor,
                    positions: torch.Tensor, meta: AttentionMetadata) -> StepInputs:
        rows: list[int] = []
        sample_rows: list[int] = []
        sampling: list[Request] = []
        spans: list[tuple[Request, int, int]] = []
        offset = 0
        for s in order:
            req, n = s.request, s.num_new_tokens
            if req.want_prompt_logits and s.start < req.num_prompt_tokens:
                count = min(n, req.num_prompt_tokens - s.start)
                spans.append((req, len(rows), count))
                rows.extend(range(offset, offset + count))
            if s.samples:
                last = offset + n - 1
                if rows and rows[-1] == last:
                    sample_rows.append(len(rows) - 1)
                else:
                    sample_rows.append(len(rows))
                    rows.append(last)
                sampling.append(req)
            offset += n
        return StepInputs(input_ids, positions, meta, order, torch.tensor(rows, dtype=torch.long),
                          sample_rows, sampling, spans)

    @torch.inference_mode()
    def execute(self, inputs: StepInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits `[len(logit_rows), vocab]` in float32 and, per row, its argmax where the LM
        head's shortlist proves it, else -1 (None for a head without a shortlist)."""
        hidden = self._forward(inputs)
        if inputs.logit_rows.numel() == 0:
            return hidden.new_empty(0, self.config.vocab_size), None
        logits, argmax = self._logits(hidden[inputs.logit_rows.to(self.device)])
        return logits.float(), argmax

    def _forward(self, inputs: StepInputs) -> torch.Tensor:
        """The model's call: hidden states of every scheduled token."""
        dev = self.device
        meta = inputs.meta.to(dev)
        with forward_context(meta, self.kv_caches):
            if inputs.image_embeds is None:
                if not set_native_decode_step(meta, self.kv_caches, self.config.sliding_window):
                    return self.forward(inputs.input_ids.to(dev), inputs.positions.to(dev))
                try:
                    return self.forward(inputs.input_ids.to(dev), inputs.positions.to(dev))
                finally:
                    torch.ops.lifeline_ext.clear_decode_step()
            # a step with image tokens runs eager: its input embeddings are spliced here
            t0 = time.perf_counter()
            ids = inputs.input_ids.to(dev)
            x = self.model.embed(ids)
            rows = torch.tensor([r for *_, step_rows in inputs.images for r in step_rows],
                                dtype=torch.long, device=dev)
            x = x.index_copy(0, rows, inputs.image_embeds.to(dev, x.dtype))
            splice = time.perf_counter() - t0
            for _, img, img_rows, _ in inputs.images:  # each image its share of the splice
                img.timings["splice_s"] = img.timings.get("splice_s", 0.0) + splice * len(
                    img_rows) / rows.numel()
            return self.model(ids, inputs.positions.to(dev), inputs_embeds=x)

    def _logits(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        head = self.model.lm_head
        if self.plain_head and has_shortlist(head):
            return head(hidden, with_argmax=True)
        return self.model.compute_logits(hidden), None


def _image_runs(req: Request, first: int, end: int) -> tuple[tuple[int, int], ...]:
    """The runs of consecutive image tokens (one per frame) among positions [first, end), in
    context positions counted from `first`."""
    runs = []
    for img in req.images:
        if img.end <= first or img.offset >= end:
            continue
        lo = prev = img.positions[0]
        for p in img.positions[1:] + (None,):
            if p is not None and p == prev + 1:
                prev = p
                continue
            a, b = max(lo, first), min(prev + 1, end)
            if a < b:
                runs.append((a - first, b - first))
            if p is not None:
                lo = prev = p
    return tuple(runs)
