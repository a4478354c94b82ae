"""Runs one scheduled step on the model: flattened inputs, paged KV pool, logits where needed."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from lifeline.engine.request import Request
from lifeline.engine.scheduler import ScheduledRequest, SchedulerOutput
from lifeline.model.config import ModelConfig
from lifeline.model.context import forward_context
from lifeline.model.layers.attention import AttentionMetadata, PrefillSeq


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


class ModelRunner:
    """`num_blocks` sizes every layer's pool, unless `window_blocks` is given: then the model's
    sliding-window layers form a group of their own (table `Request.window_block_ids`) with
    pools of `window_blocks` blocks."""

    def __init__(self, model: nn.Module, config: ModelConfig, num_blocks: int, block_size: int,
                 kv_dtype: torch.dtype = torch.float32, device: str = "cpu",
                 window_blocks: int | None = None):
        self.model = model
        self.forward = model
        """`model`, or its compiled forward (`compile`)."""
        self.last_argmax: torch.Tensor | None = None
        """Per row of the last `execute`'s logits, its argmax where the LM head's shortlist
        proved it, else -1; None for heads without one (weight_format.shortlist_argmax)."""
        self.config = config
        self.block_size = block_size
        self.device = torch.device(device)
        self.hybrid = window_blocks is not None
        self.window = config.sliding_window
        all_sliding = bool(config.sliding_window) and set(config.layer_types) == {"sliding"}
        self.main_window = self.window if all_sliding else None
        """The window of the main table's layers when every layer slides (else None)."""
        self.kv_caches = []
        for layer_type in config.layer_types:
            blocks = window_blocks if self.hybrid and layer_type == "sliding" else num_blocks
            shape = (blocks * block_size, config.num_kv_heads, config.head_dim)
            self.kv_caches.append((torch.zeros(shape, dtype=kv_dtype, device=self.device),
                                   torch.zeros(shape, dtype=kv_dtype, device=self.device)))

    def compile(self) -> bool:
        """Run the model's forward through `torch.compile` from now on, where its family
        supports it (lifeline.model.compiled); False where it does not."""
        from lifeline.model.compiled import compile_forward, supports_compile

        if self.device.type != "cpu" or not supports_compile(self.model):
            return False
        self.forward = compile_forward(self.model)
        return True

    @staticmethod
    def blocks_for_memory(config: ModelConfig, block_size: int, memory_bytes: int,
                          dtype_bytes: int = 4) -> int:
        return max(1, memory_bytes // (config.kv_bytes_per_token(dtype_bytes) * block_size))

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
        meta = self._attention_meta(order, "block_ids", self.main_window)
        if self.hybrid:
            meta.window_meta = self._attention_meta(order, "window_block_ids", self.window)
        return self._logit_plan(order, torch.tensor(ids, dtype=torch.long),
                                torch.cat(positions), meta)

    def _attention_meta(self, order: list[ScheduledRequest], table: str,
                        window: int | None = None) -> AttentionMetadata:
        """Slots through one block table. With a `window`, every layer that reads this table
        slides, so each query's context starts at the oldest position its window reaches."""
        slot_parts, prefills = [], []
        decodes = [s for s in order if s.num_new_tokens == 1]
        offset = 0
        for s in order:
            block_table = getattr(s.request, table)
            start, end = s.start, s.start + s.num_new_tokens
            if s.num_new_tokens == 1:
                slot_parts.append(self.slots(block_table, start, end))
            else:
                first = max(0, start - window + 1) if window else 0
                ctx_slots = self.slots(block_table, first, end)
                slot_parts.append(ctx_slots[start - first:])
                prefills.append(PrefillSeq(offset, s.num_new_tokens, end - first, ctx_slots))
            offset += s.num_new_tokens
        meta = AttentionMetadata(slot_mapping=torch.cat(slot_parts), num_decodes=len(decodes),
                                 prefills=prefills)
        if decodes:
            self._decode_meta(meta, decodes, table, window)
        return meta

    def _decode_meta(self, meta: AttentionMetadata, decodes: list[ScheduledRequest],
                     table_name: str, window: int | None) -> None:
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
            table[i, :n] = torch.tensor(getattr(s.request, table_name)[lo:lo + n])
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
    def execute(self, inputs: StepInputs) -> torch.Tensor:
        """Logits `[len(logit_rows), vocab]` in float32."""
        dev = self.device
        with forward_context(inputs.meta.to(dev), self.kv_caches):
            hidden = self.forward(inputs.input_ids.to(dev), inputs.positions.to(dev))
        self.last_argmax = None
        if inputs.logit_rows.numel() == 0:
            return hidden.new_empty(0, self.config.vocab_size)
        logits = self.model.compute_logits(hidden[inputs.logit_rows.to(dev)]).float()
        head = self.model.lm_head
        self.last_argmax, head.last_argmax = getattr(head, "last_argmax", None), None
        return logits
