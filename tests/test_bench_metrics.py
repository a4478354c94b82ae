"""The bench's metric math on synthetic streams: multi-token chunks, reasoning deltas, errors
mid-stream, empty outputs; aggregates against numpy and against vLLM's `bench serve` formulas
(TPOT, per-event ITL, throughputs, goodput) written out here from its definitions."""
import asyncio
import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from lifeline.bench.metrics import (
    REASONING,
    Chunk,
    RequestTrace,
    Slo,
    distribution,
    percentile,
    request_metrics,
    summarize,
)
from lifeline.bench.search import cost, search_max, search_max_rate
from lifeline.bench.stages import breakdown, normalize, ttft_split


def trace(times, tokens=None, kinds=None, done=None, **kw):
    tokens = tokens or [1] * len(times)
    kinds = kinds or ["answer"] * len(times)
    chunks = [Chunk(100 + t, k, kind) for t, k, kind in zip(times, tokens, kinds)]
    return RequestTrace(sent=100.0, chunks=chunks,
                        done=100 + (done if done is not None else times[-1]), **kw)


def test_one_token_per_chunk_gives_vllm_ttft_itl_tpot_e2e():
    m = request_metrics(trace([0.5, 0.6, 0.8, 1.1], prompt_tokens=40, output_tokens=4))
    assert m.ok and m.ttft_ms == pytest.approx(500)
    assert m.e2e_ms == pytest.approx(1100)
    assert m.tpot_ms == pytest.approx((1100 - 500) / 3)  # vLLM: (latency - ttft) / (n - 1)
    assert m.itl_ms == pytest.approx([100, 200, 300])
    assert m.tbt_ms == pytest.approx(m.itl_ms)
    assert m.prefill_tok_s == pytest.approx(40 / 0.5)
    assert m.output_tok_s == pytest.approx(1e3 / m.tpot_ms)
    assert m.ttfat_ms == m.ttft_ms


def test_a_chunk_with_several_tokens_shares_its_gap_among_them():
    m = request_metrics(trace([1.0, 1.3, 1.9], tokens=[2, 3, 1], output_tokens=6))
    assert m.itl_ms == pytest.approx([300, 600])  # one gap per event, as vLLM records
    assert m.tbt_ms == pytest.approx([0, 100, 100, 100, 600])
    assert len(m.tbt_ms) == m.output_tokens - 1
    assert sum(m.tbt_ms) / len(m.tbt_ms) == pytest.approx(m.tpot_ms)


def test_usage_overrides_estimated_chunk_counts():
    m = request_metrics(trace([1.0, 2.0], tokens=[1, 1], output_tokens=4))
    assert m.output_tokens == 4 and len(m.tbt_ms) == 3
    assert sum(m.tbt_ms) == pytest.approx(1000)


def test_reasoning_deltas_delay_the_first_answer_token():
    m = request_metrics(trace([0.2, 0.3, 0.4, 0.9], kinds=[REASONING] * 3 + ["answer"]))
    assert m.ttft_ms == pytest.approx(200)
    assert m.ttfat_ms == pytest.approx(900)


def test_reasoning_that_never_answers_has_no_ttfat():
    m = request_metrics(trace([0.2, 0.3], kinds=[REASONING] * 2))
    assert m.ttft_ms == pytest.approx(200) and m.ttfat_ms is None


def test_error_mid_stream_fails_the_request_and_keeps_it_out_of_latencies():
    bad = trace([0.1, 0.2], error="stream_error")
    good = trace([0.1, 0.2, 0.3], output_tokens=3, prompt_tokens=10)
    ms = [request_metrics(bad), request_metrics(good)]
    assert not ms[0].ok and ms[0].error == "stream_error"
    s = summarize(ms, duration_s=2.0)
    assert s["successful"] == 1 and s["errors"] == {"stream_error": 1}
    assert s["ttft_ms"]["count"] == 1 and s["output_tokens"] == 3
    assert s["output_throughput_tok_s"] == pytest.approx(1.5)
    assert s["total_throughput_tok_s"] == pytest.approx(6.5)
    assert s["request_throughput_rps"] == pytest.approx(0.5)


def test_a_stream_that_never_ended_is_incomplete():
    t = trace([0.1])
    t.done = None
    assert request_metrics(t).error == "incomplete"


def test_empty_output_succeeds_without_ttft_or_tpot():
    m = request_metrics(RequestTrace(sent=0.0, done=0.05, output_tokens=0, prompt_tokens=5))
    assert m.ok and m.output_tokens == 0
    assert m.ttft_ms is None and m.tpot_ms is None and m.tbt_ms == [] and m.itl_ms == []
    assert m.e2e_ms == pytest.approx(50)


def test_one_token_has_no_tpot():
    m = request_metrics(trace([0.3], output_tokens=1))
    assert m.tpot_ms is None and m.tbt_ms == [] and m.output_tok_s is None


@given(st.lists(st.floats(-1e6, 1e6), min_size=1, max_size=50), st.sampled_from([50, 90, 99]))
def test_percentiles_match_numpy(values, q):
    assert percentile(values, q) == pytest.approx(np.percentile(values, q), rel=1e-9, abs=1e-6)


@given(st.lists(st.tuples(st.floats(1e-3, 1.0), st.integers(1, 5)), min_size=1, max_size=30))
def test_token_gaps_sum_to_decode_time_and_count_tokens_minus_one(events):
    t, times, tokens = 0.0, [], []
    for gap, k in events:
        t += gap
        times.append(t)
        tokens.append(k)
    m = request_metrics(trace(times, tokens=tokens))
    n = sum(tokens)
    assert len(m.tbt_ms) == n - 1 and len(m.itl_ms) == len(times) - 1
    assert math.isclose(sum(m.tbt_ms), (times[-1] - times[0]) * 1e3, rel_tol=1e-6, abs_tol=1e-6)


def test_slo_parsing_accepts_units_and_vllm_syntax():
    slo = Slo.parse("ttft=2s,tpot=150ms,e2e=30s", "95%")
    assert slo.thresholds == {"ttft": 2000, "tpot": 150, "e2e": 30000}
    assert slo.attainment == 0.95
    assert Slo.parse("ttft:500 tpot:50").thresholds == {"ttft": 500, "tpot": 50}
    with pytest.raises(ValueError):
        Slo.parse("latency=1s")


def test_goodput_counts_requests_meeting_every_threshold_and_met_needs_attainment():
    fast = [request_metrics(trace([0.1, 0.2, 0.3], output_tokens=3)) for _ in range(9)]
    slow = [request_metrics(trace([3.0, 3.1], output_tokens=2))]
    failed = [request_metrics(trace([0.1], error="http_503"))]
    slo = Slo.parse("ttft=1s,tpot=150ms")
    s = summarize(fast + slow, 5.0, slo)
    assert s["goodput_rps"] == pytest.approx(9 / 5)
    assert s["slo"]["attainment"] == pytest.approx(0.9) and s["slo"]["met"]
    s = summarize(fast + slow + failed, 5.0, slo)
    assert s["slo"]["requests_meeting"] == 9 and not s["slo"]["met"]


def test_distribution_of_nothing_is_null_not_zero():
    d = distribution([None, None])
    assert d["count"] == 0 and d["mean"] is None and d["p99"] is None


def test_lifeline_timings_split_ttft_into_its_stages():
    timings = {"gateway_ms": 1.0, "template_ms": 0.5, "tokenize_ms": 0.5, "queue_ms": 80.0,
               "prefill_ms": 10.0, "decode_ms": 50.0, "ttft_ms": 92.0, "e2e_ms": 150.0}
    t = trace([0.1, 0.2], server_timings=normalize({"timings": timings}))
    split = ttft_split(t, request_metrics(t))
    assert split == pytest.approx({"client_network": 8.0, "front": 2.0, "queue": 80.0,
                                   "prefill": 10.0})
    stages = breakdown([split])
    assert stages["queue_ms"]["share"] == pytest.approx(0.8)


def test_llama_cpp_timings_give_prefill_and_leave_the_rest_to_client_network():
    body = {"timings": {"prompt_n": 10, "prompt_ms": 30.0, "predicted_n": 5, "predicted_ms": 60.0}}
    t = trace([0.1], server_timings=normalize(body))
    split = ttft_split(t, request_metrics(t))
    assert split["prefill"] == 30.0 and split["queue"] is None
    assert split["client_network"] == pytest.approx(70.0)


def test_vllm_request_metrics_give_queue_and_prefill():
    body = {"metrics": {"arrival_time": 10.0, "first_scheduled_time": 10.05,
                        "first_token_time": 10.08, "time_in_queue": 0.05}}
    n = normalize(body)
    assert n["queue_ms"] == pytest.approx(50) and n["prefill_ms"] == pytest.approx(30)
    assert normalize({"choices": []}) is None


def _oracle(capacity: int):
    asked = []

    async def met(n: int) -> bool:
        asked.append(n)
        return n <= capacity
    return met, asked


@pytest.mark.parametrize("capacity,start,limit", [(13, 1, 1024), (1, 1, 64), (0, 1, 64),
                                                  (64, 1, 64), (5, 16, 64), (40, 3, 100)])
def test_search_finds_the_largest_concurrency_meeting_the_slo(capacity, start, limit):
    met, asked = _oracle(capacity)
    assert asyncio.run(search_max(met, start, limit)) == min(capacity, limit)
    assert len(asked) <= 2 * math.ceil(math.log2(limit)) + 2
    assert max(asked) <= limit


def test_cost_per_user_and_per_token():
    c = cost({"output_throughput_tok_s": 1000.0}, users=32, cost_per_hour=3.6, gpus=2)
    assert c["users_per_gpu"] == 16 and c["gpus_per_user"] == pytest.approx(1 / 16)
    assert c["output_tokens_per_dollar"] == pytest.approx(1e6)
    assert c["dollars_per_million_output_tokens"] == pytest.approx(1.0)



@pytest.mark.parametrize("capacity,start,limit", [(13.7, 1.0, 1000.0), (0.3, 4.0, 100.0),
                                                  (0.0, 1.0, 100.0), (500.0, 2.0, 64.0)])
def test_rate_search_brackets_the_largest_rate_meeting_the_slo(capacity, start, limit):
    async def met(rate: float) -> bool:
        return rate <= capacity

    found = asyncio.run(search_max_rate(met, start, limit, precision=0.05))
    best = min(capacity, limit)
    assert found <= best
    assert found == 0.0 if best < start / 64 else found >= best / 1.05
