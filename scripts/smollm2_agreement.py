"""Where Lifeline's greedy SmolLM2 text parts from llama.cpp's, and by how much (the numbers
behind docs/architecture.md's SmolLM2 section and tests/test_smollm2_reference.py's margin).

For each prompt of tests/fixtures/smollm2_llamacpp.json: Lifeline's greedy continuation (float32,
until an end-of-generation token, as llama-server ran it), the tokens that agree with
llama.cpp's before they part, and at the parting step the transformers reference's preference
for our pick and llama.cpp's for its own (logits).

    .venv/bin/python -m scripts.smollm2_agreement [--fixture PATH]   # from the repository root
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from lifeline import LLM, SamplingParams
from lifeline.model.default import SMOLLM2_MODEL_ID, smollm2_model_path
from tests.reference.gemma3_hf import reference_logits
from tests.reference.llama_hf import build_reference_llama

ROOT = Path(__file__).resolve().parents[1]


def compare(llm: LLM, reference, prompt: dict, n: int) -> str:
    theirs = prompt["completion_ids"]
    ours = llm.generate({"prompt_token_ids": prompt["prompt_ids"]},
                        SamplingParams(max_tokens=n, temperature=0))[0].token_ids
    part = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
    if part is None:
        return f"{prompt['name']:24} all {len(ours)} tokens agree"
    logits = reference_logits(reference, prompt["prompt_ids"] + ours[:part], 1)[-1]
    ref_pref = float(logits[ours[part]] - logits[theirs[part]])
    top, logprobs = prompt["steps_top_ids"][part], prompt["steps_top_logprobs"][part]
    rank = top.index(ours[part]) if ours[part] in top else None
    llama_pref = logprobs[0] - logprobs[rank] if rank is not None else float("nan")
    return (f"{prompt['name']:24} {part} of {len(theirs)} agree, then parts: reference prefers "
            f"ours by {ref_pref:.3f}, llama.cpp its own by {llama_pref:.3f} (ours is its "
            f"#{rank + 1 if rank is not None else '>5'})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fixture", type=Path,
                        default=ROOT / "tests" / "fixtures" / "smollm2_llamacpp.json")
    args = parser.parse_args()
    fixture = json.loads(args.fixture.read_text())
    llm = LLM(SMOLLM2_MODEL_ID, max_num_batched_tokens=512)
    reference = build_reference_llama(smollm2_model_path())
    n = fixture["settings"]["max_new_tokens"]
    for prompt in fixture["prompts"]:
        print(compare(llm, reference, prompt, n), flush=True)


if __name__ == "__main__":
    main()
