"""One benchmark run: build the workload, drive the load, measure, summarise into the JSON
results whose schema docs/bench.md documents."""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from typing import Any

import httpx

from lifeline.bench import conversation
from lifeline.bench.anchor import measure_anchor
from lifeline.bench.client import BenchClient, BenchRequest
from lifeline.bench.diagnose import diagnose
from lifeline.bench.load import LoadPlan, RunResult, Sent, run_load
from lifeline.bench.metrics import Slo, distribution, request_metrics, summarize
from lifeline.bench.server_join import join
from lifeline.bench.server_state import INTERVAL_S, ServerSampler, server_info
from lifeline.bench.stages import breakdown, ttft_split
from lifeline.bench.step_fit import fit_steps
from lifeline.bench.step_index import fetch_steps
from lifeline.bench.text_cost import reference, sample_texts, text_stats
from lifeline.bench.verdict import verdict
from lifeline.bench.workloads import (
    Lengths,
    Tokenizer,
    cycle,
    jsonl_requests,
    pick_tokenizer,
    random_requests,
)

SCHEMA = "lifeline.bench/1"
DISTINCT_PROMPTS = 256
"""Prompts generated for a duration-bound run, then repeated."""


@dataclass(slots=True)
class BenchSettings:
    """Everything that defines a run; recorded in the results as `settings`."""

    url: str
    model: str | None = None
    endpoint: str = "completions"
    concurrency: int | None = None
    rate: float | None = None
    burstiness: float = 1.0
    requests: int | None = None
    duration_s: float | None = None
    warmup: int = 1
    think_time_s: float = 0.0
    ramp_up_s: float = 0.0
    turns: int = 1
    input_tokens: int = 128
    output_tokens: int = 128
    length_dist: str = "fixed"
    length_spread: float = 0.0
    length_file: str | None = None
    prefix_groups: int = 0
    prefix_tokens: int = 0
    dataset: str | None = None
    tokenizer: str | None = None
    pin_output: bool = True
    exact_tokens: bool = False
    """Ask for logprobs so every event says how many tokens it carries."""
    long_context: bool = False
    """Make prompts fill the server's context, less the output and a margin for specials."""
    slo: str | None = None
    slo_attainment: float = 0.9
    seed: int = 0
    timeout_s: float = 600.0
    images: int = 0
    """Synthetic images (deterministic PNG `data:` URLs, distinct per request) in each chat
    request, after its text."""
    image_size: str = "512x512"
    api_key: str | None = None
    admin_key: str | None = None
    """Sent to read the server's step log (`/debug/steps`) when its API keys guard it."""
    extra_body: dict[str, Any] | None = None
    """More fields for every request's body (an engine's own: llama.cpp's `cache_prompt`,
    vLLM's `priority`)."""
    server_metrics: str = "auto"
    """The server's Prometheus metrics to sample during the run: `auto` (its `/metrics`, and
    llama.cpp's `/slots`, where they answer), a URL, or `off`."""
    server_metrics_interval_s: float = INTERVAL_S

    def __post_init__(self) -> None:
        if not 0.01 <= self.server_metrics_interval_s <= 10:
            raise ValueError("--server-metrics-interval is 0.01 to 10 seconds")
        if self.server_metrics not in ("auto", "off") and not self.server_metrics.startswith(
                ("http://", "https://")):
            raise ValueError("--server-metrics is auto, off or an http(s) URL")
        if self.requests is None and self.duration_s is None:
            self.requests = 100
        if self.rate is None and self.concurrency is None:
            self.concurrency = 1
        if self.turns > 1 and self.endpoint != "chat":
            raise ValueError("multi-turn sessions (--turns) need --endpoint chat")
        if self.prefix_groups and self.prefix_tokens >= self.input_tokens:
            raise ValueError("the shared prefix must be shorter than the input")
        if self.images:
            if self.endpoint != "chat" or self.turns > 1 or self.dataset:
                raise ValueError("--images needs --endpoint chat, one turn and no --dataset")
            image_dims(self.image_size)

    def plan(self) -> LoadPlan:
        closed = self.rate is None
        return LoadPlan(concurrency=self.concurrency or (1 if closed else 0), rate=self.rate,
                        burstiness=self.burstiness, requests=self.requests,
                        duration_s=self.duration_s, warmup=self.warmup,
                        think_time_s=self.think_time_s, ramp_up_s=self.ramp_up_s,
                        turns=self.turns, seed=self.seed)

    def public(self) -> dict[str, Any]:
        out = asdict(self)
        out.pop("api_key")
        out.pop("admin_key")
        return out


async def resolve_model(client: BenchClient) -> str:
    """The first model `/models` lists (when `--model` was not given)."""
    r = await client.http.get(client.base_url + "/models")
    r.raise_for_status()
    return r.json()["data"][0]["id"]


SETTLE_S = 120.0
"""How long the bench waits for a Lifeline server's cached compiled graphs to load."""


async def settle_forward(client: BenchClient, wait_s: float = SETTLE_S) -> str | None:
    """Wait while a Lifeline server loads its cached compiled graphs (`/ready`'s `forward`
    says `loading` for a few seconds after a start): measured then, the first requests would
    run eagerly. Returns a note where the forward is still not compiled (a first start's
    background compile takes minutes: the run measures the eager forward); None otherwise, and
    for servers without such a `/ready`."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            r = await client.http.get(client.server_root + "/ready")
            forward = r.json().get("forward") if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError, AttributeError):
            return None
        states = set(forward.values()) if isinstance(forward, dict) else {forward}
        if "loading" not in states or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.25)
    slow = sorted(states & {"loading", "compiling", "failed"})
    if not slow:
        return None
    return (f"the server's forward was {' and '.join(slow)} when the run began (/ready): its "
            "requests ran the eager forward, slower than the compiled one, until it switched")


CONTEXT_MARGIN = 16
"""Tokens left free in a long-context prompt for BOS and the chat template."""


async def context_length(client: BenchClient) -> int:
    """The served model's context from `/models`: `max_model_len` (Lifeline, vLLM, SGLang) or
    llama.cpp's `meta.n_ctx_train`."""
    r = await client.http.get(client.base_url + "/models")
    r.raise_for_status()
    for entry in r.json()["data"]:
        if entry.get("id") == client.model:
            length = entry.get("max_model_len") or (entry.get("meta") or {}).get("n_ctx_train")
            if length:
                return int(length)
    raise RuntimeError(f"{client.base_url}/models does not say {client.model}'s context length")


async def build_workload(settings: BenchSettings, client: BenchClient) -> list:
    if settings.dataset:
        return jsonl_requests(settings.dataset, settings.output_tokens)
    count = (settings.requests + settings.warmup if settings.requests is not None
             else DISTINCT_PROMPTS)
    tk = await pick_tokenizer(client, settings.tokenizer)
    pairs = conversation.load_pairs(settings.length_file) if settings.length_file else ()
    lengths = Lengths(settings.input_tokens, settings.output_tokens, settings.length_dist,
                      settings.length_spread, pairs)
    requests = await random_requests(tk, lengths, count, chat=settings.endpoint == "chat",
                                     seed=settings.seed, prefix_groups=settings.prefix_groups,
                                     prefix_tokens=settings.prefix_tokens)
    if settings.images:
        width, height = image_dims(settings.image_size)
        for i, req in enumerate(requests):
            parts = [{"type": "text", "text": req.prompt}] + [
                {"type": "image_url", "image_url": {"url": synthetic_image_url(
                    width, height, settings.seed * 1_000_003 + i * settings.images + k)}}
                for k in range(settings.images)]
            req.extra["messages"] = [{"role": "user", "content": parts}]
    return requests


def image_dims(text: str) -> tuple[int, int]:
    try:
        width, height = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"--image-size is WxH (e.g. 512x512), not {text!r}") from None
    if not (1 <= width <= 8192 and 1 <= height <= 8192):
        raise ValueError("--image-size sides are 1 to 8,192 pixels")
    return width, height


def synthetic_image_url(width: int, height: int, seed: int) -> str:
    """A deterministic picture (gradients, a checker and noise) as a PNG data URL."""
    import base64
    import io

    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    rgb = np.stack([x * 255 // max(width, 1), y * 255 // max(height, 1),
                    ((x // 16 + y // 16) % 2) * 180], -1) + rng.integers(-24, 25, (height, width, 3))
    buf = io.BytesIO()
    Image.fromarray(np.clip(rgb, 0, 255).astype(np.uint8), "RGB").save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


async def run_bench(settings: BenchSettings,
                    on_done: Callable[[Sent], None] | None = None,
                    client_type: type[BenchClient] = BenchClient) -> dict[str, Any]:
    """Run the benchmark `settings` describe and return its results. `client_type`: a
    `BenchClient` that sends or reads differently (a test's slow reader)."""
    slo = Slo.parse(settings.slo, settings.slo_attainment) if settings.slo else None
    plan = settings.plan()
    connections = max(plan.concurrency or 1024, 16)  # never the client's bottleneck
    async with client_type(settings.url, settings.model or "", endpoint=settings.endpoint,
                           api_key=settings.api_key, max_connections=connections,
                           timeout_s=settings.timeout_s, pin_output=settings.pin_output,
                           extra_body={**logprobs_body(settings),
                                       **(settings.extra_body or {})}) as c:
        if not settings.model:
            c.model = settings.model = await resolve_model(c)
        if settings.long_context:
            settings.input_tokens = (await context_length(c) - settings.output_tokens
                                     - CONTEXT_MARGIN)
            if settings.input_tokens < 1:
                raise ValueError("--output-tokens leaves no room for a prompt in the context")
        settled = await settle_forward(c)
        workload = await build_workload(settings, c)
        text, notes = await weigh_text(settings, c, workload)
        notes = [*notes, *([settled] if settled else [])]
        sampler, why = await start_sampler(settings, c)
        started = datetime.now(UTC)
        since = time.time()
        try:
            result = await run_load(c, cycle(workload), plan, on_done)
        finally:
            if sampler is not None:
                await sampler.stop()
        anchor = await measure_anchor(c, result)
        log, note = await step_log(c, result, since, settings.admin_key)
        state = await sampled_state(sampler, c, result)
    return results(settings, result, slo, started, step_log=log, text=text,
                   notes=[*notes, *anchor.notes, *([note] if note else []),
                          *([why] if why else [])], server_state=state, anchor=anchor.record)


async def start_sampler(settings: BenchSettings, client: BenchClient
                        ) -> tuple[ServerSampler | None, str | None]:
    """The server's own state, sampled through the run (`--server-metrics`)."""
    if settings.server_metrics == "off":
        return None, None
    url = (client.server_root + "/metrics" if settings.server_metrics == "auto"
           else settings.server_metrics)
    root = url.rsplit("/", 1)[0]
    key = settings.admin_key or settings.api_key
    sampler = ServerSampler(url, slots_url=root + "/slots",
                            interval_s=settings.server_metrics_interval_s, model=client.model,
                            headers={"Authorization": f"Bearer {key}"} if key else {})
    if not await sampler.start():
        return None, ("the server's own state was not sampled ("
                      + "; ".join(sampler.errors[:2]) + "): causes the server does not report "
                      "per request (llama.cpp's and vLLM's queue) are not split out")
    return sampler, None


async def sampled_state(sampler: ServerSampler | None, client: BenchClient,
                        result: RunResult) -> dict[str, Any] | None:
    if sampler is None:
        return None
    state = sampler.as_dict(result.start)
    state["server_info"] = await server_info(client.http, sampler.metrics_url.rsplit("/", 1)[0],
                                             sampler.engine)
    return state


async def step_log(client: BenchClient, result: RunResult, since: float,
                   admin_key: str | None) -> tuple[dict[str, Any] | None, str | None]:
    """The server's step log over the run (warm-up included: its steps, often a request
    alone, anchor the step-cost fit); only Lifeline servers keep one."""
    raws = [s.trace.timings_raw for s in result.sent if s.trace.timings_raw]
    if not any("gateway_ms" in r for r in raws):
        kind = "the server" if not raws else "the server (not Lifeline)"
        return None, f"{kind} keeps no step log: the output's batch, context and " \
                     "prefill-interference causes are not split"
    log, why = await fetch_steps(client.http, client.server_root, since, time.time(), admin_key,
                                 client.model)
    if log is None:
        return None, f"no step log: {why}"
    return log, None


async def weigh_text(settings: BenchSettings, client: BenchClient,
                     workload: Sequence[BenchRequest]) -> tuple[dict[str, Any] | None, list[str]]:
    """The token cost of a sample of the workload's text on the server's tokenizer (or
    `--tokenizer`) against the reference (`lifeline.bench.text_cost`)."""
    texts = sample_texts(t for req in workload for t in _texts(req))
    if not texts:
        return None, ["the prompts are token ids: no text to weigh the tokenizer on"]
    try:
        tk: Tokenizer = await pick_tokenizer(client, settings.tokenizer)
        tokens = [len(await tk.encode(t)) for t in texts]
        english = len(await tk.encode(reference()["english_sample"]))
    except (RuntimeError, httpx.HTTPError, ValueError, OSError) as exc:
        return None, [f"the prompts' tokens could not be counted ({exc}): no tokenizer finding"]
    return text_stats(texts, tokens, english), []


def _texts(req: BenchRequest) -> list[str]:
    if isinstance(req.prompt, str) and "messages" not in req.extra:
        return [req.prompt]
    out = []
    for message in req.extra.get("messages") or ():
        content = message.get("content")
        if isinstance(content, str):
            out.append(content)
        elif isinstance(content, list):
            out += [p.get("text", "") for p in content if isinstance(p, dict)]
    return out


def logprobs_body(settings: BenchSettings) -> dict[str, Any]:
    """The smallest logprobs request that makes each event list its tokens."""
    if not settings.exact_tokens:
        return {}
    return {"logprobs": True} if settings.endpoint == "chat" else {"logprobs": 1}


def results(settings: BenchSettings, result: RunResult, slo: Slo | None,
            started: datetime, *, step_log: dict[str, Any] | None = None,
            text: dict[str, Any] | None = None, notes: Sequence[str] = (),
            server_state: dict[str, Any] | None = None,
            anchor: dict[str, Any] | None = None) -> dict[str, Any]:
    """`anchor`: the probes sent alone after the run (`lifeline.bench.anchor`), which the
    diagnosis reads."""
    sent = sorted(result.sent, key=lambda s: s.trace.sent)
    metrics = [request_metrics(s.trace) for s in sent]
    splits = [ttft_split(s.trace, m) if m.ok else None for s, m in zip(sent, metrics)]
    summary = summarize(metrics, result.duration_s, slo)
    summary["ttft_stages"] = breakdown(splits)
    summary["client_lag_ms"] = distribution((s.trace.sent - s.scheduled) * 1e3 for s in sent)
    records = []
    for i, (s, m, split) in enumerate(zip(sent, metrics, splits)):
        record = {"index": i, "id": s.trace.response_id, "turn": s.turn,
                  "sent_s": s.trace.sent - result.start, "connect_ms": s.trace.connect_ms,
                  **m.scalars(),
                  "error_message": s.trace.error_message, "finish_reason": s.trace.finish_reason,
                  "expected_prompt_tokens": s.request.prompt_tokens,
                  "usage_prompt_tokens": s.trace.prompt_tokens,
                  "usage_output_tokens": s.trace.output_tokens,
                  "events": len(s.trace.chunks),
                  "event_tokens": sum(c.tokens for c in s.trace.chunks),
                  "server_timings": s.trace.server_timings, "timings_raw": s.trace.timings_raw,
                  "ttft_split_ms": split,
                  "itl_ms": m.itl_ms, "tbt_ms": m.tbt_ms}
        records.append(record)
    out = {"schema": SCHEMA, "started_at": started.isoformat(timespec="seconds"),
           "settings": settings.public(), "summary": summary, "requests": records,
           "text_cost": text, "step_log": step_log, "diagnosis_notes": list(notes),
           "server_state": server_state, "anchor": anchor}
    if server_state is not None:
        server_state["summary"] = join(out, server_state)
        rejoined = _rejoined_splits(records)
        if rejoined:
            summary["ttft_stages"] = breakdown(rejoined)
    summary["diagnoses"] = diagnose(out)
    summary["diagnosis"] = verdict(summary["diagnoses"])
    out["step_log"] = log_summary(step_log)
    return out


def _rejoined_splits(records: list[dict[str, Any]]) -> list[dict[str, float | None]]:
    """The TTFT splits again where the join gave a request the queue its server did not
    report (the records' `ttft_split_ms` and the summary's stages then show it)."""
    out = []
    for r in records:
        stages = (r.get("server_state") or {}).get("stages")
        if stages and r.get("ttft_ms") is not None:
            parts = {k: stages.get(f"{k}_ms") for k in ("front", "queue", "prefill")}
            r["ttft_split_ms"] = {"client_network": r["ttft_ms"] - sum(
                v for v in parts.values() if v is not None), **parts}
        if r.get("ttft_split_ms"):
            out.append(r["ttft_split_ms"])
    return out if any((r.get("server_state") or {}).get("stages") for r in records) else []


def log_summary(log: dict[str, Any] | None) -> dict[str, Any] | None:
    """What the results keep of the step log (the log itself runs to megabytes): how many
    steps, the engine's limits, what was lost, and the step-cost fit."""
    if not log:
        return None
    records = log.get("data") or []
    cost = fit_steps(records)
    return {"steps": len(records), "first": records[0]["step"] if records else None,
            "last": records[-1]["step"] if records else None, "config": log.get("config"),
            "dropped": log.get("dropped", 0), "fit": cost.as_dict() if cost else None}

