"""The compiled forward (`EngineConfig(compile=True)`, `lifeline serve`'s default) against
transformers and against our own eager path, on tiny random models; its graphs are compiled
at construction, so requests never wait for the compiler. The default model's quality with
`int8-all` compiled: tests/test_weight_format.py."""
import pytest
import torch
import transformers

from lifeline import LLM, SamplingParams
from lifeline.model.layers.attention import PagedAttention
from tests.reference.tiny_hf import hf_greedy
from tests.test_models_hf import _prompt, tiny_model


@pytest.fixture(scope="module", params=["gemma3", "qwen3"])
def tiny(request, tmp_path_factory):
    return tiny_model(request.param, tmp_path_factory)


def _unique_graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def test_compiled_forward_matches_transformers_and_never_compiles_after_warmup(tiny):
    kind, model, path = tiny
    llm = LLM(path, compile=True, max_num_batched_tokens=24, block_size=4)
    assert llm.engine.compiled
    # decode steps' attention in C++ (lifeline_ext::paged_attention; Gemma 3's window of 8 in
    # its own pools): the greedy tokens below are transformers'
    layers = [m for m in llm.loaded.model.modules() if isinstance(m, PagedAttention)]
    assert layers and all(m.compiled_op == torch.ops.lifeline_ext.paged_attention
                          for m in layers)
    graphs = _unique_graphs()
    ids = _prompt(45, seed=1)
    ours = llm.prompt_logits(ids)  # chunks of 24 and 21 tokens
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(ours, ref, atol=2e-4, rtol=1e-4)
    prompts = [_prompt(n, seed=n) for n in (3, 17, 30, 9)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    batched = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for p, result in zip(prompts, batched):
        assert result.token_ids == hf_greedy(model, p, 12), kind
    alone = llm.generate({"prompt_token_ids": prompts[1]}, params)[0]  # one-token steps
    assert alone.token_ids == batched[1].token_ids
    assert _unique_graphs() == graphs, "a request waited for the compiler"


def test_compiled_int8_layers_agree_with_their_eager_path(tiny):
    """int8-all compiled: the rotation, scales and fbgemm GEMM traced around an operator must
    compute what the eager layer computes, up to float32 rounding (which can move an int8
    rounding step, so the bound is a small fraction of the logits' spread, not 1e-5)."""
    _, _, path = tiny
    ids = _prompt(40, seed=3)
    logits = {}
    for compiled in (False, True):
        llm = LLM(path, weights="int8-all", compile=compiled, enable_prefix_caching=False)
        assert llm.engine.compiled == compiled
        logits[compiled] = llm.prompt_logits(ids)
        one = llm.generate({"prompt_token_ids": ids[:5]},
                           SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0]
        logits[compiled, "greedy"] = one.token_ids
    spread = float(logits[False].std())
    assert float((logits[True] - logits[False]).abs().max()) < 0.05 * spread
    assert logits[True, "greedy"] == logits[False, "greedy"]


def test_moe_models_stay_eager(tmp_path):
    from tests.test_models_moe import _config as moe_config

    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(moe_config("qwen3_moe")).save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), compile=True)
    assert not llm.engine.compiled
    out = llm.generate({"prompt_token_ids": [1, 2, 3]},
                       SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 3


def test_native_int8_operator_runs_fbgemm_by_handle_while_the_layer_lives():
    """`lifeline_ext::int8_linear` (C++, built on first use) must compute exactly fbgemm's
    result for the layer its handle names, and forget the handle with the layer."""
    import gc

    from lifeline.model.compiled import int8_linear_op, native_int8_linear, register_int8_linear
    from lifeline.model.weight_format import Int8Linear

    assert native_int8_linear(), "the C++ operator did not build (see the warning)"
    assert int8_linear_op() is torch.ops.lifeline_ext.int8_linear
    gen = torch.Generator().manual_seed(0)
    layer = torch.nn.Linear(64, 96, bias=False)
    layer.weight.data = torch.randn(96, 64, generator=gen)
    int8 = Int8Linear(layer, rescore_top=0)
    handle = torch.tensor([register_int8_linear(int8)])  # a tensor: an input of the graph
    x = torch.randn(3, 64, generator=gen)
    ours = torch.ops.lifeline_ext.int8_linear(x, handle, 96)
    assert torch.equal(ours, torch.ops.quantized.linear_dynamic(x, int8.packed, int8.reduce_range))
    assert torch.ops.lifeline_ext.int8_linear(x, handle, 96).shape == (3, 96)
    with pytest.raises(RuntimeError, match="one-element int64"):
        torch.ops.lifeline_ext.int8_linear(x, handle.int(), 96)
    del int8
    gc.collect()
    with pytest.raises(RuntimeError, match="no int8 layer has handle"):
        torch.ops.lifeline_ext.int8_linear(x, handle, 96)
