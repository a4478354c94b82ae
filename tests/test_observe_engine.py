"""Records built from the timelines a real engine fills (a tiny random-weight model): the stages
stay non-negative and add up to E2E under batching and preemption, and the Prometheus counters
equal the engine's own totals."""
import time

import pytest

from lifeline.engine.engine import EngineConfig, LLMEngine
from lifeline.engine.sampling_params import SamplingParams
from lifeline.model.config import ModelConfig
from lifeline.model.loader import LoadedModel, build_model, init_dummy_weights
from lifeline.observe import STAGES, Metrics, RequestRecord, ServerStamps
from lifeline.observe.stats import EngineStats


@pytest.fixture(scope="module")
def loaded():
    cfg = ModelConfig(architecture="llama", vocab_size=128, hidden_size=32, num_layers=2,
                      num_heads=2, num_kv_heads=1, head_dim=16, intermediate_size=64,
                      max_position=256)
    model = build_model(cfg)
    init_dummy_weights(model)
    return LoadedModel(model.eval(), cfg, None, "tiny", "dummy")


def serve(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams):
    """What a server does around the engine, synchronously: stamp, add, step, stamp."""
    stamps, reqs = {}, {}
    for i, prompt in enumerate(prompts):
        st = ServerStamps(arrival=time.perf_counter())
        for name in ("parsed", "templated", "tokenized"):
            st.mark(name)
        req = engine.add_request(prompt, params, f"r{i}", arrival=st.arrival)
        stamps[req.request_id], reqs[req.request_id] = st, req
    records = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                st, req = stamps[out.request_id], out.request
                st.mark("last_byte")
                records.append(RequestRecord.build(
                    st, req.timeline, request_id=req.request_id, model="tiny",
                    endpoint="/v1/completions", prompt_tokens=req.num_prompt_tokens,
                    cached_tokens=req.num_cached_tokens,
                    completion_tokens=req.num_output_tokens, finish_reason=out.finish_reason,
                    anatomy=None))
    return records


def test_stages_are_non_negative_and_cover_e2e_under_preemption(loaded):
    engine = LLMEngine(loaded, EngineConfig(block_size=4, num_kv_blocks=24,
                                            max_num_batched_tokens=16))
    prompts = [[(7 * i + j) % 120 + 1 for j in range(10 + 3 * i)] for i in range(6)]
    records = serve(engine, prompts, SamplingParams(max_tokens=12, ignore_eos=True))
    assert engine.scheduler.num_preemptions > 0
    assert sum(r.preemptions for r in records) == engine.scheduler.num_preemptions
    for rec in records:
        t = rec.timings()
        for name in STAGES:
            assert t[f"{name}_ms"] >= 0, (rec.request_id, name, t)
        assert sum(t[f"{name}_ms"] for name in STAGES) == pytest.approx(t["e2e_ms"], abs=1e-6)
        assert t["completion_tokens"] == 12 and len(rec.token_gaps) == 11
        assert t["ttft_ms"] <= t["e2e_ms"] and t["ttfat_ms"] == t["ttft_ms"]
        assert t["prefill_chunks"] >= 1


def test_counters_equal_the_engine_totals(loaded):
    engine = LLMEngine(loaded, EngineConfig(block_size=4, num_kv_blocks=64))
    shared = list(range(1, 17))
    metrics = Metrics("tiny")
    records = serve(engine, [shared + [20 + i] for i in range(3)], SamplingParams(max_tokens=3))
    records += serve(engine, [shared + [40]], SamplingParams(max_tokens=3))
    for rec in records:
        metrics.observe(rec)
    metrics.update_stats(EngineStats.of(engine))
    metrics.update_stats(EngineStats.of(engine))
    stats = engine.block_manager.stats
    assert stats.hits > 0

    def value(name: str) -> float:
        return metrics.registry.get_sample_value(name, {"model_name": "tiny"})

    assert value("lifeline:prefix_cache_queries_total") == stats.queries
    assert value("lifeline:prefix_cache_hits_total") == stats.hits
    assert value("lifeline:prompt_tokens_total") == 4 * 17
    assert value("lifeline:generation_tokens_total") == sum(r.completion_tokens for r in records)
    assert value("lifeline:num_requests_running") == 0
    assert value("lifeline:kv_cache_usage_perc") == engine.block_manager.usage
    assert records[-1].cached_tokens == 16
