"""One request never stalls or fails the others: the context is clamped to the KV pool, a
step that raises fails only the request that makes it raise, deadlines end requests, and the
blocks of every request come back."""
import pytest

from lifeline.engine.engine import EngineConfig, LLMEngine
from lifeline.engine.request import FinishReason, RequestError
from lifeline.engine.sampling_params import SamplingParams
from lifeline.model.config import ModelConfig, gemma3_layer_types
from lifeline.model.default import default_model_path
from lifeline.model.loader import LoadedModel, build_model, init_dummy_weights
from lifeline.tokenizer import load_tokenizer

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    """A tiny random Gemma 3 over the real model's tokenizer: both of its KV groups (sliding
    windows of 8 tokens, and full attention), so scheduling, preemption, faults and the
    blocks' return are walked as on the real model, whose weights these tests never look at
    (a step ~2 ms, where the real model's float32 step took ~50-100: the preemption test alone
    ran 37 s in make test)."""
    tokenizer = load_tokenizer(default_model_path())
    cfg = ModelConfig("gemma3", vocab_size=tokenizer.vocab_size, hidden_size=32, num_layers=4,
                      num_heads=2, num_kv_heads=1, head_dim=16, intermediate_size=64,
                      max_position=512, sliding_window=8, rope_local_theta=1e4,
                      layer_types=gemma3_layer_types(4, 2), query_pre_attn_scalar=16,
                      hidden_act="gelu_pytorch_tanh", qk_norm=True, tie_word_embeddings=True)
    model = build_model(cfg)
    init_dummy_weights(model, seed=5)
    return LoadedModel(model.eval(), cfg, tokenizer, "tiny-gemma3", "dummy-f32")


def _engine(loaded, **kw) -> LLMEngine:
    return LLMEngine(loaded, EngineConfig(**{"kv_cache_memory_bytes": 64 << 20, **kw}))


def _run(engine: LLMEngine, max_steps: int = 2000) -> dict[str, list]:
    outputs: dict[str, list] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return outputs
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    raise AssertionError(f"still unfinished after {max_steps} steps")


def _free_everywhere(engine: LLMEngine) -> bool:
    return all(g.num_free_blocks == g.num_blocks for g in engine.block_manager.groups)


def test_context_is_clamped_to_what_the_kv_pool_holds(loaded):
    engine = _engine(loaded, num_kv_blocks=8)
    assert engine.max_model_len == 8 * 16 < loaded.config.max_position
    assert engine.max_model_len_reason == "kv_cache"
    with pytest.raises(ValueError, match="context"):
        engine.add_request(list(range(2, 2 + 128)), GREEDY)


def test_requests_that_fit_alone_but_not_together_all_finish(loaded):
    engine = _engine(loaded, num_kv_blocks=8)
    params = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)
    ids = [engine.add_request(list(range(10 + i, 10 + i + 60)), params).request_id
           for i in range(3)]
    outputs = _run(engine)
    for rid in ids:
        last = outputs[rid][-1]
        assert last.finished and last.finish_reason == "length"
        assert last.request.num_tokens == engine.max_model_len  # to the end of the context
    assert sum(outputs[r][-1].request.num_preemptions for r in ids) > 0
    assert _free_everywhere(engine)


def test_a_faulty_request_fails_alone_and_the_others_finish(loaded):
    engine = _engine(loaded)
    good = [engine.add_request([2, 100 + i, 200, 300], GREEDY) for i in range(3)]
    bad = engine.add_request([2, 50, 60], GREEDY, fault="step")
    outputs = _run(engine)
    assert outputs[bad.request_id][-1].error is RequestError.STEP_FAILED
    assert outputs[bad.request_id][-1].finished
    for req in good:
        assert req.error is None and req.finish_reason is FinishReason.LENGTH
        assert req.num_output_tokens == 8
    assert engine.step_errors.count == 2  # the shared step, then the culprit alone
    assert engine.step_errors.requests_failed == 1
    assert _free_everywhere(engine) and not engine.requests


def test_a_request_outlives_any_number_of_faulty_neighbours(loaded):
    """Each faulty newcomer fails its shared step; the long request beside them is cleared by
    its step alone every time, so it is never failed for being near them."""
    engine = _engine(loaded)
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    good = engine.add_request([2, 10, 11, 12], params)
    for i in range(5):
        engine.step()
        engine.step()
        engine.add_request([2, 40 + i, 50], GREEDY, fault="step")
    _run(engine)
    assert good.error is None and good.num_output_tokens == 20
    assert engine.step_errors.requests_failed == 5


def test_isolated_requests_give_the_same_tokens_as_an_undisturbed_run(loaded):
    """Recomputing the victims of a failed step changes nothing they produce."""
    prompts = [[2, 100 + i, 200, 300, 400] for i in range(3)]
    plain = _engine(loaded)
    ref = [plain.add_request(p, GREEDY) for p in prompts]
    _run(plain)
    engine = _engine(loaded)
    reqs = [engine.add_request(p, GREEDY) for p in prompts]
    engine.step()  # their prefill together, then a faulty newcomer joins their decode
    engine.add_request([2, 7, 8], GREEDY, fault="step")
    _run(engine)
    assert [r.output_token_ids for r in reqs] == [r.output_token_ids for r in ref]
    assert all(r.num_preemptions == 1 for r in reqs)


def test_a_deadline_ends_a_running_request_with_length_and_a_queued_one_with_an_error(loaded):
    engine = _engine(loaded, max_num_seqs=1)
    now = [engine.clock()]
    engine.clock = lambda: now[0]
    params = SamplingParams(max_tokens=10_000, temperature=0, ignore_eos=True)
    running = engine.add_request([2, 10, 11, 12], params, deadline=now[0] + 60)
    queued = engine.add_request([2, 20, 21, 22], params, deadline=now[0] + 60)
    for _ in range(3):
        engine.step()
    now[0] += 61
    outputs = _run(engine)
    assert running.finish_reason is FinishReason.LENGTH and running.stop_reason == "timeout"
    assert running.error is None and 0 < running.num_output_tokens < 10
    assert outputs[queued.request_id][-1].error is RequestError.TIMEOUT
    assert queued.num_output_tokens == 0
    assert _free_everywhere(engine) and not engine.requests


def test_add_request_deadline_in_the_past_times_out_at_the_next_step(loaded):
    engine = _engine(loaded)
    req = engine.add_request([2, 5, 6], GREEDY, deadline=engine.clock() - 1)
    outputs = _run(engine)
    assert outputs[req.request_id][-1].error is RequestError.TIMEOUT
    assert _free_everywhere(engine)
