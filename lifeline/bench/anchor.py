"""The step-cost fit's no-context anchor, measured in the run. The TPOT split prices a decode
step as `a + b·rows + c·prefill tokens + d·context` (`lifeline.bench.step_fit`), and the KV
context cause is `d` times the request's context. When every request of a run has a long
context (one user, 6,000-token prompts), the fit sees decodes only between 6,000 and 6,000 +
the output's tokens of context: a step at no context is then extrapolated over 6,000 tokens from
a range of a few dozen, and the fit is free to put the context's cost in the base step (the KV
context comes out small, or nil).

So after such a run, on a server that keeps a step log, the bench sends a few short probe
requests, one at a time: their decode steps, at a few dozen tokens of context, join the run's in
the step log the fit reads, and the no-context step is measured instead of extrapolated. The
probes are marked in the results (`anchor`) and left out of every number of the run; if they
fail, the diagnosis says the KV context is extrapolated."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lifeline.bench.client import BenchClient, BenchRequest
from lifeline.bench.load import RunResult
from lifeline.bench.metrics import request_metrics
from lifeline.bench.workloads import WORDS

PROBES = 3
"""Short requests sent one after another."""
PROBE_WORDS = 16
PROBE_TOKENS = 32
"""Each probe's output, pinned: 31 decode steps at a context of a few dozen tokens."""
PROBE_FIELDS = ("ok", "error", "ttft_ms", "e2e_ms", "tpot_ms", "prompt_tokens", "output_tokens")
"""What the results keep of each probe."""
NEAR_ZERO = 256
"""A run whose shortest context is at most this many tokens anchors its own fit."""


@dataclass(slots=True)
class Anchor:
    """What the probes measured (`results["anchor"]`: None when the run needed none) and what
    the diagnosis should say of them."""

    record: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)

    def mark(self, results: dict[str, Any]) -> dict[str, Any]:
        results["anchor"] = self.record
        return results


def contexts(result: RunResult) -> tuple[int, int] | None:
    """The shortest and the longest context the run's decodes attended over (a request decodes
    from its prompt's length to its prompt and output less one); None without a decode."""
    spans = []
    for sent in result.sent:
        trace = sent.trace
        prompt = trace.prompt_tokens or sent.request.prompt_tokens
        output = trace.output_tokens or sum(c.tokens for c in trace.chunks)
        if trace.error is None and prompt and output and output >= 2:
            spans.append((prompt, prompt + output - 1))
    if not spans:
        return None
    return min(a for a, _ in spans), max(b for _, b in spans)


def needs_anchor(span: tuple[int, int] | None) -> bool:
    """The contexts never came near zero: the shortest is over `NEAR_ZERO` and farther from
    zero than the range the run covered, so the fit would extrapolate further than it saw."""
    if span is None:
        return False
    shortest, longest = span
    return shortest > NEAR_ZERO and shortest > longest - shortest


def keeps_step_log(result: RunResult) -> bool:
    """A Lifeline server (or gateway) answered: only those keep the step log the probes join."""
    return any("gateway_ms" in (s.trace.timings_raw or {}) for s in result.sent)


def probe_requests() -> list[BenchRequest]:
    """Distinct short prompts (so none is served from another's prefix cache), output pinned
    whatever the run's `--no-pin-output`."""
    out = []
    for i in range(PROBES):
        words = " ".join(WORDS[(i * PROBE_WORDS + j) % len(WORDS)] for j in range(PROBE_WORDS))
        out.append(BenchRequest(words, PROBE_TOKENS, None,
                                {"ignore_eos": True, "min_tokens": PROBE_TOKENS}))
    return out


def most_in_flight(result: RunResult) -> int:
    """The most measured requests in flight at once (from the client's clock)."""
    events = sorted([(s.trace.sent, 1) for s in result.sent if s.trace.done]
                    + [(s.trace.done, -1) for s in result.sent if s.trace.done])
    most = now = 0
    for _, step in events:
        now += step
        most = max(most, now)
    return most


async def measure_anchor(client: BenchClient, result: RunResult) -> Anchor:
    """Probe the server after `result`'s run when its contexts never came near zero, or, on a
    server without a step log, when no request ran alone (the fit over the run's requests
    would extrapolate the step alone from batches of several)."""
    span = contexts(result)
    if span is None:
        return Anchor()
    if keeps_step_log(result):
        if not needs_anchor(span):
            return Anchor()
    elif not needs_anchor(span) and most_in_flight(result) <= 1:
        return Anchor()
    shortest, longest = span
    if not keeps_step_log(result) and not needs_anchor(span):
        why = ("no request of the run ran alone on this server (it keeps no step log): short "
               "probes, sent one at a time after the run, measure the step alone")
    else:
        why = None
    probes = []
    for req in probe_requests():
        trace = await client.send(req)
        m = request_metrics(trace)
        probes.append({"id": trace.response_id, **{k: v for k, v in m.scalars().items()
                                                    if k in PROBE_FIELDS}})
    tpots = [p["tpot_ms"] for p in probes if p["ok"] and p["tpot_ms"] is not None]
    record = {"why": why or f"the run's decodes attended over {shortest:,} to {longest:,} "
                            "tokens of context, never near zero: short probes, sent one at a "
                            "time after the run, anchor the step fit's no-context step",
              "context_min": shortest, "context_max": longest, "probes": probes,
              "tpot_ms": sum(tpots) / len(tpots) if tpots else None}
    if tpots:
        return Anchor(record)
    errors = ", ".join(sorted({p["error"] or "no output" for p in probes}))
    note = (f"the run's decodes attended over {shortest:,} to {longest:,} tokens of context and "
            f"the short probes that anchor the no-context step failed ({errors}): the KV context "
            "cause is extrapolated from long contexts only and may be far too small")
    return Anchor(record, [note])
