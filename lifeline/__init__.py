"""Lifeline: an LLM inference system that shows where every millisecond of a request went."""
from __future__ import annotations

from typing import Any

__all__ = ["LLM", "GenerationResult", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # Lazy, so that `lifeline.engine.scheduler` (used by the planner) never pulls in torch.
    if name == "SamplingParams":
        from lifeline.engine.sampling_params import SamplingParams

        return SamplingParams
    if name in ("LLM", "GenerationResult"):
        from lifeline import llm

        return getattr(llm, name)
    raise AttributeError(f"module 'lifeline' has no attribute {name!r}")
