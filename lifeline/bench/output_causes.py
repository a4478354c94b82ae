"""One request's TPOT split by cause, exactly: the stream's delivery (client and network) and
the server's time between its first and last token, spread over the request's decode steps by
the run's step-cost fit of step periods (`lifeline.bench.step_fit`):

- decode: the step as if the request were alone at no context (a + b);
- batch: the other requests sharing the step (b per other row, and d × their context);
- prefill_interference: other requests' prefill chunks in the step (c × tokens), and steps
  that left the request out while others' prefill took the token budget;
- kv_context: attending over its own context (d × its context);
- queue: time preempted (waiting, then recomputing its tokens).

What the fit does not explain of the request's own steps (the engine's work between steps,
noise) is spread over the causes in proportion."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lifeline.bench.request_view import RequestView
from lifeline.bench.step_fit import StepCost, StepShape
from lifeline.bench.step_index import StepIndex

OUTPUT_CAUSES = ("client_network", "decode", "batch", "prefill_interference", "kv_context",
                 "queue")


@dataclass(slots=True)
class TpotSplit:
    """Milliseconds per output token by cause (summing to the request's TPOT) and facts."""

    parts: dict[str, float]
    facts: dict[str, Any] = field(default_factory=dict)


def split_tpot(view: RequestView, index: StepIndex | None) -> TpotSplit | None:
    """None without a TPOT (fewer than two tokens)."""
    n = view.output_tokens
    if view.tpot_ms is None or n < 2:
        return None
    window = view.tpot_ms * (n - 1)
    server = view.decode_window_ms()
    parts = dict.fromkeys(OUTPUT_CAUSES, 0.0)
    facts: dict[str, Any] = {"tpot_ms": view.tpot_ms, "tokens": n}
    if server is None:
        parts["decode"] = window
    else:
        parts["client_network"] = window - server
        facts["server_tpot_ms"] = server / (n - 1)
        steps = _decode_steps(view, index)
        if steps and index is not None and index.cost is not None:
            _attribute(parts, facts, steps, index, index.cost, server)
        else:
            parts["decode"] = server
    facts.update(_timing_facts(view))
    return TpotSplit({k: v / (n - 1) for k, v in parts.items()}, facts)


def _decode_steps(view: RequestView, index: StepIndex | None
                  ) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """The request's steps after its first token (decodes, and prefill recomputed after a
    preemption); the step of the first token is part of TTFT."""
    entries = index.of_request(view.id) if index else []
    first = next((i for i, (_, e) in enumerate(entries)
                  if e.get("kind") == "prefill" and e.get("sampled")), None)
    return entries[first + 1:] if first is not None else []


def _attribute(parts: dict[str, float], facts: dict[str, Any],
               steps: list[tuple[dict[str, Any], dict[str, Any]]], index: StepIndex,
               cost: StepCost, server_ms: float) -> None:
    own = dict.fromkeys(("decode", "batch", "prefill_interference", "kv_context"), 0.0)
    recompute = 0.0
    rows, contexts, others_context, with_prefill, others_prefill = [], [], [], 0, 0
    for step, entry in steps:
        if entry.get("kind") != "decode":
            recompute += index.period(step)
            continue
        shape = StepShape.of(step)
        ctx = int(entry.get("context") or 0)
        own["decode"] += cost.base_ms + cost.row_ms
        own["batch"] += (cost.row_ms * (shape.decode_rows - 1)
                         + cost.context_token_ms * (shape.decode_context - ctx))
        own["prefill_interference"] += cost.prefill_token_ms * shape.prefill_tokens
        own["kv_context"] += cost.context_token_ms * ctx
        rows.append(shape.decode_rows)
        contexts.append(ctx)
        others_context.append(shape.decode_context - ctx)
        with_prefill += shape.prefill_tokens > 0
        others_prefill += shape.prefill_tokens
    left_out, preempted = _left_out(steps, index)
    actual = server_ms - left_out - preempted - recompute
    predicted = sum(own.values())
    scale = actual / predicted if predicted > 0 else 0.0
    for cause, ms in own.items():
        parts[cause] += ms * scale
    if predicted <= 0:
        parts["decode"] += actual
    parts["prefill_interference"] += left_out
    parts["queue"] += preempted + recompute
    facts.update({"decode_steps": len(rows), "rows_mean": _mean(rows), "rows_max": max(rows,
                  default=None), "context_first": contexts[0] if contexts else None,
                  "context_last": contexts[-1] if contexts else None,
                  "others_context": _mean(others_context),
                  "steps_with_prefill": with_prefill, "others_prefill_tokens": others_prefill,
                  "left_out_ms": left_out, "preempted_ms": preempted + recompute,
                  "explained": predicted / actual if actual > 0 else None})


def _left_out(steps: list[tuple[dict[str, Any], dict[str, Any]]], index: StepIndex
              ) -> tuple[float, float]:
    """Time of the steps between the request's own ones that left it out: while preempted
    (it was in the step's `preempted` list), or while running but out of the token budget."""
    left_out = preempted = 0.0
    rid = steps[0][1].get("id")
    waiting = False
    for (a, _), (b, _) in zip(steps, steps[1:]):
        waiting = waiting or rid in (a.get("preempted") or ())
        for step in index.between(a["step"], b["step"]):
            waiting = waiting or rid in (step.get("preempted") or ())
            if waiting:
                preempted += index.period(step)
            else:
                left_out += index.period(step)
        waiting = False
    return left_out, preempted


def _timing_facts(view: RequestView) -> dict[str, Any]:
    raw = view.backend_raw()
    steps = raw.get("steps") if isinstance(raw.get("steps"), dict) else {}
    return {"kv_bytes_read_per_token": raw.get("kv_bytes_read_per_token"),
            "decode_batch": steps.get("decode_batch"), "decode_context": steps.get(
                "decode_context"), "preemptions": raw.get("preemptions")}


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None
