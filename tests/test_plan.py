"""`lifeline plan`'s core: the simulated executor in the real engine, the roofline's terms, and
the load on the virtual clock. The catalog and the command line are in test_plan_command.py,
the check against the real engine on this CPU in test_plan_cpu.py."""
from __future__ import annotations

import dataclasses
import math

import pytest

from lifeline.bench.run import BenchSettings
from lifeline.model.presets import preset_config
from lifeline.plan.cost import BYTES, CostModel, _window_pairs
from lifeline.plan.hardware import Efficiency, Hardware
from lifeline.plan.run import run_plan
from lifeline.plan.sim import Deployment

GPU = Hardware("test-gpu", "Test GPU", "gpu", {"fp32": 50e12, "bf16": 400e12, "fp8": 800e12},
               2e12, 80e9, 300e9, "test link", 2.0, "test", "2026-12",
               efficiency=Efficiency(gemm=0.5, memory=0.8, attention=0.4, step_overhead_s=1e-3,
                                     seq_overhead_s=1e-5, request_overhead_s=2e-3))


def settings(**kw) -> BenchSettings:
    base = {"url": "plan://test", "model": "m", "warmup": 0, "requests": 8}
    return BenchSettings(**{**base, **kw})


def deployment(name: str = "llama-3.1-8b", **kw) -> Deployment:
    cost_kw = {k: kw.pop(k) for k in ("weights", "kv_dtype", "tp") if k in kw}
    return Deployment(CostModel(preset_config(name), GPU, **cost_kw), **kw)


def test_one_user_sees_exactly_the_steps_the_cost_model_prices():
    """One request alone: TTFT is the front plus its prefill chunks' steps, and every later
    token one decode step at its position (the engine's chunking, the executor's clock)."""
    d = deployment(max_num_batched_tokens=256)
    r = run_plan(settings(requests=1, input_tokens=600, output_tokens=5), d)
    rec = r["requests"][0]
    cost = d.cost
    chunks = [(256, 0), (256, 256), (88, 512)]
    prefill = sum(cost.step([c], int(c[1] + c[0] == 600)).seconds for c in chunks)
    assert rec["ttft_ms"] == pytest.approx((2e-3 + prefill) * 1e3, rel=1e-9)
    decode = [cost.step([(1, 600 + i)], 1).seconds * 1e3 for i in range(4)]
    assert rec["tbt_ms"] == pytest.approx(decode, rel=1e-9)
    assert rec["server_timings"]["prefill_chunks"] == 3
    assert rec["output_tokens"] == 5 and rec["prompt_tokens"] == 600


def test_shared_prefixes_hit_the_engines_prefix_cache():
    """The engine's own KV manager runs: requests sharing a 512-token system prompt compute
    only the rest after the first, and their TTFT falls; without prefix caching it does not."""
    s = settings(requests=12, input_tokens=640, output_tokens=4, prefix_groups=1,
                 prefix_tokens=512)
    hit = run_plan(s, deployment())
    miss = run_plan(s, deployment(enable_prefix_caching=False))
    cached = [rec["server_timings"]["cached_tokens"] for rec in hit["requests"]]
    assert cached[0] == 0 and all(c == 512 for c in cached[1:])
    assert all(rec["server_timings"]["cached_tokens"] == 0 for rec in miss["requests"])
    assert hit["summary"]["ttft_ms"]["p50"] < miss["summary"]["ttft_ms"]["p50"]
    assert hit["plan"]["scheduler"]["prefix_hit_rate"] > 0.5


def test_a_small_kv_cache_bounds_concurrency_and_says_so():
    """32 users of 2,048-token contexts in a cache of ~16k tokens: never more running than the
    cache holds, and the plan names KV capacity as what held admission back."""
    d = deployment(kv_cache_bytes=16_384 * 131_072)  # 16,384 tokens of bf16 K and V
    r = run_plan(settings(concurrency=32, requests=64, input_tokens=1536, output_tokens=512), d)
    plan = r["plan"]
    assert plan["memory"]["kv_tokens"] == 16_384
    assert plan["scheduler"]["peak_running"] <= 16_384 // 1536 + 1
    assert plan["bounds"]["admission"] == "KV capacity"
    assert r["summary"]["failed"] == 0


def test_offline_rate_inf_sends_everything_at_once():
    r = run_plan(settings(rate=math.inf, requests=50, input_tokens=128, output_tokens=16),
                 deployment())
    assert [rec["sent_s"] for rec in r["requests"]] == [0.0] * 50
    assert r["summary"]["successful"] == 50
    assert r["plan"]["scheduler"]["peak_running"] == 50


def test_a_ramp_up_spreads_the_users_first_requests_as_the_bench_does():
    """The plan starts closed-loop user i of N at i·ramp/N on the virtual clock (the bench's
    `ramp_up_start`). Spread further apart than a prefill (and each request longer than the
    ramp, so each user sends one), no prompt waits for another's prefill: each TTFT is within
    a decode step of the lone request's; all at once, the last waits for three prefills."""
    d = deployment()
    kw = dict(concurrency=4, requests=4, input_tokens=2048, output_tokens=200)
    lone = run_plan(settings(**{**kw, "concurrency": 1, "requests": 1}), d)
    ramped = run_plan(settings(ramp_up_s=1.0, **kw), d)
    burst = run_plan(settings(**kw), d)
    assert sorted(rec["sent_s"] for rec in ramped["requests"]) == pytest.approx(
        [0.0, 0.25, 0.5, 0.75])
    alone = lone["requests"][0]["ttft_ms"]
    decode_ms = max(lone["requests"][0]["tbt_ms"])
    assert alone > 3 * decode_ms
    for rec in ramped["requests"]:
        assert alone <= rec["ttft_ms"] <= alone + 2 * decode_ms
    assert max(rec["ttft_ms"] for rec in burst["requests"]) > 3 * alone
    assert ramped["settings"]["ramp_up_s"] == 1.0


def test_closed_loop_multi_turn_sessions_reuse_their_history():
    """Turn 2 sends turn 1's prompt and answer again: its prompt is longer and cached."""
    r = run_plan(settings(concurrency=2, requests=8, turns=2, endpoint="chat",
                          input_tokens=200, output_tokens=20), deployment())
    second = [rec for rec in r["requests"] if rec["turn"] == 1]
    assert second and all(rec["prompt_tokens"] > 400 for rec in second)
    assert all(rec["server_timings"]["cached_tokens"] >= 208 for rec in second)


def test_roofline_terms_decode_is_bandwidth_prefill_is_compute():
    cost = deployment(weights="fp8", kv_dtype="fp8").cost
    decode = cost.step([(1, 1000)], 1)
    assert decode.bound == "memory"
    # the weights once, at a byte each: the step cannot beat weights / achieved bandwidth
    assert decode.seconds > cost.weight_bytes() / (GPU.memory_bandwidth * 0.8)
    prefill = cost.step([(4096, 0)], 1)
    assert prefill.bound == "compute"
    flops = 2 * 4096 * (cost.model.num_params() - cost.model.vocab_size * 4096 * 2)
    assert prefill.by_kind["gemm"] == pytest.approx(flops / (800e12 * 0.5), rel=0.02)


def test_a_cpus_ops_add_their_compute_and_memory_and_a_batch_pays_its_gemm_set_up():
    """`combine="sum"`: each op costs compute + memory (a GPU: the larger); attention's KV at
    `kv_memory`; `batch_overhead_s` only for a step of more than one row;
    `served_step_factor` scales the whole step."""
    model = preset_config("gemma-3-270m")
    cpu = Hardware("test-cpu", "Test CPU", "cpu", {"fp32": 100e9, "int8": 400e9}, 20e9,
                   16e9, 20e9, "memory", 0.0, "test", "2026-12",
                   efficiency=Efficiency(gemm=0.5, memory=0.8, kv_memory=0.2, attention=0.4,
                                         combine="sum", step_overhead_s=3e-3,
                                         seq_overhead_s=1e-4, batch_overhead_s=5e-3))
    roof = dataclasses.replace(cpu, efficiency=dataclasses.replace(cpu.efficiency,
                                                                   combine="max"))
    work = [(1, 300), (1, 40)]
    add = CostModel(model, cpu, weights="int8", kv_dtype="fp32").step(work, 2)
    big = CostModel(model, roof, weights="int8", kv_dtype="fp32").step(work, 2)
    assert add.compute_s > 0 and add.memory_s > 0
    assert add.seconds == pytest.approx(add.compute_s + add.memory_s + add.by_kind["overhead"])
    assert big.seconds < add.seconds
    # the KV read at kv_memory of the bandwidth: 340 tokens of context, K and V, every layer
    kv = CostModel(model, cpu, weights="int8", kv_dtype="fp32")
    context_bytes = 340 * kv.kv_bytes * model.num_layers
    half = dataclasses.replace(cpu, efficiency=dataclasses.replace(cpu.efficiency,
                                                                   kv_memory=0.1))
    slower = CostModel(model, half, weights="int8", kv_dtype="fp32").step(work, 2)
    assert slower.by_kind["attention"] - add.by_kind["attention"] > context_bytes / (
        20e9 * 0.2)
    one = kv.step([(1, 300)], 1)
    assert one.by_kind["overhead"] == pytest.approx(3e-3 + 1e-4)
    assert add.by_kind["overhead"] == pytest.approx(3e-3 + 2e-4 + 5e-3)
    served = dataclasses.replace(cpu, efficiency=dataclasses.replace(cpu.efficiency,
                                                                     served_step_factor=1.25))
    assert CostModel(model, served, weights="int8", kv_dtype="fp32").step(
        work, 2).seconds == pytest.approx(1.25 * add.seconds)
    with pytest.raises(ValueError, match="combine"):
        CostModel(model, dataclasses.replace(cpu, efficiency=dataclasses.replace(
            cpu.efficiency, combine="mean")))


def test_kv_bytes_follow_gqa_mqa_and_dtype():
    llama = deployment(kv_dtype="fp8").cost  # 32 layers, 8 KV heads of 128
    assert llama.kv_bytes_per_token() == 2 * 32 * 8 * 128 * BYTES["fp8"]
    gemma = deployment("gemma-3-270m", kv_dtype="bf16").cost  # MQA: one KV head of 256
    assert gemma.kv_bytes_per_token() == 2 * 18 * 1 * 256 * 2


def test_sliding_window_layers_read_only_their_window():
    assert _window_pairs(0, 10, 1024) == 55
    assert _window_pairs(5000, 10, 1024) == 10 * 1024
    brute = sum(min(p, 1024) for p in range(1000 + 1, 1000 + 100 + 1))
    assert _window_pairs(1000, 100, 1024) == brute
    gemma = deployment("gemma-3-27b").cost
    short, long = gemma.step([(1, 2_000)], 1), gemma.step([(1, 64_000)], 1)
    # 52 of 62 layers slide over 1,024 tokens: 32x the context costs the global layers only
    full_only = 64_000 / 2_000
    grown = long.by_kind["attention"] / short.by_kind["attention"]
    assert 1 < grown < full_only / 3


def test_moe_reads_the_experts_a_batch_touches():
    cost = deployment("qwen3-30b-a3b").cost
    one, many = cost.step([(1, 100)], 1), cost.step([(1, 100)] * 256, 256)
    m = cost.model
    per_expert = 3 * m.hidden_size * m.moe_intermediate_size * 2  # bf16
    # one token reads its 8 experts per layer; 256 tokens nearly all 128
    assert one.by_kind["moe"] * GPU.memory_bandwidth * 0.8 == pytest.approx(
        48 * (8 * per_expert + m.hidden_size * 128 * 2), rel=0.05)
    touched = 128 * (1 - (1 - 8 / 128) ** 256)
    assert touched > 127
    assert many.by_kind["moe"] / one.by_kind["moe"] < 128 / 8 + 1


def test_tensor_parallel_splits_weights_and_adds_all_reduces():
    one, two = deployment(tp=1).cost, deployment(tp=2).cost
    assert two.weight_bytes() == pytest.approx(one.weight_bytes() / 2, rel=0.01)
    step = two.step([(1, 100)] * 8, 8)
    assert step.by_kind["comm"] > 0 and one.step([(1, 100)] * 8, 8).by_kind["comm"] == 0


def test_a_model_that_does_not_fit_is_a_clear_error():
    with pytest.raises(ValueError, match="does not fit"):
        deployment("llama-3.1-8b", weights="fp32", kv_cache_bytes=None,
                   gpu_memory_utilization=0.3).engine()


def test_a_prompt_longer_than_the_context_fails_alone():
    d = deployment(max_model_len=1024)
    r = run_plan(settings(requests=2, input_tokens=2000, output_tokens=4), d)
    assert r["summary"]["failed"] == 2
    assert r["summary"]["errors"] == {"http_400": 2}


def test_a_burst_queues_at_the_fronts_serial_part():
    """The front's serial part (a server's one event loop) takes requests one at a time: at
    rate inf with a wholly serial front (an engine profile's) the k-th request reaches the
    engine k front-times after it was sent; a front that is all latency lets them in at once."""
    s = settings(rate=math.inf, requests=5, input_tokens=32, output_tokens=2)
    serial = run_plan(s, deployment(request_overhead_s=2e-3))
    fronts = sorted(rec["server_timings"]["front_ms"] for rec in serial["requests"])
    assert fronts == pytest.approx([2.0, 4.0, 6.0, 8.0, 10.0])
    latency = run_plan(s, deployment())  # GPU's efficiency: 2 ms, no serial part
    assert [rec["server_timings"]["front_ms"] for rec in latency["requests"]] == \
        pytest.approx([2.0] * 5)
