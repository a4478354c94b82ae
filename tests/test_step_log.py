"""The engine's step log and each request's step facts, held against what the engine did: a prompt
longer than the token budget runs in chunks of the budget, a batch over `max_num_seqs` leaves
requests waiting with that limit named, a KV cache too small for the load preempts and
recomputes, and the KV bytes each step reads equal the model's shape times the attended context
(sliding-window layers capped at their window). Tiny random-weight models: only the scheduling
matters here."""
import pytest

from lifeline.engine.engine import EngineConfig, LLMEngine
from lifeline.engine.sampling_params import SamplingParams
from lifeline.model.config import ModelConfig
from lifeline.model.loader import LoadedModel, build_model, init_dummy_weights

DTYPE_BYTES = 4
"""The model executor's KV pools are float32."""


def _loaded(cfg: ModelConfig) -> LoadedModel:
    model = build_model(cfg)
    init_dummy_weights(model)
    return LoadedModel(model.eval(), cfg, None, "tiny", "dummy")


@pytest.fixture(scope="module")
def llama():
    return _loaded(ModelConfig(architecture="llama", vocab_size=128, hidden_size=32,
                               num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16,
                               intermediate_size=64, max_position=512))


@pytest.fixture(scope="module")
def hybrid():
    """Gemma 3's shape in small: two sliding-window layers (window 8), one global."""
    return _loaded(ModelConfig(architecture="gemma3", vocab_size=128, hidden_size=32,
                               num_layers=3, num_heads=2, num_kv_heads=2, head_dim=16,
                               intermediate_size=64, max_position=512, sliding_window=8,
                               layer_types=["sliding", "sliding", "full"],
                               query_pre_attn_scalar=16, hidden_act="gelu_pytorch_tanh",
                               tie_word_embeddings=True))


def _prompt(n: int, seed: int = 0) -> list[int]:
    return [(seed * 31 + 7 * j) % 120 + 1 for j in range(n)]


def _run(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> list:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    reqs = [engine.add_request(p, params, f"r{i}") for i, p in enumerate(prompts)]
    while engine.has_unfinished_requests():
        engine.step()
    return reqs


def _records(engine: LLMEngine) -> list[dict]:
    page = engine.step_log.after(0, 4096)
    assert page.dropped == 0
    return [r.as_dict() for r in page.records]


def _rows(records: list[dict], request_id: str) -> list[tuple[dict, dict]]:
    return [(rec, row) for rec in records for row in rec["requests"] if row["id"] == request_id]


def test_a_prompt_longer_than_the_budget_runs_in_chunks_of_the_budget(llama):
    engine = LLMEngine(llama, EngineConfig(block_size=4, num_kv_blocks=64,
                                           max_num_batched_tokens=16))
    [req] = _run(engine, [_prompt(50)], max_tokens=4)
    records = _records(engine)
    prefill = [(rec, row) for rec, row in _rows(records, "r0") if row["kind"] == "prefill"]
    assert [row["tokens"] for _, row in prefill] == [16, 16, 16, 2]
    assert [row["context"] for _, row in prefill] == [16, 32, 48, 50]
    assert [row["sampled"] for _, row in prefill] == [False, False, False, True]
    decode = [row for _, row in _rows(records, "r0") if row["kind"] == "decode"]
    assert [row["context"] for row in decode] == [51, 52, 53]
    assert [rec["step"] for rec in records] == list(range(1, len(records) + 1))
    assert all(rec["prefill_tokens"] + rec["decode_tokens"] <= 16 for rec in records)

    summary = req.timeline.steps.summary()
    rows = summary["steps"]["prefill"]
    assert [r[1:3] for r in rows] == [[16, 16], [16, 32], [16, 48], [2, 50]]
    assert [r[0] for r in rows] == [rec["step"] for rec, _ in prefill]
    assert [r[5] for r in rows] == [rec["duration_ms"] for rec, _ in prefill]
    assert len(rows) == len(req.timeline.prefill_chunks)
    assert summary["steps"]["decode_steps"] == 3
    assert summary["steps"]["decode_context"] == {"first": 51, "last": 53}
    assert summary["queue"]["steps_waited"] == 0 and summary["recomputed_tokens"] == 0


def test_a_batch_over_max_num_seqs_waits_with_that_limit_named(llama):
    engine = LLMEngine(llama, EngineConfig(block_size=4, num_kv_blocks=128, max_num_seqs=2,
                                           max_num_batched_tokens=64))
    reqs = _run(engine, [_prompt(6, i) for i in range(5)], max_tokens=5)
    records = _records(engine)
    first = records[0]
    assert [row["id"] for row in first["requests"]] == ["r0", "r1"]
    assert (first["running"], first["waiting"], first["limit"]) == (2, 3, "max_num_seqs")
    for rec in records:
        assert rec["running"] <= 2 and len(rec["requests"]) <= 2
        if rec["waiting"] and rec["running"] == 2:
            assert rec["limit"] == "max_num_seqs", rec
    for req in reqs:
        steps = [rec["step"] for rec, _ in _rows(records, req.request_id)]
        queue = req.timeline.steps.summary()["queue"]
        assert queue["steps_waited"] == steps[0] - 1
        assert queue["limit"] == ("max_num_seqs" if steps[0] > 1 else None)
        assert queue["max_num_seqs"] == 2 and queue["running_at_arrival"] == 0
        ahead = sum(rec["prefill_tokens"] for rec in records[:steps[0] - 1])
        assert queue["ahead_prefill_tokens"] == ahead
    waits = [rec["waiting"] for rec in records]
    assert waits == sorted(waits, reverse=True) and waits[-1] == 0


def test_a_tiny_kv_cache_preempts_and_the_recomputed_tokens_are_counted(llama):
    engine = LLMEngine(llama, EngineConfig(block_size=4, num_kv_blocks=14,
                                           max_num_batched_tokens=32,
                                           enable_prefix_caching=False))
    max_tokens = 12
    reqs = _run(engine, [_prompt(10, i) for i in range(4)], max_tokens=max_tokens)
    records = _records(engine)
    preempted = [rid for rec in records for rid in rec["preempted"]]
    assert preempted and len(preempted) == engine.scheduler.num_preemptions
    assert all(rec["limit"] == "kv_cache" for rec in records if rec["preempted"])
    assert all(rec["kv_blocks_used"] <= rec["kv_blocks_total"] == 14 for rec in records)
    total = 0
    for req in reqs:
        summary = req.timeline.steps.summary()
        computed = sum(row["tokens"] for _, row in _rows(records, req.request_id))
        needed = req.num_prompt_tokens + max_tokens - 1  # the last token is never fed back
        assert summary["recomputed_tokens"] == computed - needed
        assert (summary["recomputed_tokens"] > 0) == (req.request_id in preempted)
        assert req.num_preemptions == preempted.count(req.request_id)
        total += summary["recomputed_tokens"]
    assert total > 0


def _bytes_read(cfg: ModelConfig, context: int, tokens: int) -> int:
    """K and V of every layer over the keys the row's queries see: all of them on a global
    layer; on a sliding layer, the window before the first query up to the last."""
    per_layer = 2 * cfg.num_kv_heads * cfg.head_dim * DTYPE_BYTES
    seen = [context if kind == "full" else min(context, cfg.sliding_window + tokens - 1)
            for kind in cfg.layer_types]
    return per_layer * sum(seen)


@pytest.mark.parametrize("model", ["llama", "hybrid"])
def test_kv_bytes_read_follow_the_model_shape_and_the_window(model, request):
    loaded = request.getfixturevalue(model)
    cfg = loaded.config
    engine = LLMEngine(loaded, EngineConfig(block_size=4, num_kv_blocks=96,
                                            max_num_batched_tokens=12))
    reqs = _run(engine, [_prompt(30, 1), _prompt(7, 2)], max_tokens=6)
    records = _records(engine)
    for rec in records:
        expected = sum(_bytes_read(cfg, row["context"], row["tokens"])
                       for row in rec["requests"])
        assert rec["kv_bytes_read"] == expected, rec
    if model == "hybrid":  # a long context reads less than it holds
        full_only = 2 * cfg.num_kv_heads * cfg.head_dim * DTYPE_BYTES * cfg.num_layers
        last = records[-1]["requests"][-1]
        assert records[-1]["kv_bytes_read"] < full_only * last["context"]
    config = engine.step_log.config
    assert config["kv_bytes_per_token"] == 2 * cfg.num_kv_heads * cfg.head_dim * DTYPE_BYTES * (
        cfg.num_layers)
    for req in reqs:
        decode_steps = [rec for rec, row in _rows(records, req.request_id)
                        if row["kind"] == "decode"]
        per_token = req.timeline.steps.summary()["kv_bytes_read_per_token"]
        mean = sum(rec["kv_bytes_read"] for rec in decode_steps) / len(decode_steps)
        assert per_token == pytest.approx(mean)


def test_the_ring_keeps_the_last_steps_and_counts_what_rotated_out(llama):
    engine = LLMEngine(llama, EngineConfig(block_size=4, num_kv_blocks=64, step_log_size=5))
    _run(engine, [_prompt(5)], max_tokens=12)
    log = engine.step_log
    page = log.after(0, 100)
    assert [r.step for r in page.records] == [8, 9, 10, 11, 12]
    assert page.dropped == 7 and page.latest == 12
    assert [r.step for r in log.after(9, 2).records] == [10, 11]
    assert log.after(9, 2).dropped == 0
    assert log.after(12, 10).records == []
    assert [r.step for r in log.latest(2)] == [11, 12]


def test_with_the_log_off_nothing_is_kept_and_requests_still_report_their_steps(llama):
    engine = LLMEngine(llama, EngineConfig(block_size=4, num_kv_blocks=64, step_log_size=0,
                                           max_num_batched_tokens=8))
    [req] = _run(engine, [_prompt(20)], max_tokens=3)
    page = engine.step_log.after(0, 100)
    assert not engine.step_log.enabled and page.records == [] and page.latest == 5
    rows = req.timeline.steps.summary()["steps"]["prefill"]
    assert [r[1] for r in rows] == [8, 8, 4]
    assert engine.step_log.prefilling(["r0"]) == {}


def test_a_request_in_its_prefill_is_seen_as_such_until_its_first_token(llama):
    engine = LLMEngine(llama, EngineConfig(block_size=4, num_kv_blocks=64,
                                           max_num_batched_tokens=8))
    engine.add_request(_prompt(20), SamplingParams(max_tokens=2, ignore_eos=True), "r0")
    seen = []
    while engine.has_unfinished_requests():
        engine.step()
        seen.append(engine.step_log.prefilling(["r0"]))
    assert seen == [{"r0": 8}, {"r0": 16}, {}, {}]
