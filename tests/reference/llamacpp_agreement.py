"""Does a greedy continuation follow llama.cpp's (tests/fixtures/gemma3_llamacpp.json) up to ties?

The criterion of the engine core's test (tests/test_gemma3_reference.py), for any weight format:
where our text first parts from llama.cpp's, our pick must be in llama.cpp's top 3 there, and
the float32 transformers reference, fed the common context, must prefer our pick over
llama.cpp's by less than `LLAMACPP_TIE_MARGIN` logits (a near-tie, not a different answer)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tests.reference.gemma3_hf import reference_logits

LLAMACPP_TIE_MARGIN = 0.4
"""The same margin as tests/test_gemma3_reference.py (measured there)."""


@dataclass(slots=True)
class Parting:
    name: str
    step: int | None
    """First output token that differs from llama.cpp's; None when all agree."""
    preference: float = 0.0
    """The reference's logit for our pick minus its logit for llama.cpp's pick there."""
    llama_rank: int | None = None
    """Our pick's rank in llama.cpp's top list at that step (None: not in it)."""

    @property
    def ok(self) -> bool:
        return self.step is None or (self.preference < LLAMACPP_TIE_MARGIN
                                     and self.llama_rank is not None and self.llama_rank < 3)


@torch.inference_mode()
def parting(reference: torch.nn.Module, prompt: dict, ours: list[int]) -> Parting:
    theirs = prompt["completion_ids"]
    step = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
    if step is None:
        return Parting(prompt["name"], None)
    logits = reference_logits(reference, prompt["prompt_ids"] + theirs[:step], 1)[-1]
    top = prompt["steps_top_ids"][step]
    return Parting(prompt["name"], step, float(logits[ours[step]] - logits[theirs[step]]),
                   top.index(ours[step]) if ours[step] in top else None)
