"""The target server's own state during a bench run: its Prometheus `/metrics` (vLLM, SGLang,
llama.cpp with `--metrics`, Lifeline) and llama.cpp's `/slots`, sampled at a fixed interval on a
connection of their own, reduced to one engine-neutral record per sample.

A sample keeps gauges as read (running and waiting requests, KV usage) and counters and
histograms as the server's cumulative totals, so any window's change is a difference of two
samples. The names each engine uses are in `ENGINES`; docs/diagnosis.md says what each one
means there."""
from __future__ import annotations

import asyncio
import re
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

INTERVAL_S = 0.2
"""The default sampling interval (the issue's bound is 250 ms; docs/diagnosis.md has the cost)."""
MAX_SAMPLES = 2048
"""Past this many samples the record keeps every other one and samples half as often, so the
results stay bounded (about 1 MB) however long the run."""

# engine-neutral field -> (metric family as the parser names it, kind)
# kind: gauge (value), counter (cumulative value), hist (cumulative sum and count)
ENGINES: dict[str, dict[str, tuple[str, str]]] = {
    "vllm": {
        "running": ("vllm:num_requests_running", "gauge"),
        "waiting": ("vllm:num_requests_waiting", "gauge"),
        "kv_usage": ("vllm:kv_cache_usage_perc", "gauge"),
        "prompt_tokens": ("vllm:prompt_tokens", "counter"),
        "generation_tokens": ("vllm:generation_tokens", "counter"),
        "prefix_queries": ("vllm:prefix_cache_queries", "counter"),
        "prefix_hits": ("vllm:prefix_cache_hits", "counter"),
        "preemptions": ("vllm:num_preemptions", "counter"),
        "queue_s": ("vllm:request_queue_time_seconds", "hist"),
        "prefill_s": ("vllm:request_prefill_time_seconds", "hist"),
        "decode_s": ("vllm:request_decode_time_seconds", "hist"),
        "ttft_s": ("vllm:time_to_first_token_seconds", "hist"),
        "e2e_s": ("vllm:e2e_request_latency_seconds", "hist"),
        "iteration_tokens": ("vllm:iteration_tokens_total", "hist"),
    },
    "sglang": {
        "running": ("sglang:num_running_reqs", "gauge"),
        "waiting": ("sglang:num_queue_reqs", "gauge"),
        "kv_usage": ("sglang:token_usage", "gauge"),
        "prompt_tokens": ("sglang:prompt_tokens", "counter"),
        "generation_tokens": ("sglang:generation_tokens", "counter"),
        "cache_hit_rate": ("sglang:cache_hit_rate", "gauge"),
        "preemptions": ("sglang:num_retracted_reqs", "gauge"),
        "queue_s": ("sglang:queue_time_seconds", "hist"),
        "ttft_s": ("sglang:time_to_first_token_seconds", "hist"),
        "e2e_s": ("sglang:e2e_request_latency_seconds", "hist"),
        "max_running": ("sglang:max_running_requests", "gauge"),
        "max_tokens": ("sglang:max_total_num_tokens", "gauge"),
    },
    "llama.cpp": {
        "running": ("llamacpp:requests_processing", "gauge"),
        "waiting": ("llamacpp:requests_deferred", "gauge"),
        "kv_usage": ("llamacpp:kv_cache_usage_ratio", "gauge"),
        "kv_tokens": ("llamacpp:kv_cache_tokens", "gauge"),
        "prompt_tokens": ("llamacpp:prompt_tokens", "counter"),
        "cached_tokens": ("llamacpp:prompt_tokens_cached", "counter"),
        "generation_tokens": ("llamacpp:tokens_predicted", "counter"),
        "prompt_seconds": ("llamacpp:prompt_seconds", "counter"),
        "generation_seconds": ("llamacpp:tokens_predicted_seconds", "counter"),
        "decode_calls": ("llamacpp:n_decode", "counter"),
        "busy_per_decode": ("llamacpp:n_busy_slots_per_decode", "gauge"),
    },
    "lifeline": {
        "running": ("lifeline:num_requests_running", "gauge"),
        "waiting": ("lifeline:num_requests_waiting", "gauge"),
        "kv_usage": ("lifeline:kv_cache_usage_perc", "gauge"),
        "prompt_tokens": ("lifeline:prompt_tokens", "counter"),
        "generation_tokens": ("lifeline:generation_tokens", "counter"),
        "prefix_queries": ("lifeline:prefix_cache_queries", "counter"),
        "prefix_hits": ("lifeline:prefix_cache_hits", "counter"),
        "preemptions": ("lifeline:num_preemptions", "counter"),
        "queue_s": ("lifeline:request_queue_time_seconds", "hist"),
        "prefill_s": ("lifeline:request_prefill_time_seconds", "hist"),
        "decode_s": ("lifeline:request_decode_time_seconds", "hist"),
        "ttft_s": ("lifeline:time_to_first_token_seconds", "hist"),
        "e2e_s": ("lifeline:e2e_request_latency_seconds", "hist"),
    },
}
PREFIXES = {"vllm:": "vllm", "sglang:": "sglang", "llamacpp:": "llama.cpp",
            "lifeline:": "lifeline"}
# Older names of the same quantity, tried when the current one is absent.
ALIASES = {"vllm:kv_cache_usage_perc": "vllm:gpu_cache_usage_perc",
           "vllm:prefix_cache_queries": "vllm:gpu_prefix_cache_queries",
           "vllm:prefix_cache_hits": "vllm:gpu_prefix_cache_hits"}


def parse(text: str) -> dict[str, dict[str, Any]]:
    """Prometheus text as {family: {"type", "samples": [(name, labels, value)]}}."""
    out: dict[str, dict[str, Any]] = {}
    for family in text_string_to_metric_families(text):
        out[family.name] = {"type": family.type,
                            "samples": [(s.name, s.labels, s.value) for s in family.samples]}
    return out


_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_:.]*)="((?:[^"\\]|\\.)*)"')
_UNESCAPE = re.compile(r"\\(.)")
_SUFFIXES = {"counter": ("_total",), "histogram": ("_sum", "_count"),
             "summary": ("_sum", "_count"), "gaugehistogram": ("_gsum", "_gcount")}


def parse_families(text: str, wanted: set[str]) -> dict[str, dict[str, Any]]:
    """`parse(text)` for the families in `wanted` only, without the samples no record reads
    (histogram buckets, `_created`): what a sample after the first needs (`reduce`), at a
    fraction of the parser's time. A scrape of Lifeline's ~420 lines took the bench's client
    ~17 ms in prometheus_client's parser, every 0.2 s, on the cores the server under test runs
    on (docs/performance.md)."""
    owner: dict[str, str] = {}
    out: dict[str, dict[str, Any]] = {}
    for line in text.split("\n"):
        if not line:
            continue
        if line[0] == "#":
            parts = line.split(None, 3)
            if len(parts) == 4 and parts[1] == "TYPE":
                name, kind = parts[2], parts[3].strip()
                family = name[:-6] if kind == "counter" and name.endswith("_total") else name
                if family in wanted:
                    out.setdefault(family, {"type": kind, "samples": []})
                    owner[family] = family
                    for suffix in _SUFFIXES.get(kind, ()):
                        owner[family + suffix] = family
            continue
        brace, space = line.find("{"), line.find(" ")
        labelled = brace >= 0 and not 0 <= space < brace
        family = owner.get(line[:brace] if labelled else line[:space])
        if family is None:  # most lines: another family's, or a bucket
            continue
        if labelled:
            end = line.rfind("}")
            name, rest = line[:brace], line[end + 1:]
            labels = {k: _UNESCAPE.sub(_unescape, v)
                      for k, v in _LABEL.findall(line[brace + 1:end])}
        else:
            name, labels, rest = line[:space], {}, line[space + 1:]
        value = rest.split()
        if value:
            out[family]["samples"].append((name, labels, float(value[0])))
    return out


def _unescape(match: re.Match[str]) -> str:
    char = match.group(1)
    return "\n" if char == "n" else char


def wanted_families(engine: str) -> set[str]:
    """The families `reduce` reads for `engine`, their older names included."""
    names = {name for name, _ in ENGINES[engine].values()}
    return names | {ALIASES[n] for n in names if n in ALIASES}


def detect(families: dict[str, dict[str, Any]]) -> str | None:
    """The engine whose metric names these are (the one with most families)."""
    counts: dict[str, int] = {}
    for name in families:
        for prefix, engine in PREFIXES.items():
            if name.startswith(prefix):
                counts[engine] = counts.get(engine, 0) + 1
    return max(counts, key=counts.__getitem__) if counts else None


def reduce(engine: str, families: dict[str, dict[str, Any]], model: str | None = None
           ) -> dict[str, Any]:
    """One engine-neutral record: gauges and counters summed over the series of `model` (all
    series when no series names it), histograms as `[sum, count]`."""
    out: dict[str, Any] = {}
    for key, (name, kind) in ENGINES[engine].items():
        family = families.get(name) or families.get(ALIASES.get(name, ""))
        if family is None:
            continue
        samples = _of_model(family["samples"], model)
        if kind == "hist":
            total = [v for n, _, v in samples if n.endswith("_sum")]
            count = [v for n, _, v in samples if n.endswith("_count")]
            if total and count:
                out[key] = [sum(total), sum(count)]
        else:
            values = [v for n, _, v in samples if not n.endswith("_created")]
            if values:
                out[key] = sum(values)
    return out


def _of_model(samples: list[tuple[str, dict[str, str], float]], model: str | None
              ) -> list[tuple[str, dict[str, str], float]]:
    if not model:
        return samples
    named = [s for s in samples if s[1].get("model_name") == model]
    return named or samples


def engine_config(engine: str, families: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """What the metrics say of the engine's configuration (vLLM's cache_config_info labels,
    SGLang's limits)."""
    out: dict[str, Any] = {}
    info = families.get("vllm:cache_config_info")
    if engine == "vllm" and info and info["samples"]:
        out["cache_config"] = dict(info["samples"][0][1])
    if engine == "sglang":
        for key in ("max_running", "max_tokens"):
            name = ENGINES["sglang"][key][0]
            if name in families and families[name]["samples"]:
                out[key] = families[name]["samples"][0][2]
    return out


def reduce_slots(slots: Any) -> dict[str, Any] | None:
    """llama.cpp's `/slots`: how many slots, how many busy, each slot's context."""
    if not isinstance(slots, list) or not slots:
        return None
    busy = sum(1 for s in slots if isinstance(s, dict) and s.get("is_processing"))
    n_ctx = [s.get("n_ctx") for s in slots if isinstance(s, dict) and s.get("n_ctx")]
    return {"slots": len(slots), "slots_busy": busy,
            "slot_n_ctx": min(n_ctx) if n_ctx else None}


@dataclass(slots=True)
class ServerSampler:
    """Samples `metrics_url` (and `slots_url`, where it answers) every `interval_s` until
    stopped. Times are `time.perf_counter()` at the middle of each scrape, the bench's clock."""

    metrics_url: str
    slots_url: str | None = None
    interval_s: float = INTERVAL_S
    model: str | None = None
    headers: dict[str, str] = field(default_factory=dict)
    samples: list[dict[str, Any]] = field(default_factory=list)
    engine: str | None = None
    config: dict[str, Any] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    scrape_ms: deque[float] = field(default_factory=lambda: deque(maxlen=4096))
    _task: asyncio.Task | None = None
    _stop: asyncio.Event | None = None
    _http: httpx.AsyncClient | None = None
    _slots_ok: bool = True

    async def start(self) -> bool:
        """Take the first sample; False (with `errors` saying why) when the server offers no
        metrics this sampler reads."""
        self._http = httpx.AsyncClient(headers=self.headers, timeout=httpx.Timeout(5.0))
        self._stop = asyncio.Event()
        if not await self.sample():
            await self._http.aclose()
            return False
        self._task = asyncio.create_task(self._loop())
        return True

    async def stop(self) -> None:
        if self._task is not None and self._stop is not None:
            self._stop.set()
            await self._task
            await self.sample()
        if self._http is not None:
            await self._http.aclose()

    async def _loop(self) -> None:
        assert self._stop is not None
        while not self._stop.is_set():
            try:
                await asyncio.wait_for(self._stop.wait(), self.interval_s)
            except TimeoutError:
                await self.sample()

    async def sample(self) -> bool:
        assert self._http is not None
        t0 = time.perf_counter()
        try:
            r = await self._http.get(self.metrics_url)
            r.raise_for_status()
            # the first sample finds the engine and its configuration; later ones read only
            # what a record holds
            families = (parse(r.text) if self.engine is None else
                        parse_families(r.text, wanted_families(self.engine)))
        except (httpx.HTTPError, ValueError) as exc:
            self._error(f"{self.metrics_url}: {type(exc).__name__}: {exc}")
            return False
        t1 = time.perf_counter()
        engine = self.engine or detect(families)
        if engine is None:
            self._error(f"{self.metrics_url} holds no metric of a known engine")
            return False
        if self.engine is None:
            self.engine = engine
            self.config.update(engine_config(engine, families))
        record = {"t": (t0 + t1) / 2, **reduce(engine, families, self.model)}
        if engine == "llama.cpp" and self.slots_url and self._slots_ok:
            record.update(await self._slots())
        self.scrape_ms.append((time.perf_counter() - t0) * 1e3)
        self._keep(record)
        return True

    async def _slots(self) -> dict[str, Any]:
        assert self._http is not None and self.slots_url is not None
        try:
            r = await self._http.get(self.slots_url)
            r.raise_for_status()
            slots = reduce_slots(r.json())
        except (httpx.HTTPError, ValueError) as exc:
            self._slots_ok = False
            self._error(f"{self.slots_url}: {type(exc).__name__} (not sampled again)")
            return {}
        return slots or {}

    def _error(self, message: str) -> None:
        if len(self.errors) < 8:
            self.errors.append(message[:300])

    def _keep(self, record: dict[str, Any]) -> None:
        self.samples.append(record)
        if isinstance(self.samples, list) and len(self.samples) >= MAX_SAMPLES:
            self.samples = self.samples[::2]
            self.interval_s *= 2

    def as_dict(self, origin: float) -> dict[str, Any]:
        """The record kept in the results: sample times in seconds from `origin` (the run's
        measured window opening), the scrape's own cost, what failed."""
        samples = [{**s, "t": round(s["t"] - origin, 4)} for s in self.samples]
        ms = sorted(self.scrape_ms)
        return {"engine": self.engine, "url": self.metrics_url, "slots_url": self.slots_url,
                "interval_s": self.interval_s, "config": self.config, "samples": samples,
                "scrape_ms_p50": ms[len(ms) // 2] if ms else None,
                "scrape_ms_max": ms[-1] if ms else None, "errors": self.errors}


async def server_info(http: httpx.AsyncClient, root: str, engine: str | None) -> dict[str, Any]:
    """The engine's configuration as it reports it: llama.cpp's `/props`, SGLang's
    `/get_server_info`, vLLM's `/version` (the rest of vLLM's is in its metrics)."""
    path = {"llama.cpp": "/props", "sglang": "/get_server_info", "vllm": "/version"}.get(
        engine or "")
    if path is None:
        return {}
    try:
        r = await http.get(root + path, timeout=5.0)
        r.raise_for_status()
        body = r.json()
    except (httpx.HTTPError, ValueError):
        return {}
    if engine == "llama.cpp" and isinstance(body, dict):
        settings = body.get("default_generation_settings") or {}
        return {"total_slots": body.get("total_slots"), "n_ctx": settings.get("n_ctx"),
                "model_path": body.get("model_path"), "build_info": body.get("build_info")}
    if engine == "sglang" and isinstance(body, dict):
        keys = ("max_running_requests", "max_total_num_tokens", "chunked_prefill_size",
                "schedule_policy", "disable_radix_cache", "mem_fraction_static", "version")
        return {k: body[k] for k in keys if k in body}
    return body if isinstance(body, dict) else {}
