"""Why is it slow: a ranked list of causes for TTFT and for the output's pace (TPOT), each with
its number, the evidence and what usually fixes it, from a bench run's results (the client's
clock, each request's server timings) and the server's step log.

The causes partition the time exactly. A request's TTFT is split by `ttft_causes`, its TPOT by
`output_causes`; a cause's `ms` is its mean over the requests and its `share` that mean over
the mean TTFT (TPOT), so the shares sum to 1 and the causes' ms to the mean. With thinking
tokens an `answer` section splits the time to the first answer token the same way, the thinking
as one more cause. What a server does not report (llama.cpp, vLLM) leaves causes out, and
`missing` says which and why."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from lifeline.bench.findings import CauseFacts, Context, write_finding
from lifeline.bench.output_causes import OUTPUT_CAUSES, TpotSplit, split_tpot
from lifeline.bench.request_view import RequestView
from lifeline.bench.state_causes import refine
from lifeline.bench.step_index import StepIndex
from lifeline.bench.ttft_causes import TTFT_CAUSES, TtftSplit, split_ttft


NEGLIGIBLE = 1e-4
"""A cause below this share of its section is left out (rounding, not a finding)."""


@dataclass(slots=True)
class Finding:
    """One cause of the time, with what shows it and what usually fixes it."""

    cause: str
    share: float
    """Of the mean TTFT (or TPOT, or TTFAT): the shares of a section sum to 1."""
    ms: float
    """Mean milliseconds per request (TTFT, TTFAT) or per output token (TPOT)."""
    title: str
    evidence: str
    fix: str
    numbers: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def diagnose(results: dict[str, Any], steps: Any = None) -> dict[str, Any]:
    """`summary["diagnoses"]` of bench-schema results: `steps` is the server's step log (a
    `/debug/steps` body or its records), by default the one the results hold."""
    log = steps if steps is not None else results.get("step_log")
    index = StepIndex.of(log)
    views = [RequestView.of_record(r) for r in results.get("requests", []) if r.get("ok")]
    summary = results.get("summary") or {}
    settings = results.get("settings") or {}
    ctx = Context(text=results.get("text_cost"), index=index,
                  client_lag_ms=summary.get("client_lag_ms"),
                  plan=str(settings.get("url", "")).startswith("plan://"),
                  anchor=results.get("anchor"))
    out = _sections(views, ctx, summary)
    out["missing"] = missing(views, ctx, results.get("diagnosis_notes") or [])
    failed = failures(results)
    if failed:
        out["failures"] = failed
    return out


CONTEXT_WORDS = ("context", "max_model_len", "maximum context length", "too long")
FAILURE_FIXES = {
    ("context", "llama.cpp"): "each of llama.cpp's slots holds -c / -np tokens: raise -c, lower "
                              "-np, or send shorter prompts",
    ("context", "vllm"): "raise --max-model-len if the KV cache allows it, or send shorter "
                         "prompts",
    ("context", None): "the prompt and max_tokens exceed the server's context: raise it, or "
                       "send shorter prompts",
    ("overload", None): "the server refused work it had no room for: lower the load, or raise "
                        "its limits (the queue's depth, the rate limit), or add replicas",
    ("other", None): "read the messages: the server refused these requests",
}


def failures(results: dict[str, Any]) -> list[dict[str, Any]]:
    """The run's failed requests grouped by what the server said, each with the knob that
    usually fixes it (a prompt past a llama.cpp slot's context is refused, not queued)."""
    failed = [r for r in results.get("requests") or () if not r.get("ok")]
    if not failed:
        return []
    engine = (results.get("server_state") or {}).get("engine")
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in failed:
        message = str(r.get("error_message") or "no message")[:200]
        groups.setdefault(message, []).append(r)
    out = []
    for message, group in sorted(groups.items(), key=lambda g: -len(g[1])):
        low = message.lower()
        kind = ("context" if any(w in low for w in CONTEXT_WORDS) else
                "overload" if any(w in low for w in ("429", "503", "overload", "busy"))
                else "other")
        fix = FAILURE_FIXES.get((kind, engine)) or FAILURE_FIXES[(kind, None)]
        prompts = [r.get("expected_prompt_tokens") for r in group
                   if r.get("expected_prompt_tokens")]
        out.append({"kind": kind, "count": len(group), "message": message,
                    "share": len(group) / len(results.get("requests") or [1]),
                    "prompt_tokens_mean": sum(prompts) / len(prompts) if prompts else None,
                    "fix": fix})
    return out


def diagnose_request(timings: dict[str, Any], steps: Any = None, *,
                     request_id: str | None = None,
                     text: dict[str, Any] | None = None) -> dict[str, Any]:
    """The same sections for one request seen by the server alone (`timings` as its response
    or `/debug/requests` carries them; `request_id` joins it to the step log). Its TTFT starts
    at the server's arrival and its TPOT runs to the last byte, so the stream's delivery is
    its `client_network`."""
    index = StepIndex.of(steps)
    request_id = request_id or timings.get("id") or _id_in_steps(timings, index)
    view = RequestView.of_timings(timings, request_id)
    ctx = Context(text=text, index=index, client_lag_ms=None, plan=False)
    out = _sections([view], ctx, {})
    out["missing"] = missing([view], ctx, ["no client clock: the network before the server's "
                                           "arrival is not seen"])
    return out


def _id_in_steps(timings: dict[str, Any], index: StepIndex | None) -> str | None:
    """The request's id found from its own prefill rows (step number and tokens): the step
    log names every request by id, the timings do not carry it."""
    rows = ((timings.get("steps") or {}).get("prefill")) or []
    if index is None or not rows:
        return None
    by_number = dict(zip(index.numbers, index.steps))
    for row in rows:
        step = by_number.get(row[0])
        if step is None:
            continue
        ids = [e.get("id") for e in step.get("requests") or ()
               if e.get("kind") == "prefill" and e.get("tokens") == row[1]
               and e.get("context") == row[2]]
        if len(ids) == 1:
            return ids[0]
    return None


def _sections(views: Sequence[RequestView], ctx: Context, summary: dict[str, Any]
              ) -> dict[str, Any]:
    ttft = [s for v in views if (s := split_ttft(v, ctx.index, ctx.text)) is not None]
    pairs = [(v, s) for v in views if (s := split_tpot(v, ctx.index)) is not None]
    if ctx.index is None:
        ctx.state_fit = refine(pairs, ctx.anchor)
    tpot = [s for _, s in pairs]
    out = {"ttft": {"ms_p50": _p50(summary, "ttft_ms", [s.facts["ttft_ms"] for s in ttft]),
                    "ms_mean": _mean([sum(s.parts.values()) for s in ttft]),
                    "findings": rank("ttft", ttft, TTFT_CAUSES, ctx)},
           "output": {"tpot_ms_p50": _p50(summary, "tpot_ms", [s.facts["tpot_ms"] for s in tpot]),
                      "tpot_ms_mean": _mean([sum(s.parts.values()) for s in tpot]),
                      "findings": rank("output", tpot, OUTPUT_CAUSES, ctx)}}
    answer = _answer(views, ctx, summary)
    if answer is not None:
        out["answer"] = answer
    return out


def rank(section: str, splits: Sequence[TtftSplit | TpotSplit], causes: Sequence[str],
         ctx: Context) -> list[dict[str, Any]]:
    """The causes' findings, largest first; causes with no time left out (their ms and shares
    are what rounding left: well under a hundredth of a percent)."""
    if not splits:
        return []
    total = _mean([sum(s.parts.values()) for s in splits])
    findings = []
    for cause in causes:
        ms = _mean([s.parts.get(cause, 0.0) for s in splits])
        if abs(ms) <= NEGLIGIBLE * abs(total):
            continue
        share = ms / total if total else 0.0
        facts = CauseFacts(section, cause, ms, share, [s.facts for s in splits],
                           [s.parts for s in splits])
        title, evidence, fix, numbers = write_finding(facts, ctx)
        findings.append(Finding(cause, share, ms, title, evidence, fix, numbers).as_dict())
    return sorted(findings, key=lambda f: -f["ms"])


def _answer(views: Sequence[RequestView], ctx: Context, summary: dict[str, Any]
            ) -> dict[str, Any] | None:
    """TTFAT as TTFT's causes plus the thinking before the answer, over requests that thought."""
    splits = []
    for view in views:
        if view.ttfat_ms is None or view.ttft_ms is None or view.ttfat_ms <= view.ttft_ms:
            continue
        split = split_ttft(view, ctx.index, ctx.text)
        if split is None:
            continue
        split.parts["reasoning"] = view.ttfat_ms - view.ttft_ms
        raw = view.backend_raw()
        split.facts.update({"ttfat_ms": view.ttfat_ms,
                            "reasoning_tokens": raw.get("reasoning_tokens"),
                            "server_reasoning_ms": _server_reasoning(raw),
                            "tpot_ms": view.tpot_ms})
        splits.append(split)
    if not splits:
        return None
    return {"ttfat_ms_p50": _p50(summary, "ttfat_ms", [s.facts["ttfat_ms"] for s in splits]),
            "ttfat_ms_mean": _mean([sum(s.parts.values()) for s in splits]),
            "findings": rank("answer", splits, ("reasoning", *TTFT_CAUSES), ctx)}


def _server_reasoning(raw: dict[str, Any]) -> float | None:
    if raw.get("ttfat_ms") is None or raw.get("ttft_ms") is None:
        return None
    return raw["ttfat_ms"] - raw["ttft_ms"]


def missing(views: Sequence[RequestView], ctx: Context, notes: Sequence[str]) -> list[str]:
    """What the data did not hold, and so which findings are absent or coarser."""
    out = list(notes)
    staged = [v for v in views if v.stages]
    if not staged:
        out.append("the server reported no stage timings: TTFT is not split (it all counts as "
                   "client and network) and TPOT is not split from the stream's delivery")
        return out
    sources = {str(v.stages.get("source")) for v in staged}
    joined = [v for v in staged if v.stages.get("queue_from") == "server_state"]
    if joined:
        engine = joined[0].state.get("engine")
        interval = joined[0].state.get("interval_s") or 0.0
        out.append(f"{engine} reports no queue time per request: a request's queue is the part "
                   "of its wait before prefill during which the server's own metrics showed "
                   f"requests waiting (sampled every {interval * 1e3:,.0f} ms, so a request's "
                   "queue is good to about one interval), less the wait of requests that found "
                   "a free slot; its front (HTTP, template, tokenizer) counts as client and "
                   "network")
        if any(v.state.get("prefill_from") == "histogram" for v in joined):
            out.append(f"{engine} reports no prefill time per request: each request's prefill "
                       "is the run's mean from the server's own histogram, scaled by its "
                       "prompt's length")
    elif "llama.cpp" in sources:
        out.append("llama.cpp reports no front or queue time: both count as client and network "
                   "(its /metrics was not sampled: start it with --metrics)")
    if "vllm" in sources and not joined:
        out.append("vLLM reports no template or tokenizer time, no prompt anatomy and no step "
                   "log: front is only its arrival-to-queue gap")
    if ctx.plan:
        out.append("a plan: its client and network is nil and its front is the deployment's "
                   "request overhead; it has no prompt text or anatomy")
    if not any(isinstance(v.backend_raw().get("prompt_anatomy"), dict) for v in staged):
        out.append("no prompt anatomy (completions prompts have none, or the server does not "
                   "report it): prompt assembly is not split out of prefill")
    if ctx.text is None:
        out.append("no prompt text was weighed: the tokenizer finding is unavailable")
    out += _step_log_missing(staged, ctx.index, ctx.state_fit)
    return out


def _step_log_missing(views: Sequence[RequestView], index: StepIndex | None,
                      fit: dict[str, Any] | None = None) -> list[str]:
    if index is None and fit is not None:
        names = {"batch": "the batch", "prefill_interference": "others' prefill",
                 "kv_context": "the context"}
        return ["no step log: the output is split by a fit over the run's requests of the "
                "server's sampled state (its running requests, others' prefill, the context), "
                "coarser than a step log"] + [
            f"{names[t]} never varied across the run's requests: its cost cannot be told from "
            "the base and counts as decode" for t in fit["confounded"]]
    if index is None:
        rows = any((v.backend_raw().get("steps") or {}).get("prefill") for v in views)
        return ["no step log: the output's batch, context and prefill-interference causes are "
                "not split (their time counts as decode)"
                + ("" if rows else "; nor is others' work in the prefill steps")]
    out = []
    if not any(index.of_request(v.id) for v in views):
        out.append("the step log holds none of the run's requests: their steps are not split")
    if index.dropped:
        out.append(f"the server's step log had let go of {index.dropped:,} steps of the run "
                   "(raise its step_log_size): requests in them are split coarser")
    if index.cost is None:
        out.append("too few steps to fit a step cost: the output is not split by cause")
    else:
        names = {"decode_rows": "the batch size", "prefill_tokens": "the prefill tokens per "
                 "step", "decode_context": "the decodes' context"}
        for term in index.cost.confounded:
            out.append(f"{names[term]} never varied apart from the rest during the run: its "
                       "cost cannot be told from the base step's and counts as decode")
    return out


def _p50(summary: dict[str, Any], key: str, values: list[float]) -> float | None:
    d = summary.get(key)
    if isinstance(d, dict) and d.get("p50") is not None:
        return d["p50"]
    values = sorted(values)
    return values[len(values) // 2] if values else None


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0
