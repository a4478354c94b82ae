"""The diagnosis's arithmetic on step logs and timings built by hand, where every number is
known: the step-cost fit recovers the costs that made the steps, the causes partition TTFT and
TPOT exactly, and servers that report less get fewer causes and say what is missing. (The
scenarios against a real server are in test_diagnosis.py.)"""
import random

import pytest

from lifeline.bench.diagnose import diagnose, diagnose_request
from lifeline.bench.step_fit import fit_steps
from lifeline.bench.text_cost import RAISE_AT, reference_tokens, script_chars, text_stats

A, B, C, D = 2.0, 0.5, 0.01, 0.001
"""ms a step, a decode row, a prefill token, a context token."""


def _duration(rows, prefill, context):
    return A + B * rows + C * prefill + D * context


def _step(n, t, requests, preempted=()):
    rows = sum(r["kind"] == "decode" for r in requests)
    prefill = sum(r["tokens"] for r in requests if r["kind"] == "prefill")
    context = sum(r["context"] for r in requests if r["kind"] == "decode")
    return {"step": n, "start": 1e9 + t, "t": t, "duration_ms": _duration(rows, prefill, context),
            "requests": requests, "preempted": list(preempted), "prefill_tokens": prefill,
            "decode_tokens": rows}


def _chain(batches, gap=0.0):
    """Steps run back to back, `gap` ms of the engine's own work after each."""
    steps, t = [], 0.0
    for i, reqs in enumerate(batches):
        steps.append(_step(i + 1, t / 1e3, reqs))
        t += steps[-1]["duration_ms"] + gap
    return steps


def _random_steps(n=200, seed=0, gap=0.0):
    """Random batches; request r0 is in every one, so the engine never idles."""
    rng = random.Random(seed)
    batches = []
    for _ in range(n):
        rows = rng.randint(1, 8)
        reqs = [{"id": f"r{j}", "kind": "decode", "tokens": 1, "context": rng.randint(10, 3000),
                 "sampled": True} for j in range(rows)]
        if rng.random() < 0.3:
            reqs.append({"id": "p", "kind": "prefill", "tokens": rng.randint(16, 512),
                         "context": 512, "sampled": False})
        batches.append(reqs)
    return _chain(batches, gap)


def test_the_fit_recovers_the_costs_that_made_the_steps():
    cost = fit_steps(_random_steps(gap=0.25))
    assert cost.base_ms == pytest.approx(A + 0.25, rel=1e-6)  # a period: forward and the gap
    assert cost.row_ms == pytest.approx(B, rel=1e-6)
    assert cost.prefill_token_ms == pytest.approx(C, rel=1e-6)
    assert cost.context_token_ms == pytest.approx(D, rel=1e-6)
    assert cost.r2 == pytest.approx(1.0) and cost.confounded == ()


def test_a_batch_that_never_varies_is_confounded_with_the_base_and_costs_nothing_apart():
    batches = [s["requests"] for s in _random_steps(400)
               if sum(r["kind"] == "decode" for r in s["requests"]) == 4]
    cost = fit_steps(_chain(batches))
    assert cost.confounded == ("decode_rows",)
    assert cost.row_ms == 0 and cost.base_ms == pytest.approx(A + 4 * B, rel=1e-6)


def test_coefficients_stay_non_negative_on_data_that_would_pull_one_below_zero():
    rng = random.Random(1)
    steps, t = [], 0.0
    for i in range(50):
        rows = rng.randint(1, 6)
        reqs = [{"id": f"r{j}", "kind": "decode", "tokens": 1, "context": 100}
                for j in range(rows)]
        s = _step(i + 1, t / 1e3, reqs)
        s["duration_ms"] = 10.0 - 0.3 * rows + rng.random() * 0.01  # faster with more rows
        t += s["duration_ms"]
        steps.append(s)
    cost = fit_steps(steps)
    assert min(cost.base_ms, cost.row_ms, cost.prefill_token_ms, cost.context_token_ms) >= 0


# --- a run built by hand ----------------------------------------------------------------------

class Run:
    """Two requests: `x` prefills 300 tokens (two chunks, the first shared with `y`'s decode)
    and decodes 4 tokens beside `y`; `y` decodes alone first. Step times follow A..D exactly
    and the engine loses `gap` ms between steps."""

    def __init__(self, gap=0.5, client_lag=3.0, stream_lag=0.2):
        self.steps, self.t = [], 0.0
        self.gap = gap
        y_ctx = 40
        self.add([{"id": "y", "kind": "prefill", "tokens": 40, "context": 40, "sampled": True}])
        self.y_first = self.t
        for _ in range(3):
            y_ctx += 1
            self.add([{"id": "y", "kind": "decode", "tokens": 1, "context": y_ctx,
                       "sampled": True}])
        self.x_arrival = self.t - 1.0
        self.x_scheduled = self.t
        y_ctx += 1
        self.add([{"id": "y", "kind": "decode", "tokens": 1, "context": y_ctx, "sampled": True},
                  {"id": "x", "kind": "prefill", "tokens": 200, "context": 200,
                   "sampled": False}])
        self.add([{"id": "x", "kind": "prefill", "tokens": 100, "context": 300,
                   "sampled": True}])  # y is left out: x's chunk took the budget
        self.x_first = self.t
        x_ctx = 300
        for _ in range(4):
            x_ctx, y_ctx = x_ctx + 1, y_ctx + 1
            self.add([{"id": "y", "kind": "decode", "tokens": 1, "context": y_ctx,
                       "sampled": True},
                      {"id": "x", "kind": "decode", "tokens": 1, "context": x_ctx,
                       "sampled": True}])
        self.x_last = self.t
        for _ in range(8):  # y alone again: the fit needs rows to vary
            y_ctx += 1
            self.add([{"id": "y", "kind": "decode", "tokens": 1, "context": y_ctx,
                       "sampled": True}])
        self.client_lag, self.stream_lag = client_lag, stream_lag

    def add(self, requests):
        step = _step(len(self.steps) + 1, self.t / 1e3, requests)
        self.steps.append(step)
        self.t += step["duration_ms"] + self.gap

    def x_record(self):
        front = 1.5
        queue = self.x_scheduled - self.x_arrival
        prefill = self.x_first - self.gap - self.x_scheduled  # ends at the step's end
        decode = self.x_last - self.x_first
        ttft = front + queue + prefill
        raw = {"gateway_ms": 1.0, "template_ms": 0.3, "tokenize_ms": 0.2, "queue_ms": queue,
               "prefill_ms": prefill, "decode_ms": decode, "detokenize_ms": 0.0,
               "stream_ms": 0.4, "ttft_ms": ttft, "e2e_ms": ttft + decode + 0.4,
               "cached_tokens": 0, "prompt_tokens": 300, "completion_tokens": 5,
               "queue": {"steps_waited": 1, "ahead_prefill_tokens": 0, "limit": None,
                         "running_at_arrival": 1, "max_num_seqs": 4}}
        from lifeline.bench.stages import normalize
        n = 5
        client_ttft = ttft + self.client_lag
        client_tpot = (decode + 0.4 + self.stream_lag * (n - 1)) / (n - 1)
        return {"ok": True, "id": "x", "ttft_ms": client_ttft, "ttfat_ms": client_ttft,
                "tpot_ms": client_tpot, "output_tokens": n, "turn": 0, "connect_ms": 0.0,
                "server_timings": normalize({"timings": raw}), "timings_raw": raw}


def _results(records, log=None, **extra):
    return {"schema": "lifeline.bench/1", "settings": {"url": "http://x/v1"}, "summary": {},
            "requests": records, "step_log": log, **extra}


def test_ttft_causes_partition_the_ttft_and_split_the_prefill_between_own_and_others():
    run = Run()
    rec = run.x_record()
    d = diagnose(_results([rec], {"data": run.steps}))
    findings = {f["cause"]: f for f in d["ttft"]["findings"]}
    assert sum(f["ms"] for f in findings.values()) == pytest.approx(rec["ttft_ms"])
    assert sum(f["share"] for f in findings.values()) == pytest.approx(1.0)
    assert findings["client_network"]["ms"] == pytest.approx(run.client_lag)
    assert findings["front"]["ms"] == pytest.approx(1.5)
    # x's first chunk shared its step with one decode row: by tokens, 200 of 201 are its own
    s1, s2 = run.steps[4], run.steps[5]
    first = s1["duration_ms"] + run.gap  # the first chunk's period, then the last's forward
    own_steps = first * 200 / 201 + s2["duration_ms"]
    prefill = rec["server_timings"]["prefill_ms"]
    own = own_steps * prefill / (first + s2["duration_ms"])
    assert findings["prefill"]["ms"] == pytest.approx(own)
    assert findings["prefill_interference"]["ms"] == pytest.approx(prefill - own)


def test_output_causes_partition_the_tpot_by_the_fit_and_the_stream():
    run = Run(gap=0.0)
    rec = run.x_record()
    d = diagnose(_results([rec], {"data": run.steps}))
    out = {f["cause"]: f for f in d["output"]["findings"]}
    assert sum(f["ms"] for f in out.values()) == pytest.approx(rec["tpot_ms"])
    assert sum(f["share"] for f in out.values()) == pytest.approx(1.0)
    n = rec["output_tokens"]
    assert out["client_network"]["ms"] == pytest.approx((0.4 + run.stream_lag * (n - 1)) / (n - 1))
    # no gap between steps: each decode step is exactly A + 2B + D·(both contexts)
    x_ctx = [301, 302, 303, 304]
    assert out["decode"]["ms"] == pytest.approx(A + B)
    assert out["kv_context"]["ms"] == pytest.approx(D * sum(x_ctx) / 4)
    assert out["batch"]["ms"] == pytest.approx(B + D * sum(range(45, 49)) / 4)


def test_without_a_step_log_the_output_is_one_decode_cause_and_missing_says_why():
    rec = Run().x_record()
    d = diagnose(_results([rec]))
    causes = [f["cause"] for f in d["output"]["findings"]]
    assert set(causes) == {"client_network", "decode"}
    assert any("no step log" in m for m in d["missing"])


def test_a_llama_cpp_record_gets_prefill_and_client_network_only():
    from lifeline.bench.stages import normalize
    body = {"timings": {"prompt_n": 100, "prompt_ms": 80.0, "predicted_n": 9,
                        "predicted_ms": 40.0, "cache_n": 0}}
    rec = {"ok": True, "id": "a", "ttft_ms": 100.0, "ttfat_ms": 100.0, "tpot_ms": 6.0,
           "output_tokens": 9, "server_timings": normalize(body), "timings_raw": body["timings"]}
    d = diagnose(_results([rec]))
    ttft = {f["cause"]: f["ms"] for f in d["ttft"]["findings"]}
    assert ttft == pytest.approx({"prefill": 80.0, "client_network": 20.0})
    assert d["ttft"]["findings"][0]["cause"] == "prefill"
    assert any("llama.cpp reports no front or queue" in m for m in d["missing"])
    out = {f["cause"]: f["ms"] for f in d["output"]["findings"]}
    assert out == pytest.approx({"decode": 5.0, "client_network": 1.0})


def test_thinking_before_the_answer_gets_its_own_section():
    rec = Run().x_record()
    rec["ttfat_ms"] = rec["ttft_ms"] + 50.0
    rec["timings_raw"]["reasoning_tokens"] = 10
    d = diagnose(_results([rec]))
    first = d["answer"]["findings"][0]
    assert first["cause"] == "reasoning" and first["ms"] == pytest.approx(50.0)
    assert sum(f["ms"] for f in d["answer"]["findings"]) == pytest.approx(rec["ttfat_ms"])


def test_a_request_seen_by_the_server_alone_is_diagnosed_from_its_timings():
    run = Run()
    raw = run.x_record()["timings_raw"]
    d = diagnose_request(raw, {"data": run.steps}, request_id="x")
    assert sum(f["ms"] for f in d["ttft"]["findings"]) == pytest.approx(raw["ttft_ms"])
    tpot = (raw["e2e_ms"] - raw["ttft_ms"]) / 4
    assert sum(f["ms"] for f in d["output"]["findings"]) == pytest.approx(tpot)
    assert any("no client clock" in m for m in d["missing"])


def test_prompt_assembly_takes_the_prefill_of_what_the_template_added():
    rec = Run().x_record()
    rec["timings_raw"]["prompt_anatomy"] = {"system": 240, "tools": 0, "history": 0,
                                            "latest_user": 50, "template": 10, "total": 300}
    d = diagnose(_results([rec]))
    f = {x["cause"]: x for x in d["ttft"]["findings"]}
    prefill = rec["server_timings"]["prefill_ms"]
    assert f["prompt_assembly"]["ms"] == pytest.approx(prefill * 250 / 300)
    assert f["prefill"]["ms"] == pytest.approx(prefill * 50 / 300)
    assert f["prompt_assembly"]["numbers"]["dominant"] == "system"
    assert "system prompt is 80% of the prompt" in f["prompt_assembly"]["title"]


def test_a_tokenizer_that_splits_finely_takes_the_excess_of_the_prefill():
    text = "今天天气很好，我们一起去公园散步吧。" * 10
    byte_tokens = len(text.encode())
    stats = text_stats([text], [byte_tokens], english_tokens=574)
    ratio = byte_tokens / reference_tokens(text)
    assert stats["ratio"] == pytest.approx(ratio) and ratio > RAISE_AT
    rec = Run().x_record()
    d = diagnose(_results([rec], text_cost=stats))
    f = {x["cause"]: x for x in d["ttft"]["findings"]}
    prefill = rec["server_timings"]["prefill_ms"]
    assert f["tokenizer"]["ms"] == pytest.approx(prefill * (1 - 1 / ratio))


def test_scripts_are_counted_with_their_punctuation():
    assert script_chars("hello, world") == {"latin": 12}
    assert script_chars("你好，世界") == {"han": 5}
    assert script_chars("(12) ab") == {"digit": 5, "latin": 2}
    assert script_chars("...") == {"common": 3}
