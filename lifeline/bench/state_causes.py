"""The output's pace split by cause for a server that keeps no step log (llama.cpp, vLLM,
SGLang), from what the join to its sampled state says of each request's decode window: how many
requests ran beside it, how many prompt tokens the others prefilled meanwhile, its context.

A non-negative least-squares fit across the run's requests of the server's time per output
token, `a + b·others running + c·others' prefill tokens per output token + d·context`, prices
each request's window; what the fit leaves unexplained is spread over the causes in proportion
(as `lifeline.bench.output_causes` does with a step log). A term the run never varied cannot
be told from the base (`confounded`), and its time stays in decode."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from lifeline.bench.output_causes import TpotSplit
from lifeline.bench.request_view import RequestView
from lifeline.bench.step_fit import nnls_subsets

TERMS = ("batch", "prefill_interference", "kv_context")
MIN_REQUESTS = 4


def features(view: RequestView) -> tuple[float, float, float] | None:
    state = view.state or {}
    n = view.output_tokens
    if state.get("batch_mean") is None or n < 2:
        return None
    others = max(state["batch_mean"] - 1.0, 0.0)
    prefill = (state.get("others_prefill_tokens") or 0.0) / (n - 1)
    context = state.get("context_mean") or 0.0
    return others, prefill, context


def refine(pairs: Sequence[tuple[RequestView, TpotSplit]],
           anchor: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """Re-split each request's `decode` part (ms per token) by the fit; returns the fit (its
    coefficients, which terms were confounded) or None when there is too little to fit.
    `anchor`: the bench's probes sent alone after the run (`lifeline.bench.anchor`): their TPOT
    is the base, measured, and the fit prices only what the run adds to it."""
    rows = [(view, split, x) for view, split in pairs
            if (x := features(view)) is not None and split.parts.get("decode", 0) > 0]
    if len(rows) < MIN_REQUESTS:
        return None
    for view, split, _ in rows:
        # a stream that stood still while the server preempted: waiting and recomputing
        stalled = (view.state.get("preempted_ms") or 0.0) / max(view.output_tokens - 1, 1)
        stalled = min(stalled, split.parts["decode"])
        split.parts["decode"] -= stalled
        split.parts["queue"] = split.parts.get("queue", 0.0) + stalled
        split.facts["preempted_ms"] = view.state.get("preempted_ms")
    x = np.array([[1.0, *f] for _, _, f in rows])
    y = np.array([split.parts["decode"] for _, split, _ in rows])
    varied = [j for j in range(1, 4) if np.ptp(x[:, j]) > 1e-6 * max(abs(x[:, j]).max(), 1.0)]
    coef = np.zeros(4)
    base = (anchor or {}).get("tpot_ms")
    if base is not None and 0 < base < float(y.mean()):
        coef[0] = base
        others = [j for j in range(1, 4) if j in varied or (j == 1 and np.all(x[:, 1] > 0))]
        if others:
            sol, _ = nnls_subsets(x[:, others], y - base)
            coef[others] = sol
        varied = others
    elif varied:
        sol, _ = nnls_subsets(x[:, [0, *varied]], y)
        coef[[0, *varied]] = sol
    else:
        coef[0] = float(y.mean())
    fit = {"base_ms": float(coef[0]), "per_other_running_ms": float(coef[1]),
           "per_other_prefill_token_ms": float(coef[2]), "per_context_token_ms": float(coef[3]),
           "requests": len(rows), "base_from": "probes alone" if base is not None and
           coef[0] == base else "fit",
           "confounded": [TERMS[j - 1] for j in range(1, 4) if j not in varied]}
    for view, split, f in rows:
        own = {"decode": coef[0], "batch": coef[1] * f[0],
               "prefill_interference": coef[2] * f[1], "kv_context": coef[3] * f[2]}
        predicted = sum(own.values())
        actual = split.parts["decode"]
        scale = actual / predicted if predicted > 0 else 0.0
        split.parts["decode"] = 0.0 if predicted > 0 else actual
        for cause, ms in own.items():
            split.parts[cause] += ms * scale
        state = view.state or {}
        split.facts.update({"rows_mean": state.get("batch_mean"),
                            "rows_max": state.get("running_max"),
                            "others_prefill_tokens": state.get("others_prefill_tokens"),
                            "context_first": state.get("context_first"),
                            "context_last": state.get("context_last"),
                            "server_preemptions": state.get("preemptions_during"),
                            "state_fit": fit})
    return fit
