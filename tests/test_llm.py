"""The offline `LLM` as a user sees it: `n` samples of one prompt compute the prompt once, and
sample i of a seeded request is the request seeded with seed + i (vLLM's rule, the server's)."""
import pytest

from lifeline import LLM, SamplingParams

PROMPT = ("You are a careful assistant who answers questions about geography, history and "
          "science. Always answer briefly, in one sentence, and say so when you do not know. "
          "Name three rivers of Europe.")


@pytest.fixture(scope="module")
def llm(loaded):
    return LLM(loaded, kv_cache_memory_bytes=64 << 20)


def test_n_samples_share_the_prompt_through_the_prefix_cache(llm):
    stats = llm.engine.block_manager.stats
    before = stats.hits
    results = llm.generate("Request 4411. " + PROMPT,
                           SamplingParams(n=4, max_tokens=3, temperature=1.0, seed=5))
    assert len(results) == 4
    full_blocks = (len(results[0].prompt_token_ids) - 1) // 16  # the last token is computed
    assert full_blocks >= 2
    assert results[0].num_cached_tokens == 0, "sample 0 computed the prompt"
    assert [r.num_cached_tokens for r in results[1:]] == [full_blocks * 16] * 3
    assert stats.hits - before == 3 * full_blocks * 16
    assert all(r.prompt_token_ids == results[0].prompt_token_ids for r in results)


def test_sample_i_of_each_prompt_is_the_request_seeded_with_seed_plus_i(llm):
    prompts = [PROMPT, "Once upon a time"]
    sampling = dict(max_tokens=5, temperature=1.0, ignore_eos=True)
    samples = llm.generate(prompts, SamplingParams(n=2, seed=11, **sampling))
    alone = llm.generate([p for p in prompts for _ in range(2)],
                         [SamplingParams(seed=11 + i, **sampling) for _ in prompts
                          for i in range(2)])
    assert [s.token_ids for s in samples] == [a.token_ids for a in alone]
    assert [s.prompt for s in samples] == [PROMPT, PROMPT, prompts[1], prompts[1]]
    assert samples[0].token_ids != samples[1].token_ids, "the samples differ"
    assert not llm.engine.has_unfinished_requests()


def test_an_engine_request_with_n_above_one_is_refused_not_run_once(llm):
    from lifeline.engine.validation import InvalidRequest

    with pytest.raises(InvalidRequest) as err:
        llm.engine.add_request([5, 6, 7], SamplingParams(n=4, max_tokens=2))
    assert err.value.param == "n"
    assert not llm.engine.has_unfinished_requests()
