"""Greedy agreement up to ties, as the agreement tests judge it (tests/test_gemma3_reference.py,
tests/test_smollm2_reference.py): one run's tokens against a reference run that gave its top
logprobs at every step. Where the two part, the reference may prefer its own pick over ours by
less than `TIE_MARGIN` logits (a logprob difference is a logit difference), and ours must be
among its top three; what follows a parting is another text and is not compared."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

TIE_MARGIN = 0.4
"""The agreement tests' margin against llama.cpp."""


@dataclass(frozen=True, slots=True)
class Agreement:
    tokens: int
    """Tokens of the reference run."""
    matched: int
    """Tokens equal before the first parting (all of them when there is none)."""
    parted_at: int | None
    preference: float | None
    """At the parting: the reference's logprob of its pick less its logprob of ours (None
    where ours is not in its top list, or the runs part by length alone)."""
    rank: int | None
    """Our pick's place in the reference's top list at the parting (0: its first)."""

    @property
    def ok(self) -> bool:
        if self.parted_at is None:
            return True
        return (self.rank is not None and self.rank < 3 and self.preference is not None
                and self.preference < TIE_MARGIN)

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}


def compare(ours: Sequence[int], ref: Sequence[int],
            ref_top: Sequence[Sequence[tuple[int, float]]]) -> Agreement:
    """`ref_top[i]`: the reference's (token, logprob) pairs at step i, most likely first."""
    part = next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), None)
    if part is None:
        if len(ours) == len(ref):
            return Agreement(len(ref), len(ref), None, None, None)
        part = min(len(ours), len(ref))  # one stopped where the other went on
        return Agreement(len(ref), part, part, None, None)
    top = list(ref_top[part])
    ids = [t for t, _ in top]
    if ours[part] not in ids:
        return Agreement(len(ref), part, part, None, None)
    rank = ids.index(ours[part])
    return Agreement(len(ref), part, part, top[0][1] - top[rank][1], rank)
