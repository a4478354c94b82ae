"""What an engine step costs: a non-negative least-squares fit of a run's step log,
`period = a + b·decode_rows + c·prefill_tokens + d·decode_context`, where `decode_context` is
the KV the step's decodes attend over (the sum of their contexts).

The period is from a step's start to the next one's where the engine went straight on (the two
steps share a request): what a running request waits for each token, its forward and sampling
and the engine's bookkeeping around them (outputs, detokenizing, the server's streams competing
for the interpreter), all of which grow with the batch. Steps the engine went idle after have
no period and stay out of the fit, as do outliers (periods that held a pause of the whole
process), trimmed in up to three rounds.

The fit is exact NNLS: with four terms every subset of them is solved by ordinary least squares
and the best subset whose coefficients are all non-negative wins (that is the NNLS optimum).
A term the run never varied (every step the same batch, say) cannot be told from the base
cost; subsets that would need it are rank-deficient and skipped, so its cost stays in the base
and `confounded` names it."""
from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

TERMS = ("base", "decode_rows", "prefill_tokens", "decode_context")
MIN_STEPS = 8
"""Fewer steps than this fit nothing."""
TRIM_ROUNDS = 3
OUTLIER_SCALES = 4.0


@dataclass(slots=True, frozen=True)
class StepShape:
    """The parts of one step the fit weighs."""

    decode_rows: int
    prefill_tokens: int
    decode_context: int

    @classmethod
    def of(cls, step: dict[str, Any]) -> StepShape:
        rows = context = prefill = 0
        for entry in step.get("requests") or ():
            if entry.get("kind") == "decode":
                rows += 1
                context += int(entry.get("context") or 0)
            else:
                prefill += int(entry.get("tokens") or 0)
        return cls(rows, prefill, context)

    def vector(self) -> tuple[float, float, float, float]:
        return 1.0, float(self.decode_rows), float(self.prefill_tokens), float(self.decode_context)


@dataclass(slots=True, frozen=True)
class StepCost:
    """Milliseconds of a step's period (`base_ms`), per decode row, per prefill token and per
    context token a decode attends over; all non-negative."""

    base_ms: float
    row_ms: float
    prefill_token_ms: float
    context_token_ms: float
    steps: int
    """Steps the fit used."""
    r2: float | None
    """Share of the steps' duration variance the fit explains (None: no variance)."""
    confounded: tuple[str, ...]
    """Terms that never varied apart from the others: their cost is counted in the base."""

    def predict(self, shape: StepShape) -> float:
        return (self.base_ms + self.row_ms * shape.decode_rows
                + self.prefill_token_ms * shape.prefill_tokens
                + self.context_token_ms * shape.decode_context)

    def as_dict(self) -> dict[str, Any]:
        return {"base_ms": self.base_ms, "row_ms": self.row_ms,
                "prefill_token_ms": self.prefill_token_ms,
                "context_token_ms": self.context_token_ms, "steps": self.steps, "r2": self.r2,
                "confounded": list(self.confounded)}


def periods(steps: Sequence[dict[str, Any]]) -> dict[int, float]:
    """Step number → ms from its start to the next step's start, for steps the engine went
    straight on from (the next step, numbered next, runs one of the same requests)."""
    out = {}
    ordered = sorted(steps, key=lambda s: s["step"])
    for a, b in itertools.pairwise(ordered):
        if b["step"] != a["step"] + 1 or not _shares_request(a, b):
            continue
        out[a["step"]] = (b["t"] - a["t"]) * 1e3
    return out


def _shares_request(a: dict[str, Any], b: dict[str, Any]) -> bool:
    ids = {r.get("id") for r in a.get("requests") or ()}
    return any(r.get("id") in ids for r in b.get("requests") or ())


def fit_steps(steps: Iterable[dict[str, Any]]) -> StepCost | None:
    """The step cost of these step records (StepRecord.as_dict()); None with too few."""
    steps = list(steps)
    period = periods(steps)
    rows = [(StepShape.of(s).vector(), period[s["step"]]) for s in steps if s["step"] in period]
    if len(rows) < MIN_STEPS:
        return None
    x = np.array([r[0] for r in rows])
    y = np.array([r[1] for r in rows])
    keep = np.ones(len(y), dtype=bool)
    for _ in range(TRIM_ROUNDS):
        coef, _ = nnls_subsets(x[keep], y[keep])
        outliers = _outliers(y - x @ coef, float(np.median(np.abs(y))))
        if (outliers == ~keep).all():
            break
        keep = ~outliers
        if keep.sum() < MIN_STEPS:
            return None
    x, y = x[keep], y[keep]
    residual = y - x @ coef
    spread = float(((y - y.mean()) ** 2).sum())
    r2 = 1 - float((residual ** 2).sum()) / spread if spread > 0 else None
    varied = _independent_terms(x)
    confounded = tuple(TERMS[j] for j in range(1, len(TERMS))
                       if j not in varied and x[:, j].any())
    return StepCost(*(float(c) for c in coef), steps=int(keep.sum()), r2=r2,
                    confounded=confounded)


def _outliers(residual: np.ndarray, typical: float) -> np.ndarray:
    """Steps far above or below the fit: more than `OUTLIER_SCALES` robust standard deviations
    (1.4826 × the median absolute deviation) from the median residual. A period that held a
    pause of the whole process (the interpreter busy elsewhere, a collection) says nothing of
    the step's shape and would pull a least-squares fit anywhere. A deviation within a hundredth
    of a `typical` period never counts (an exact fit has no outliers)."""
    centre = np.median(residual)
    scale = max(1.4826 * float(np.median(np.abs(residual - centre))), 0.01 * typical)
    return np.abs(residual - centre) > OUTLIER_SCALES * scale


def nnls_subsets(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, tuple[int, ...]]:
    """argmin ‖x·c − y‖ over c ≥ 0, and the columns with a non-zero coefficient. Ties (equal
    residuals from collinear columns) go to the subset that keeps the intercept and uses fewer
    columns, which is the first such subset in the search order."""
    n = x.shape[1]
    scale = np.linalg.norm(x, axis=0)
    scale[scale == 0] = 1.0
    best: tuple[float, np.ndarray, tuple[int, ...]] | None = None
    for subset in _subsets(n):
        cols = list(subset)
        xs = x[:, cols] / scale[cols]
        if np.linalg.matrix_rank(xs, tol=1e-9 * max(xs.shape)) < len(cols):
            continue
        sol, *_ = np.linalg.lstsq(xs, y, rcond=None)
        if (sol < 0).any():
            continue
        sse = float(((xs @ sol - y) ** 2).sum())
        if best is None or sse < best[0] * (1 - 1e-9) - 1e-12:
            coef = np.zeros(n)
            coef[cols] = sol / scale[cols]
            best = (sse, coef, subset)
    if best is None:
        return np.zeros(n), ()
    return best[1], best[2]


def _subsets(n: int) -> list[tuple[int, ...]]:
    """Every non-empty subset of the columns: with the intercept (column 0) first, then
    smaller before larger."""
    out = [s for k in range(1, n + 1) for s in itertools.combinations(range(n), k)]
    return sorted(out, key=lambda s: (0 not in s, len(s)))


def _independent_terms(x: np.ndarray) -> set[int]:
    """Columns that vary apart from the intercept and the other columns: dropping one of them
    lowers the rank of the design."""
    scale = np.linalg.norm(x, axis=0)
    scale[scale == 0] = 1.0
    xs = x / scale
    full = np.linalg.matrix_rank(xs, tol=1e-9 * max(xs.shape))
    out = set()
    for j in range(1, x.shape[1]):
        rest = np.delete(xs, j, axis=1)
        if x[:, j].any() and np.linalg.matrix_rank(rest, tol=1e-9 * max(xs.shape)) < full:
            out.add(j)
    return out

