"""Each cause's finding in words: a title with its number, the evidence that shows it, and what
usually fixes it; the numbers again, machine-readable."""
from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from lifeline.bench.step_index import StepIndex

Written = tuple[str, str, str, dict[str, Any]]


@dataclass(slots=True)
class Context:
    """What the run as a whole says, beside its requests."""

    text: dict[str, Any] | None
    """The workload text's token cost (`lifeline.bench.text_cost.text_stats`)."""
    index: StepIndex | None
    client_lag_ms: dict[str, Any] | None
    plan: bool
    state_fit: dict[str, Any] | None = None
    """The output's fit over requests from the server's sampled state (no step log)."""
    anchor: dict[str, Any] | None = None
    """The bench's probes sent alone after the run (`lifeline.bench.anchor`)."""


@dataclass(slots=True)
class CauseFacts:
    section: str
    """`ttft`, `output` or `answer`."""
    cause: str
    ms: float
    share: float
    facts: Sequence[dict[str, Any]]
    """Per request."""
    parts: Sequence[dict[str, float]]
    """Per request: ms by cause."""

    def mean(self, key: str) -> float | None:
        values = [f[key] for f in self.facts if isinstance(f.get(key), int | float)]
        return sum(values) / len(values) if values else None

    def mean_part(self, part: str, key: str = "computed_parts") -> float | None:
        values = [f[key].get(part, 0) for f in self.facts if f.get(key)]
        return sum(values) / len(values) if values else None

    def lead(self) -> str:
        unit = "ms per token" if self.section == "output" else "ms"
        whole = {"ttft": "TTFT", "output": "TPOT", "answer": "TTFAT"}[self.section]
        digits = 2 if self.section == "output" and self.ms < 10 else 0 if self.ms >= 10 else 1
        return f"{self.ms:,.{digits}f} {unit} ({self.share:.0%} of {whole})"


def write_finding(c: CauseFacts, ctx: Context) -> Written:
    writer = WRITERS.get((c.section if c.section == "output" else "ttft", c.cause))
    if writer is None:
        return f"{c.cause.replace('_', ' ')}: {c.lead()}", "", "", {}
    return writer(c, ctx)


# --- TTFT -------------------------------------------------------------------------------------

def _client_network(c: CauseFacts, ctx: Context) -> Written:
    connects = [f["connect_ms"] for f in c.facts if f.get("connect_ms") is not None]
    fresh = [x for x in connects if x > 0]
    lag = (ctx.client_lag_ms or {}).get("p90")
    bits = ["the client's TTFT less the server's (from its arrival to its first token)"]
    if connects:
        bits.append(f"{len(fresh)} of {len(connects)} requests opened a connection"
                    + (f" (set-up {sum(fresh) / len(fresh):,.1f} ms on average)" if fresh else ""))
    if lag is not None:
        bits.append(f"the client sent requests {lag:,.1f} ms after they were due (p90)")
    numbers = {"connect_ms_mean": sum(fresh) / len(fresh) if fresh else 0.0,
               "new_connections": len(fresh), "requests": len(connects),
               "client_lag_p90_ms": lag}
    return (f"client and network: {c.lead()} outside the server", "; ".join(bits) + ".",
            "keep connections alive and the client close to the server; a client that reads its "
            "stream late or lags its schedule (a saturated client) shows here, as does the "
            "network", numbers)


def _front(c: CauseFacts, ctx: Context) -> Written:
    sampled = [f for f in c.facts if f.get("front_from") == "histogram"]
    if sampled and len(sampled) * 2 >= len(c.facts):
        engine = sampled[0].get("engine") or "the server"
        return (f"front: {c.lead()} in {engine} before its engine queued the request",
                f"{engine}'s own histograms over the run: its TTFT (from its arrival) less its "
                "queue and prefill time; the HTTP handling, the chat template and tokenizer, "
                "and the hand-off from its API server to its engine.",
                "an API server starved of CPU by the engine shows here (vLLM on few cores: "
                "--api-server-count, or cores for the frontend); long prompts and templates "
                "cost here too", {"from": "histogram", "engine": engine})
    parts = {k: c.mean(k) for k in ("gateway", "template", "tokenize")}
    known = {k: v for k, v in parts.items() if v is not None}
    evidence = ", ".join(f"{k} {v:,.1f} ms" for k, v in known.items()) or \
        "the server's arrival to its queue"
    return (f"front: {c.lead()} in HTTP handling, the chat template and the tokenizer",
            evidence + ".",
            "long prompts or templates cost here; so does an event loop kept busy (many "
            "streams on one server process)", {f"{k}_ms": v for k, v in parts.items()})


QUEUE_KNOBS: dict[str, dict[str, tuple[str, str]]] = {
    # engine -> limit -> (why, the engine's own knob as the fix)
    "llama.cpp": {
        "slots": ("all {cap} of llama.cpp's slots were busy and requests were deferred",
                  "more parallel slots (-np; each slot gets -c / -np of the context, so raise -c "
                  "with it), lower the concurrency, or add replicas"),
        "kv_cache": ("the slots' KV cache was full",
                     "a larger context (-c), or fewer parallel slots sharing it (-np)"),
    },
    "vllm": {
        "max_num_seqs": ("{cap} sequences were running (vLLM's --max-num-seqs) while requests "
                         "waited",
                         "raise --max-num-seqs if the KV cache allows it "
                         "(--gpu-memory-utilization; VLLM_CPU_KVCACHE_SPACE on the CPU), lower "
                         "the concurrency, or add replicas"),
        "kv_cache": ("vLLM's KV cache had no room for another prompt ({kv:.0%} in use)",
                     "more KV memory (--gpu-memory-utilization; VLLM_CPU_KVCACHE_SPACE on the "
                     "CPU), a shorter --max-model-len, prefix caching, or add replicas"),
        "token_budget": ("fewer than {cap} sequences ran while requests waited: each step's "
                         "token budget was spent on prefill",
                         "raise --max-num-batched-tokens, or lower the load"),
    },
    "sglang": {
        "max_running_requests": ("{cap} requests were running (--max-running-requests) "
                                 "while requests waited",
                                 "raise --max-running-requests if the KV pool allows, or add "
                                 "replicas"),
        "kv_cache": ("SGLang's token pool was full ({kv:.0%} in use)",
                     "more KV memory (--mem-fraction-static), shorter contexts, or add "
                     "replicas"),
        "token_budget": ("fewer than {cap} requests ran while requests waited: the prefill "
                         "budget was spent",
                         "raise --chunked-prefill-size / --max-prefill-tokens, or lower the "
                         "load"),
    },
}


def _queue(c: CauseFacts, ctx: Context) -> Written:
    infos = [f.get("queue_info") or {} for f in c.facts]
    limits = Counter(i.get("limit") for i in infos if i.get("limit"))
    limit = limits.most_common(1)[0][0] if limits else None
    ahead = _mean_of(infos, "ahead_prefill_tokens")
    running = _mean_of(infos, "running_at_arrival")
    max_seqs = next((i["max_num_seqs"] for i in infos if i.get("max_num_seqs")), None)
    preemptions = sum(f.get("preemptions") or 0 for f in c.facts)
    recomputed = sum(f.get("recomputed_tokens") or 0 for f in c.facts)
    engine = next((i["engine"] for i in infos if i.get("engine")), None)
    knobs = QUEUE_KNOBS.get(engine or "", {}).get(limit or "")
    if knobs is not None:
        kv = _mean_of(infos, "kv_usage_at_arrival") or 0.0
        why = knobs[0].format(running=f"{running or max_seqs or 0:,.0f}", cap=max_seqs or "?",
                              kv=kv)
        fix = knobs[1]
    elif limit == "max_num_seqs" or (limit is None and running and max_seqs
                                     and running >= max_seqs):
        why = f"{running:,.0f} of {max_seqs} sequences were running (max_num_seqs)"
        fix = ("the engine is at its batch limit: raise max_num_seqs if the KV cache allows, "
               "lower the concurrency, or add replicas")
    elif limit == "kv_cache":
        why = "the KV cache was full"
        fix = ("the KV cache is the limit: give it more memory (kv_cache_memory_bytes), "
               "shorter contexts, prefix caching, or add replicas")
    elif limit == "token_budget":
        why = "each step's token budget was spent (max_num_batched_tokens)"
        fix = "raise max_num_batched_tokens, or lower the load"
    elif ahead:
        why = f"behind another request's prefill chunk of {ahead:,.0f} tokens"
        fix = ("a step holding a long prefill chunk delays everyone's next step: a smaller "
               "max_num_batched_tokens splits it finer")
    else:
        why = "the server was busy"
        fix = "lower the concurrency or rate, or add replicas"
    title = (f"waited {c.ms:,.0f} ms behind another request's prefill chunk of {ahead:,.0f} "
             f"tokens" if limit is None and ahead else f"queue: {c.lead()}: {why}")
    steps = _mean_of(infos, "steps_waited")
    evidence = [why]
    sampled = [i for i in infos if i.get("from") == "server_state"]
    if sampled:
        seen = _mean_of(sampled, "waiting_seen_ms")
        waiting = _mean_of(sampled, "waiting_at_arrival")
        evidence.append(f"the server's own metrics showed requests waiting for {seen or 0:,.0f}"
                        f" ms of each request's wait on average ({waiting or 0:,.1f} waiting "
                        "when a request arrived)")
    if steps is not None:
        evidence.append(f"{steps:,.1f} steps waited on average")
    if limits:
        evidence.append("limits: " + ", ".join(f"{k} {n}" for k, n in limits.most_common()))
    if preemptions:
        evidence.append(f"{preemptions} preemptions recomputed {recomputed:,} tokens")
    server_preempted = max((f.get("server_preemptions") or 0 for f in c.facts), default=0)
    if server_preempted and not preemptions:
        evidence.append(f"the server preempted requests during the run ({server_preempted:,.0f}"
                        " in one request's life at most)")
    return (title, "; ".join(evidence) + ".", fix,
            {"limit": limit, "limits": dict(limits), "running_at_arrival": running,
             "max_num_seqs": max_seqs, "ahead_prefill_tokens": ahead, "steps_waited": steps,
             "preemptions": preemptions, "recomputed_tokens": recomputed, "engine": engine})


def _prefill(c: CauseFacts, ctx: Context) -> Written:
    prompt, cached = c.mean("prompt_tokens"), c.mean("cached_tokens")
    computed = c.mean("computed_tokens")
    if computed is None and prompt is not None:
        computed = prompt - (cached or 0)
    own = c.mean("own_prefill_ms")
    speed = computed / own * 1e3 if computed and own else None
    chunks = c.mean("chunks")
    bits = []
    if prompt is not None:
        bits.append(f"{prompt:,.0f} prompt tokens, {cached or 0:,.0f} from the prefix cache, "
                    f"{computed or 0:,.0f} computed")
    if speed:
        bits.append(f"at {speed:,.0f} tokens/s")
    if chunks:
        bits.append(f"in {chunks:,.1f} chunks")
    return (f"prefill: {c.lead()} computing the prompt", ", ".join(bits) + "." if bits else "",
            "shorter prompts, prefix caching for what repeats, a larger prefill budget per step "
            "(max_num_batched_tokens), or faster hardware",
            {"prompt_tokens": prompt, "cached_tokens": cached, "computed_tokens": computed,
             "prefill_tok_s": speed, "chunks": chunks})


ASSEMBLY_FIX = {
    "system": "cache it (prefix caching, one system prompt shared by every request) or shorten "
              "it",
    "tools": "send only the tools the request needs, shorten their schemas, or cache them",
    "history": "keep the history's prefix unchanged between turns so the prefix cache serves "
               "it; summarise or drop old turns",
    "template": "a template with less scaffolding per message",
}


def _prompt_assembly(c: CauseFacts, ctx: Context) -> Written:
    parts = {p: c.mean_part(p, "anatomy") or 0.0
             for p in ("system", "tools", "history", "template", "latest_user")}
    computed = {p: c.mean_part(p) or 0.0 for p in ("system", "tools", "history", "template")}
    total = sum(parts.values()) or 1.0
    part = max(computed, key=computed.__getitem__)
    name = {"system": "system prompt", "tools": "tool definitions", "history": "history",
            "template": "template's scaffolding"}[part]
    title = (f"the {name} is {parts[part] / total:.0%} of the prompt ({parts[part]:,.0f} of "
             f"{total:,.0f} tokens) and {c.ms:,.0f} ms of TTFT ({c.share:.0%}) is the prefill "
             "of what the template added")
    evidence = ("prompt tokens by origin: " + ", ".join(f"{p} {n:,.0f}" for p, n in parts.items())
                + "; computed (not cached): " + ", ".join(f"{p} {n:,.0f}"
                                                          for p, n in computed.items()))
    growth = _history_growth(c.facts)
    if growth is not None:
        evidence += (f"; the history grows {growth['per_turn']:,.0f} tokens a turn (turn 1: "
                     f"{growth['first']:,.0f}, turn {growth['turns']}: {growth['last']:,.0f})")
    return (title, evidence + ".", ASSEMBLY_FIX[part],
            {"dominant": part, "parts": parts, "computed": computed,
             "dominant_fraction": parts[part] / total, "history_growth": growth})


def _history_growth(facts: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    by_turn: dict[int, list[float]] = {}
    for f in facts:
        anatomy = f.get("anatomy")
        if isinstance(anatomy, dict):
            by_turn.setdefault(int(f.get("turn") or 0), []).append(anatomy.get("history") or 0)
    if len(by_turn) < 2:
        return None
    turns = sorted(by_turn)
    means = [sum(by_turn[t]) / len(by_turn[t]) for t in turns]
    return {"turns": turns[-1] + 1, "first": means[0], "last": means[-1],
            "per_turn": (means[-1] - means[0]) / (turns[-1] - turns[0])}


def _tokenizer(c: CauseFacts, ctx: Context) -> Written:
    text = ctx.text or {}
    ratio, chars = text.get("ratio"), text.get("chars") or 0
    per_char = text["tokens"] / chars if chars else None
    per_word = text["tokens"] / text["words"] if text.get("words") else None
    scripts = ", ".join(f"{s} {v:.0%}" for s, v in list((text.get("scripts") or {}).items())[:3])
    title = (f"the tokenizer spends {ratio:.1f}× the tokens of the reference on this text "
             f"({per_char:.2f} tokens per character): {c.lead()}")
    evidence = [f"{text.get('tokens', 0):,} tokens for {chars:,} characters ({scripts}); the "
                f"reference ({text.get('reference')}) spends "
                f"{text.get('reference_tokens', 0):,.0f}"]
    if per_word is not None:
        evidence.append(f"{per_word:.2f} tokens per word")
    if text.get("english_tokens_per_char") is not None:
        english, reference = (text["english_tokens_per_char"],
                              text["english_reference_tokens_per_char"])
        evidence.append(f"English costs {english:.2f} tokens per character on this tokenizer "
                        f"({reference:.2f} on the reference)")
    return (title, "; ".join(evidence) + ".",
            "a model whose vocabulary was trained on this language or script; the extra tokens "
            "cost prefill, KV cache and output speed alike",
            {"ratio": ratio, "tokens_per_char": per_char, "tokens_per_word": per_word,
             "reference_tokens": text.get("reference_tokens"), "tokens": text.get("tokens")})


def _ttft_interference(c: CauseFacts, ctx: Context) -> Written:
    chunks = sorted(f["largest_other_chunk"] for f in c.facts if f.get("largest_other_chunk"))
    chunk = chunks[len(chunks) // 2] if chunks else 0
    others = c.mean("others_tokens")
    title = f"other requests' work in the same prefill steps: {c.lead()}"
    if chunk:
        title += (f"; waited {c.ms:,.0f} ms behind another request's prefill chunk of "
                  f"{chunk:,} tokens")
    evidence = (f"its prefill steps also carried {others:,.0f} tokens of other requests on "
                "average" if others else "steps between its chunks ran other requests")
    return (title, evidence + ".",
            "a smaller max_num_batched_tokens interleaves long prefills with the others' steps; "
            "long prompts on their own replicas (prefill/decode disaggregation)",
            {"largest_other_chunk": chunk, "others_tokens": others})


def _reasoning(c: CauseFacts, ctx: Context) -> Written:
    tokens = c.mean("reasoning_tokens")
    server = c.mean("server_reasoning_ms")
    tpot = c.mean("tpot_ms")
    title = (f"the model thought for {tokens:,.0f} tokens before its answer: " if tokens else
             "thinking before the answer: ") + c.lead()
    evidence = ["the client's first answer token less its first token"]
    if server is not None:
        evidence.append(f"the server measured {server:,.0f} ms")
    if tokens and tpot:
        evidence.append(f"{tokens:,.0f} thinking tokens at {tpot:,.1f} ms per token")
    return (title, "; ".join(evidence) + ".",
            "a thinking budget or lower reasoning effort, thinking off where latency matters, "
            "or a faster TPOT", {"reasoning_tokens": tokens, "server_reasoning_ms": server})


# --- output -----------------------------------------------------------------------------------

def _out_client(c: CauseFacts, ctx: Context) -> Written:
    client, server = c.mean("tpot_ms"), c.mean("server_tpot_ms")
    return (f"stream delivery: {c.lead()}",
            f"the client saw a token every {client:,.2f} ms, the server made one every "
            f"{server:,.2f} ms.",
            "a client that reads its stream slowly (or a slow network) holds tokens the server "
            "already made; read the stream promptly, nearer the server",
            {"client_tpot_ms": client, "server_tpot_ms": server})


def _decode(c: CauseFacts, ctx: Context) -> Written:
    cost = ctx.index.cost if ctx.index else None
    if cost is None and ctx.state_fit:
        fit = ctx.state_fit
        kept = ", ".join(t.replace("_", " ") for t in fit["confounded"])
        return (f"decode: {c.lead()} in the server's decode steps at the run's own load",
                f"fit over {fit['requests']} requests of the server's time per token: "
                f"{fit['base_ms']:,.2f} ms"
                + (" (measured: short probes sent alone after the run)"
                   if fit.get("base_from") == "probes alone" else "")
                + f" + {fit['per_other_running_ms']:,.3f} ms per other "
                f"request running + {fit['per_other_prefill_token_ms']:,.4f} ms per other "
                f"request's prefill token + {fit['per_context_token_ms']:,.5f} ms per context "
                "token" + (f"; {kept} never varied in the run, so its cost is in this base"
                           if kept else "") + ".",
                "the weights read each step: a smaller or quantized model, faster hardware or "
                "kernels; a run at one user measures the step alone", {"state_fit": fit})
    if cost is None:
        return (f"decode: {c.lead()} in the server's decode steps (not split further)",
                "without a step log the decode steps are not split by cause.",
                "a smaller or quantized model, faster hardware, a compiled engine", {})
    alone = cost.base_ms + cost.row_ms
    return (f"the model's own step: {c.lead()}; alone at no context a step takes {alone:,.2f} ms "
            f"({1e3 / alone if alone else 0:,.0f} tokens/s)",
            f"fit over {cost.steps:,} steps: {cost.base_ms:,.3f} ms a step + {cost.row_ms:,.3f} "
            f"ms a decode + {cost.prefill_token_ms:,.4f} ms a prefill token + "
            f"{cost.context_token_ms:,.5f} ms a context token"
            + (f" (R² {cost.r2:.2f})" if cost.r2 is not None else "") + ".",
            "the weights read each step: a smaller or quantized model, faster hardware or "
            "kernels (a compiled engine, CUDA graphs)", {"fit": cost.as_dict(),
                                                           "alone_step_ms": alone})


def _batch(c: CauseFacts, ctx: Context) -> Written:
    rows, top = c.mean("rows_mean"), max((f.get("rows_max") or 0 for f in c.facts), default=0)
    cost = ctx.index.cost if ctx.index else None
    alone = cost.base_ms + cost.row_ms if cost else None
    fit = ctx.state_fit if cost is None else None
    title = (f"{rows:,.1f} requests shared each decode step: {c.lead()}" if rows else
             f"batch: {c.lead()}")
    evidence = f"up to {top} requests in a step"
    others = c.mean("others_context")
    if alone:
        evidence += (f"; a step alone takes {alone:,.2f} ms ({1e3 / alone:,.0f} tokens/s for "
                     f"one user), each other request adds {cost.row_ms:,.3f} ms")
        if others:
            evidence += (f" and their {others:,.0f} tokens of context "
                         f"{cost.context_token_ms * others:,.2f} ms")
    elif fit:
        evidence = (f"the server's running requests averaged {rows or 0:,.1f} over each "
                    f"request's output (up to {top}); each other request running added "
                    f"{fit['per_other_running_ms']:,.3f} ms a token (fit over "
                    f"{fit['requests']} requests)")
    return (title, evidence + ".",
            "per-user speed traded for throughput: a lower max_num_seqs or concurrency for "
            "faster users, more replicas for both", {"rows_mean": rows, "rows_max": top,
                                                     "alone_step_ms": alone})


def _out_interference(c: CauseFacts, ctx: Context) -> Written:
    steps, with_prefill = c.mean("decode_steps"), c.mean("steps_with_prefill")
    tokens, left = c.mean("others_prefill_tokens"), c.mean("left_out_ms")
    evidence = (f"{with_prefill or 0:,.0f} of {steps or 0:,.0f} decode steps also carried "
                f"others' prefill ({tokens or 0:,.0f} tokens)")
    if left:
        evidence += f"; {left:,.0f} ms in steps that left it out for others' prefill"
    return (f"other requests' prefill in its decode steps: {c.lead()}", evidence + ".",
            "a smaller max_num_batched_tokens caps each step's prefill; separate prefill "
            "replicas (disaggregation) keep decodes steady",
            {"steps_with_prefill": with_prefill, "others_prefill_tokens": tokens,
             "left_out_ms": left})


def _kv_context(c: CauseFacts, ctx: Context) -> Written:
    first, last = c.mean("context_first"), c.mean("context_last")
    cost = ctx.index.cost if ctx.index else None
    kv = c.mean("kv_bytes_read_per_token")
    title = f"the context it attends over: {c.lead()}"
    evidence = f"context {first or 0:,.0f} to {last or 0:,.0f} tokens"
    numbers: dict[str, Any] = {"context_first": first, "context_last": last,
                               "kv_bytes_read_per_token": kv}
    if cost and last:
        short = cost.base_ms + cost.row_ms
        long = short + cost.context_token_ms * last
        growth = long / short if short else None
        numbers["step_growth"] = growth
        if growth:
            title = (f"TPOT grows with the context: {c.lead()}; a step at context {last:,.0f} "
                     f"takes {growth:.1f}× one at no context")
        evidence += f"; {cost.context_token_ms * 1e3:,.3f} µs a step per context token"
    if kv:
        evidence += f"; {kv / 1e6:,.1f} MB of KV read per step"
    return (title, evidence + ".",
            "shorter contexts (trim or summarise), a KV cache in fewer bytes (fp8), "
            "sliding-window or faster attention kernels", numbers)


def _out_queue(c: CauseFacts, ctx: Context) -> Written:
    preempt = sum(f.get("preemptions") or 0 for f in c.facts)
    server = max((f.get("server_preemptions") or 0 for f in c.facts), default=0)
    if not preempt and server:
        stalled = [f for f in c.facts if f.get("preempted_ms")]
        return (f"preempted mid-answer: {c.lead()} waiting and recomputing",
                f"the server counted {server:,.0f} preemptions during the run's requests; "
                f"{len(stalled)} of {len(c.facts)} streams stood still for more than "
                f"{5:g}× their usual token gap meanwhile.",
                "the KV cache ran out under load: more KV memory (vLLM: "
                "--gpu-memory-utilization, VLLM_CPU_KVCACHE_SPACE), a lower max_num_seqs, or "
                "shorter outputs", {"preemptions": server})
    return (f"preempted mid-answer: {c.lead()} waiting and recomputing",
            f"{preempt} preemptions.",
            "the KV cache ran out under load: more KV memory, a lower max_num_seqs, or shorter "
            "outputs", {"preemptions": preempt})


def _mean_of(items: Sequence[dict[str, Any]], key: str) -> float | None:
    values = [i[key] for i in items if isinstance(i.get(key), int | float)]
    return sum(values) / len(values) if values else None


WRITERS: dict[tuple[str, str], Callable[[CauseFacts, Context], Written]] = {
    ("ttft", "client_network"): _client_network, ("ttft", "front"): _front,
    ("ttft", "queue"): _queue, ("ttft", "prefill"): _prefill,
    ("ttft", "prompt_assembly"): _prompt_assembly, ("ttft", "tokenizer"): _tokenizer,
    ("ttft", "prefill_interference"): _ttft_interference, ("ttft", "reasoning"): _reasoning,
    ("output", "client_network"): _out_client, ("output", "decode"): _decode,
    ("output", "batch"): _batch, ("output", "prefill_interference"): _out_interference,
    ("output", "kv_context"): _kv_context, ("output", "queue"): _out_queue,
}
