"""Logprobs of a request's prompt tokens (`SamplingParams.prompt_logprobs`), gathered chunk by
chunk as prefill runs, so no more than one chunk's full logits ever exist at once."""
from __future__ import annotations

import torch

from lifeline.engine.executor import TokenLogprobs

ROWS_AT_ONCE = 64
"""Rows log-softmaxed together: bounds the copy to 64 rows of the vocabulary (64 MiB for
Gemma 3's 262,144 tokens) whatever the chunk size."""


def gather_prompt_logprobs(logits: torch.Tensor, start: int, prompt_ids: list[int],
                           top_n: int) -> list[tuple[int, TokenLogprobs]]:
    """(position, logprobs of the prompt token there) for the positions that the rows of
    `logits` (those of positions `start`, `start + 1`, ...) predict: row i scores the token at
    `start + i + 1`, so the first prompt token gets none and the last row (which scores the
    first generated token) gives none."""
    count = min(logits.shape[0], len(prompt_ids) - 1 - start)
    out: list[tuple[int, TokenLogprobs]] = []
    for first in range(0, max(count, 0), ROWS_AT_ONCE):
        rows = logits[first:min(first + ROWS_AT_ONCE, count)]
        out += _score_rows(rows, start + first, prompt_ids, top_n)
    return out


def _score_rows(logits: torch.Tensor, start: int, prompt_ids: list[int], top_n: int
                ) -> list[tuple[int, TokenLogprobs]]:
    count = logits.shape[0]
    logprobs = logits.float().log_softmax(dim=-1)
    targets = torch.tensor(prompt_ids[start + 1:start + 1 + count], device=logits.device)
    chosen = logprobs.gather(1, targets.unsqueeze(1)).squeeze(1).tolist()
    top_ids: list[list[int]] = [[] for _ in range(count)]
    top_values: list[list[float]] = [[] for _ in range(count)]
    if top_n:
        top = logprobs.topk(top_n, dim=-1)
        top_ids, top_values = top.indices.tolist(), top.values.tolist()
    ids = targets.tolist()
    return [(start + 1 + i, TokenLogprobs(ids[i], chosen[i],
                                          list(zip(top_ids[i], top_values[i], strict=True))))
            for i in range(count)]
