"""The engine on the real default model: continuous batching must not change what a request
gets, whatever else shares its steps; prefix caching and preemption must actually happen."""
import pytest
import torch

from lifeline import LLM, SamplingParams

SYSTEM = ("You are a careful assistant. Answer briefly and precisely, and say when you do not "
          "know. The user is a student of geography and history. ")
QUESTIONS = ["What is the capital of France?", "Name a river in Egypt.",
             "Who wrote Hamlet?", "What is 12 times 12?", "Where is Mount Fuji?",
             "What language is spoken in Brazil?", "When did the Roman Empire fall?",
             "What is the largest ocean?"]
PLAIN = ["Once upon a time", "def fibonacci(n):", "The weather today is",
         "In 1969, astronauts", "The quick brown fox jumps over the lazy dog and then",
         "Photosynthesis is the process by which plants", "A haiku about the sea:",
         "The three primary colors are"]
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts():
    return [SYSTEM + q for q in QUESTIONS] + PLAIN


@pytest.fixture(scope="module")
def alone(loaded, prompts):
    llm = LLM(loaded, enable_prefix_caching=False)
    return [llm.generate(p, GREEDY)[0].token_ids for p in prompts]


def _check_prefill_accounting(results):
    for r in results:
        prefilled = sum(n for _, _, n in r.timeline.prefill_chunks)
        assert prefilled == len(r.prompt_token_ids) - r.num_cached_tokens


def test_sixteen_concurrent_equal_one_at_a_time_without_prefix_cache(loaded, prompts, alone):
    llm = LLM(loaded, enable_prefix_caching=False, max_num_batched_tokens=256)
    results = llm.generate(prompts, GREEDY)
    assert [r.token_ids for r in results] == alone
    assert all(r.num_cached_tokens == 0 for r in results)
    assert max(len(r.timeline.prefill_chunks) for r in results) >= 1
    _check_prefill_accounting(results)


def test_sixteen_concurrent_with_prefix_cache_share_blocks(loaded, prompts, alone):
    llm = LLM(loaded, enable_prefix_caching=True, block_size=8)
    llm.generate(prompts[0], GREEDY)
    engine = llm.engine
    reqs = [engine.add_request(p, GREEDY) for p in prompts]
    engine.step()
    shared = len(llm.tokenizer.encode(SYSTEM)) // 8
    assert shared >= 2
    tables = [engine.block_manager.get_blocks(r).block_ids[0][:shared]
              for r in reqs[:len(QUESTIONS)]]
    assert all(t == tables[0] for t in tables)
    while engine.has_unfinished_requests():
        engine.step()
    assert [r.output_token_ids for r in reqs] == alone
    hits = [r.num_cached_tokens for r in reqs[:len(QUESTIONS)]]
    assert all(h >= shared * 8 for h in hits)
    assert engine.block_manager.stats.hits > 0
    for r in reqs:
        prefilled = sum(n for _, _, n in r.timeline.prefill_chunks)
        assert prefilled == r.num_prompt_tokens - r.num_cached_tokens


def test_sixteen_concurrent_with_preemption(loaded, prompts, alone):
    llm = LLM(loaded, enable_prefix_caching=False, block_size=4, num_kv_blocks=40)
    results = llm.generate(prompts, GREEDY)
    assert llm.engine.scheduler.num_preemptions > 0
    assert any(r.num_preemptions for r in results)
    assert [r.token_ids for r in results] == alone
    kv = llm.engine.block_manager
    assert kv.num_free_blocks == kv.num_blocks == 40 * len(kv.groups)


def test_seeded_sampling_reproduces_across_batch_compositions(loaded):
    llm = LLM(loaded)
    seeded = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=1234)
    target = "The best thing about the ocean is"
    alone = llm.generate(target, seeded)[0].token_ids
    others = [SamplingParams(max_tokens=8, temperature=1.0),
              SamplingParams(max_tokens=15, temperature=0.7, seed=7)]
    batch = llm.generate(["Tell me a story", target, "Numbers: 1, 2, 3,"],
                         [others[0], seeded, others[1]])
    assert batch[1].token_ids == alone
    batch2 = llm.generate([target, "Hello"], [seeded, others[0]])
    assert batch2[0].token_ids == alone
    unseeded = {tuple(llm.generate(target, SamplingParams(max_tokens=12, temperature=0.9))[0]
                      .token_ids) for _ in range(3)}
    assert len(unseeded) > 1


def test_stop_strings_cut_the_text_and_never_leak(loaded):
    llm = LLM(loaded)
    prompt = "The capital of France is Paris. The capital of Japan is Tokyo. The capital of"
    full = llm.generate(prompt, SamplingParams(max_tokens=24, temperature=0))[0]
    assert "capital" in full.text
    stop = "capital"
    cut = llm.generate(prompt, SamplingParams(max_tokens=24, temperature=0, stop=[stop]))[0]
    assert cut.text == full.text[:full.text.index(stop)]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    kept = llm.generate(prompt, SamplingParams(max_tokens=24, temperature=0, stop=[stop],
                                               include_stop_str_in_output=True))[0]
    assert kept.text == full.text[:full.text.index(stop) + len(stop)]


def test_streamed_deltas_equal_final_text(loaded):
    llm = LLM(loaded)
    engine = llm.engine
    req = engine.add_request("Write a sentence with an emoji and a Chinese word:",
                             SamplingParams(max_tokens=30, temperature=0.8, seed=3))
    deltas = []
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            deltas.append(out.new_text)
            final = out
    assert final.finished and "".join(deltas) == final.text
    assert final.text == llm.tokenizer.decode(req.output_token_ids, skip_special_tokens=True)


def test_logprobs_agree_with_a_prefill_of_the_same_tokens(loaded):
    llm = LLM(loaded)
    prompt_ids = llm.tokenizer.encode("The three largest cities in Germany are")
    res = llm.generate({"prompt_token_ids": prompt_ids},
                       SamplingParams(max_tokens=6, temperature=0, logprobs=3))[0]
    assert len(res.logprobs) == 6
    logits = llm.prompt_logits(prompt_ids + res.token_ids[:-1])
    ref = torch.log_softmax(logits[len(prompt_ids) - 1:], dim=-1)
    for i, (tok, lp) in enumerate(zip(res.token_ids, res.logprobs)):
        assert lp.token_id == tok
        assert abs(lp.logprob - float(ref[i, tok])) < 1e-3
        assert len(lp.top) == 3 and lp.top[0][0] == tok
        assert [t for t, _ in lp.top] == ref[i].topk(3).indices.tolist()


def test_eos_and_end_of_turn_finish_a_chat_turn(loaded):
    llm = LLM(loaded)
    chat = "<start_of_turn>user\nSay hello.<end_of_turn>\n<start_of_turn>model\n"
    for eos in (1, 106):
        steer = SamplingParams(max_tokens=50, temperature=0, logit_bias={eos: 100.0},
                               min_tokens=2)
        res = llm.generate(chat, steer)[0]
        assert res.finish_reason == "stop" and res.stop_reason is None
        assert len(res.token_ids) == 3 and res.token_ids[-1] == eos
        assert "<end_of_turn>" not in res.text
    ignored = llm.generate(chat, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True,
                                                logit_bias={106: 100.0}))[0]
    assert ignored.finish_reason == "length" and ignored.token_ids == [106] * 4


def test_bad_requests_are_refused_clearly(loaded):
    llm = LLM(loaded, max_model_len=64)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate({"prompt_token_ids": [2, 10**7]})
    with pytest.raises(ValueError, match="context"):
        llm.generate({"prompt_token_ids": [2] * 100})
    with pytest.raises(ValueError, match="empty"):
        llm.generate({"prompt_token_ids": []})
    with pytest.raises(ValueError, match="logit_bias"):
        llm.generate("Hi", SamplingParams(logit_bias={-1: 5.0}))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([{"prompt_token_ids": [2, 3]}, {"prompt_token_ids": [2, 10**7]}])
    assert not llm.engine.has_unfinished_requests()
