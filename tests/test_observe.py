"""The request record and its views: timings, Server-Timing, access log, Prometheus, OTel.

Synthetic stamps and timelines, with expected values worked out by hand from the definitions
in docs/serve.md; numpy's percentile and the OTel SDK's in-memory exporter as references."""
import io
import json
import logging
import re
from itertools import pairwise
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from lifeline.engine.request import Timeline
from lifeline.observe import (
    STAGES,
    AccessLog,
    Metrics,
    RequestRecord,
    ServerStamps,
    Tracer,
    combine_timelines,
)
from lifeline.observe.stats import EngineStats

KEYS = {"gateway_ms", "template_ms", "tokenize_ms", "queue_ms", "prefill_ms", "prefill_chunks",
        "ttft_ms", "ttfat_ms", "decode_ms", "tbt_p50_ms", "tbt_p90_ms", "tbt_max_ms",
        "detokenize_ms", "stream_ms", "e2e_ms", "prompt_tokens", "cached_tokens",
        "completion_tokens", "prefill_tok_s", "decode_tok_s", "preemptions", "prompt_anatomy",
        "reasoning_tokens", "steps", "queue", "kv_bytes_read_per_token", "recomputed_tokens"}
DOCS = Path(__file__).resolve().parent.parent / "docs" / "serve.md"
TOKENS = [100.050, 100.060, 100.072, 100.081, 100.095]


def stamps(**kw) -> ServerStamps:
    base = {"arrival": 100.0, "parsed": 100.002, "templated": 100.005, "tokenized": 100.006,
            "last_byte": 100.100, "stream_s": 0.001}
    return ServerStamps(**{**base, **kw})


def timeline(tokens=TOKENS, **kw) -> Timeline:
    base = {"arrival": 100.0, "arrival_wall": 1.7e9 + 0.007, "tokenized": 100.007,
            "queued": 100.008, "first_scheduled": 100.010,
            "prefill_chunks": [(100.010, 100.030, 64), (100.030, 100.050, 36)],
            "first_token": tokens[0] if tokens else None, "token_times": list(tokens),
            "finished": tokens[-1] if tokens else None, "detokenize_s": 0.0005}
    return Timeline(**{**base, **kw})


def record(st=None, tl=None, **kw) -> RequestRecord:
    args = {"request_id": "req-1", "model": "m", "endpoint": "/v1/chat/completions",
            "prompt_tokens": 116, "cached_tokens": 16, "completion_tokens": 5,
            "finish_reason": "stop",
            "anatomy": {"system": 20, "latest_user": 90, "template": 6}}
    return RequestRecord.build(st or stamps(), tl or timeline(), **{**args, **kw})


def stage_sum(t: dict) -> float:
    return sum(t[f"{name}_ms"] for name in STAGES)


def test_timings_have_exactly_the_documented_keys():
    assert set(record().timings()) == KEYS
    assert set(record(anatomy=None).timings()) == KEYS


def test_stages_follow_their_definitions_and_add_up_to_e2e():
    t = record().timings()
    detok_after = 0.5 / 5
    expected = {"gateway_ms": 2.0, "template_ms": 3.0, "tokenize_ms": 1.0, "queue_ms": 4.0,
                "prefill_ms": 40.0, "decode_ms": 45.0 - (0.5 - detok_after),
                "detokenize_ms": 0.5, "stream_ms": 5.0 - detok_after, "e2e_ms": 100.0,
                "ttft_ms": 50.0}
    for key, value in expected.items():
        assert t[key] == pytest.approx(value, abs=1e-6), key
    assert stage_sum(t) == pytest.approx(t["e2e_ms"], abs=1e-6)
    assert t["prefill_chunks"] == 2
    assert t["prefill_tok_s"] == pytest.approx(100 / 0.040)
    assert t["decode_tok_s"] == pytest.approx(4 / 0.045)
    assert t["prompt_anatomy"] == {"system": 20, "latest_user": 90, "template": 6}


def test_ttfat_equals_ttft_without_reasoning_and_follows_the_answer_with_it():
    assert record().timings()["ttfat_ms"] == record().timings()["ttft_ms"]
    t = record(reasoning_tokens=2, first_answer_token_time=100.072).timings()
    assert t["ttfat_ms"] == pytest.approx(72.0)
    assert t["ttft_ms"] == pytest.approx(50.0)
    assert record(reasoning_tokens=5).timings()["ttfat_ms"] is None


def test_tbt_percentiles_match_numpy():
    tokens = [100.05, 100.061, 100.0625, 100.09, 100.0901, 100.13, 100.2, 100.201, 100.23]
    t = record(tl=timeline(tokens), st=stamps(last_byte=100.3)).timings()
    gaps = np.diff(np.array(tokens)) * 1e3
    assert t["tbt_p50_ms"] == pytest.approx(np.percentile(gaps, 50))
    assert t["tbt_p90_ms"] == pytest.approx(np.percentile(gaps, 90))
    assert t["tbt_max_ms"] == pytest.approx(gaps.max())


def test_one_token_has_no_decode_and_no_gaps():
    t = record(tl=timeline([100.050]), completion_tokens=1).timings()
    assert t["decode_ms"] == 0.0
    assert t["tbt_p50_ms"] is t["tbt_p90_ms"] is t["tbt_max_ms"] is t["decode_tok_s"] is None
    assert t["stream_ms"] == pytest.approx(50.0 - 0.5)
    assert stage_sum(t) == pytest.approx(t["e2e_ms"], abs=1e-6)


def test_aborted_during_prefill_counts_prefill_up_to_the_abort():
    tl = timeline([], prefill_chunks=[(100.010, 100.030, 64)], finished=100.040,
                  detokenize_s=0.0)
    t = record(tl=tl, completion_tokens=0, finish_reason="abort").timings()
    assert t["ttft_ms"] is None and t["ttfat_ms"] is None and t["prefill_tok_s"] is None
    assert t["prefill_ms"] == pytest.approx(30.0)
    assert t["decode_ms"] == 0.0
    assert t["stream_ms"] == pytest.approx(60.0)
    assert stage_sum(t) == pytest.approx(t["e2e_ms"], abs=1e-6)


def test_request_never_scheduled_spends_its_engine_time_in_the_queue():
    tl = Timeline(arrival=100.0, arrival_wall=1.7e9, tokenized=100.007, queued=100.008)
    t = record(st=stamps(templated=None, tokenized=None), tl=tl, completion_tokens=0,
               finish_reason=None, status=503).timings()
    assert t["template_ms"] == t["tokenize_ms"] == 0.0
    assert t["queue_ms"] == pytest.approx(98.0)
    assert t["prefill_ms"] == t["decode_ms"] == t["stream_ms"] == 0.0
    assert stage_sum(t) == pytest.approx(t["e2e_ms"], abs=1e-6)


def test_preempted_request_counts_every_chunk_and_preemption():
    chunks = [(100.010, 100.020, 50), (100.020, 100.030, 50), (100.040, 100.050, 100)]
    tl = timeline(prefill_chunks=chunks, preemptions=[100.031])
    t = record(tl=tl).timings()
    assert t["preemptions"] == 1
    assert t["prefill_chunks"] == 3
    assert stage_sum(t) == pytest.approx(t["e2e_ms"], abs=1e-6)


def test_combined_timelines_of_n_choices_merge_tokens_and_detokenize():
    a = timeline([100.050, 100.070], detokenize_s=0.0002)
    b = timeline([100.052, 100.073, 100.090], first_scheduled=100.011, detokenize_s=0.0003)
    merged = combine_timelines([a, b])
    assert merged.token_times == [100.050, 100.052, 100.070, 100.073, 100.090]
    assert merged.first_scheduled == 100.010 and merged.first_token == 100.050
    assert merged.detokenize_s == pytest.approx(0.0005)
    t = record(tl=merged, completion_tokens=5).timings()
    assert stage_sum(t) == pytest.approx(t["e2e_ms"], abs=1e-6)


def test_request_that_never_reached_the_engine_still_gets_a_record():
    rec = record(st=stamps(templated=None, tokenized=None), tl=combine_timelines([]),
                 completion_tokens=0, prompt_tokens=0, cached_tokens=0, finish_reason=None,
                 anatomy=None, status=400)
    t = rec.timings()
    assert t["queue_ms"] == 0.0 and t["ttft_ms"] is None
    assert t["stream_ms"] == pytest.approx(98.0)
    assert stage_sum(t) == pytest.approx(t["e2e_ms"], abs=1e-6)
    assert json.loads(rec.access_log_line())["status"] == 400


def parse_server_timing(value: str) -> dict[str, float]:
    metrics = {}
    for entry in value.split(","):
        name, *params = [p.strip() for p in entry.split(";")]
        assert re.fullmatch(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+", name), name
        fields = dict(p.split("=", 1) for p in params)
        metrics[name] = float(fields["dur"])
    return metrics


def test_server_timing_header_parses_and_lists_every_stage():
    header = parse_server_timing(record().server_timing_header())
    assert list(header) == [*STAGES, "ttft", "e2e"]
    assert header["prefill"] == pytest.approx(40.0, abs=1e-3)
    assert header["e2e"] == pytest.approx(100.0, abs=1e-3)
    empty = record(tl=timeline([], finished=100.04, detokenize_s=0.0), completion_tokens=0)
    assert "ttft" not in parse_server_timing(empty.server_timing_header())


def test_access_log_line_is_json_with_the_timings():
    rec = record()
    stream = io.StringIO()
    logger = logging.getLogger("lifeline.access.test")
    logger.addHandler(logging.StreamHandler(stream))
    logger.setLevel(logging.INFO)
    logger.propagate = False
    AccessLog(logger).write(rec)
    lines = stream.getvalue().splitlines()
    assert len(lines) == 1
    entry = json.loads(lines[0])
    assert entry["request_id"] == "req-1" and entry["status"] == 200
    assert entry["finish_reason"] == "stop" and entry["completion_tokens"] == 5
    assert entry["timings"] == json.loads(json.dumps(rec.timings()))
    assert entry["ts"].startswith("2023-11-14T22:13:20.000")


def documented_metric_names() -> set[str]:
    section = DOCS.read_text().split("## Timings and metrics", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"`(lifeline:[a-z0-9_]+)`", section))


def moe_metric_names(names: set[str]) -> set[str]:
    """The series only an MoE model's engine adds (tests/test_server_moe.py renders them)."""
    return {n for n in names if n.startswith("lifeline:moe_") or n == "lifeline:model_parameters"}


def adaptive_thread_metric_names(names: set[str]) -> set[str]:
    """The series only an engine with adaptive threads adds (`EngineStats.intraop_threads`)."""
    return {n for n in names if "intraop" in n or n == "lifeline:cpu_other_processes_cores"}


def sample(metrics: Metrics, name: str, **labels) -> float:
    value = metrics.registry.get_sample_value(name, {"model_name": "m", **labels})
    return 0.0 if value is None else value


def test_metrics_render_every_documented_name_and_nothing_undocumented():
    metrics = Metrics("m")
    metrics.observe(record())
    # what the server sets once ready: the start's phases, the KV cache's size, the compiles
    metrics.set_startup({"ready": 1.0}, SimpleNamespace(kv_bytes_per_token=8, kv_pool_bytes=64,
                                                        startup={}), 0)
    body, content_type = metrics.render()
    assert content_type.startswith("text/plain")
    text = body.decode()
    families = set(re.findall(r"^# TYPE (lifeline:\S+)", text, re.MULTILINE))
    families = {f.removesuffix("_total") for f in families if not f.endswith("_created")}
    documented = documented_metric_names()
    moe_only = moe_metric_names(documented)
    threads = adaptive_thread_metric_names(documented)
    assert len(documented) == 33 and len(moe_only) == 5 and len(threads) == 3
    dense = documented - moe_only - threads  # no MoE series, no adaptive threads here
    for name in dense:
        assert re.search(rf"^{re.escape(name)}(_count|_bucket)?[{{ ]", text, re.MULTILINE), name
    assert families == {name.removesuffix("_total") for name in dense}


def test_metrics_render_is_prometheus_clients_text_byte_for_byte():
    """/metrics keeps each sample's formatted name and labels between scrapes, and the finished
    requests' families (text included) until the next finish: the body is still
    `generate_latest`'s, scrape after scrape, as values,
    label sets (a new finish reason, the adaptive threads' series) and families change,
    label values needing escapes included."""
    from prometheus_client import Gauge, generate_latest

    metrics = Metrics('m"odel\\x\ny')
    metrics.set_startup({"ready": 1.5, "read_weights": 0.25},
                        SimpleNamespace(kv_bytes_per_token=8, kv_pool_bytes=64, startup={}), 0)
    for step in range(4):
        metrics.observe(record(finish_reason=("stop", "length", "abort", "stop")[step]))
        metrics.update_stats(fake_engine(100 * step, 40 * step, step))
        if step == 2:
            metrics.update_stats(EngineStats(intraop_threads=1, cpu_others_cores=0.9,
                                             thread_changes=2))
            Gauge("lifeline:unlabelled", "A family without labels.",
                  registry=metrics.registry).set(1e22)
        body = metrics.render()[0]
        assert body == generate_latest(metrics.registry)
        # the finished requests' families are collected again after each finish
        counts = re.findall(rb"^lifeline:e2e_request_latency_seconds_count\{.*\} (\S+)$", body,
                            re.MULTILINE)
        assert counts == [b"%d.0" % (step + 1)]


def test_adaptive_threads_render_their_series_once_the_engine_reports_them():
    metrics = Metrics("m")
    metrics.update_stats(EngineStats(intraop_threads=1, cpu_others_cores=0.9, thread_changes=2))
    metrics.update_stats(EngineStats(intraop_threads=2, cpu_others_cores=0.1, thread_changes=3))
    text = metrics.render()[0].decode()
    rendered = set(re.findall(r"^# TYPE (lifeline:\S+)", text, re.MULTILINE))
    assert adaptive_thread_metric_names(documented_metric_names()) <= rendered
    assert sample(metrics, "lifeline:intraop_threads") == 2
    assert sample(metrics, "lifeline:cpu_other_processes_cores") == pytest.approx(0.1)
    assert sample(metrics, "lifeline:intraop_thread_changes_total") == 3


def test_histograms_and_counters_move_when_a_request_is_observed():
    metrics = Metrics("m")
    assert sample(metrics, "lifeline:e2e_request_latency_seconds_count") == 0
    metrics.observe(record())
    metrics.observe(record(finish_reason="length"))
    assert sample(metrics, "lifeline:e2e_request_latency_seconds_count") == 2
    assert sample(metrics, "lifeline:e2e_request_latency_seconds_sum") == pytest.approx(0.2)
    for name in STAGES:
        assert sample(metrics, f"lifeline:request_{name}_time_seconds_count") == 2
    assert sample(metrics, "lifeline:inter_token_latency_seconds_count") == 8
    assert sample(metrics, "lifeline:time_to_first_token_seconds_count") == 2
    assert sample(metrics, "lifeline:prompt_tokens_total") == 232
    assert sample(metrics, "lifeline:generation_tokens_total") == 10
    assert sample(metrics, "lifeline:request_success_total", finished_reason="stop") == 1
    assert sample(metrics, "lifeline:request_success_total", finished_reason="length") == 1


def fake_engine(queries: int, hits: int, preemptions: int, running=2, waiting=3, usage=0.25):
    """What `EngineStats.of` reads of an engine, as the stats it makes."""
    scheduler = SimpleNamespace(running=[object()] * running, waiting=[object()] * waiting,
                                num_preemptions=preemptions)
    blocks = SimpleNamespace(usage=usage, stats=SimpleNamespace(queries=queries, hits=hits),
                             num_blocks=100, num_free_blocks=round(100 * (1 - usage)))
    return EngineStats.of(SimpleNamespace(scheduler=scheduler, block_manager=blocks))


def test_engine_counters_follow_cumulative_totals_and_never_go_down():
    metrics = Metrics("m")
    metrics.update_stats(fake_engine(100, 40, 1))
    metrics.update_stats(fake_engine(100, 40, 1))
    assert sample(metrics, "lifeline:prefix_cache_queries_total") == 100
    assert sample(metrics, "lifeline:prefix_cache_hits_total") == 40
    assert sample(metrics, "lifeline:num_preemptions_total") == 1
    metrics.update_stats(fake_engine(250, 90, 3, running=5, waiting=0, usage=0.5))
    assert sample(metrics, "lifeline:prefix_cache_queries_total") == 250
    assert sample(metrics, "lifeline:num_preemptions_total") == 3
    assert sample(metrics, "lifeline:num_requests_running") == 5
    assert sample(metrics, "lifeline:num_requests_waiting") == 0
    assert sample(metrics, "lifeline:kv_cache_usage_perc") == 0.5
    metrics.update_stats(fake_engine(10, 5, 0))  # a fresh engine starts from zero
    assert sample(metrics, "lifeline:prefix_cache_queries_total") == 260
    assert sample(metrics, "lifeline:prefix_cache_hits_total") == 95
    assert sample(metrics, "lifeline:num_preemptions_total") == 3


def test_otel_spans_tile_the_request_in_stage_order():
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    tracer = Tracer(exporter)
    rec = record()
    tracer.emit(rec)
    spans = exporter.get_finished_spans()
    parent = next(s for s in spans if s.name == "request")
    children = sorted((s for s in spans if s.parent is not None), key=lambda s: s.start_time)
    assert [s.name for s in children] == list(STAGES)
    assert len(spans) == len(STAGES) + 1
    assert all(s.parent.span_id == parent.context.span_id for s in children)
    assert all(s.context.trace_id == parent.context.trace_id for s in children)
    assert all(s.end_time >= s.start_time for s in children)
    assert children[0].start_time == parent.start_time
    assert abs(children[-1].end_time - parent.end_time) <= 1
    for before, after in pairwise(children):
        assert after.start_time == before.end_time
    durations = {s.name: (s.end_time - s.start_time) / 1e6 for s in children}
    for name, ms in durations.items():
        assert ms == pytest.approx(rec.timings()[f"{name}_ms"], abs=1e-5), name
    assert parent.attributes["lifeline.request_id"] == "req-1"
    tracer.shutdown()


def test_tracer_without_endpoint_is_a_no_op():
    tracer = Tracer.from_endpoint(None)
    assert not tracer.enabled
    tracer.emit(record())


def test_otlp_endpoint_without_the_exporter_package_says_what_to_install():
    try:
        import opentelemetry.exporter.otlp.proto.http  # noqa: F401
    except ImportError:
        with pytest.raises(RuntimeError, match="opentelemetry-exporter-otlp-proto-http"):
            Tracer.from_endpoint("http://127.0.0.1:4318")
    else:
        tracer = Tracer.from_endpoint("http://127.0.0.1:4318")
        assert tracer.enabled
        tracer.shutdown()
