"""The int8 LM head: a faster format must stay close to float32 on real text (default model).
Measured: 88% argmax agreement, perplexity +3.1% (see lifeline/model/weight_format.py)."""
import json
from pathlib import Path

import torch

from lifeline import LLM
from lifeline.model.loader import load_model

ESSAY = max(json.loads((Path(__file__).parent / "fixtures" / "gemma3_llamacpp.json").read_text())
            ["prompts"], key=lambda p: len(p["prompt_ids"]))["prompt_ids"]


def _perplexity(logits: torch.Tensor, ids: list[int]) -> float:
    logp = torch.log_softmax(logits[:-1], dim=-1)
    nll = -logp.gather(1, torch.tensor(ids[1:]).unsqueeze(1)).mean()
    return float(nll.exp())


def test_int8_head_keeps_perplexity_and_greedy_choices_close_to_fp32():
    loaded = load_model()
    fp32 = LLM(loaded).prompt_logits(ESSAY)
    int8_llm = LLM(loaded, weights="int8")
    assert int8_llm.loaded.weight_format.endswith("->int8")
    int8 = int8_llm.prompt_logits(ESSAY)
    agreement = float((fp32.argmax(-1) == int8.argmax(-1)).float().mean())
    ppl_fp32, ppl_int8 = _perplexity(fp32, ESSAY), _perplexity(int8, ESSAY)
    assert agreement > 0.8, agreement
    assert abs(ppl_int8 / ppl_fp32 - 1) < 0.05, (ppl_fp32, ppl_int8)
