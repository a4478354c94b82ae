"""The bf16 and int8 LM heads: a faster format must stay close to float32 on real text (the
default model's 1,180-token essay) and still follow llama.cpp's greedy text up to ties.
Measured figures: docs/performance.md (benchmarks/weight_formats.py)."""
import pytest
import torch
import transformers
from torch import nn

from lifeline import LLM, SamplingParams
from lifeline.model.loader import load_model
from lifeline.model.weight_format import (
    BF16Linear,
    Int8Linear,
    _fold_value_rotation,
    _quantize_rows,
    apply_weight_format,
    bf16_widened,
    hadamard,
    head_onednn,
    native_hadamard,
    onednn_int8,
    rotate_columns,
    rotation_block,
    shortlist_argmax,
    top_logits,
)
from tests.reference.llamacpp_agreement import parting
from tests.test_gemma3_reference import LONG, PROMPTS

ESSAY = LONG["prompt_ids"]


def _perplexity(logits: torch.Tensor, ids: list[int]) -> float:
    logp = torch.log_softmax(logits[:-1], dim=-1)
    nll = -logp.gather(1, torch.tensor(ids[1:]).unsqueeze(1)).mean()
    return float(nll.exp())


@pytest.fixture(scope="module")
def fp32_logits(default_model):
    return LLM(default_model, max_num_batched_tokens=512).prompt_logits(ESSAY)


@pytest.fixture(scope="module", params=["bf16", "int8", "int8-all", "gguf", "gguf-int8+compile"])
def fast_llm(request):
    """Each format eager, and `gguf-int8` as `lifeline serve` runs it, compiled: its eager
    forward (`--no-compile`) is the same layers (`RowSplitLinear`), whose two roads this module's
    `test_gguf_int8_takes_a_lone_row_from_the_blocks_and_a_batch_through_int8` holds to their
    formats and tests/test_deferred_weights.py follows llama.cpp's greedy text with, on SmolLM2
    (a third run of the same products cost make test nearly a minute)."""
    weights, _, compiled = request.param.partition("+")
    llm = LLM(load_model(), weights=weights, max_num_batched_tokens=512,
              compile=bool(compiled))  # gguf-int8+compile: what `lifeline serve` runs
    assert llm.loaded.weight_format.endswith("->" + weights)
    assert llm.engine.compiled == bool(compiled)
    return llm


def test_fast_head_keeps_perplexity_within_2_percent_and_greedy_choices_close(fast_llm,
                                                                              fp32_logits):
    logits = fast_llm.prompt_logits(ESSAY)
    agreement = float((fp32_logits.argmax(-1) == logits.argmax(-1)).float().mean())
    ppl_fp32, ppl_fast = _perplexity(fp32_logits, ESSAY), _perplexity(logits, ESSAY)
    assert agreement > 0.9, agreement
    assert abs(ppl_fast / ppl_fp32 - 1) < 0.02, (ppl_fp32, ppl_fast)


def test_fast_head_follows_llamacpp_greedy_text_up_to_ties(fast_llm, gemma3_reference):
    for prompt in PROMPTS.values():
        n = len(prompt["completion_ids"])
        params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
        ours = fast_llm.generate({"prompt_token_ids": prompt["prompt_ids"]}, params)[0].token_ids
        part = parting(gemma3_reference, prompt, ours)
        assert part.ok, part


def _layer(rows: int = 512, cols: int = 64) -> nn.Linear:
    layer = nn.Linear(cols, rows, bias=False).requires_grad_(False)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(rows, cols, generator=torch.Generator().manual_seed(0)))
    return layer


@pytest.mark.parametrize("kind", [BF16Linear, Int8Linear])
def test_fast_head_gives_float32_logits_to_its_best_tokens(kind):
    layer = _layer(rows=4096)
    head = kind(layer)
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(3))
    ours, exact = head(x), layer(x)
    top = exact.topk(8, dim=-1).indices
    assert torch.equal(ours.argmax(-1), exact.argmax(-1))
    assert torch.allclose(ours.gather(1, top), exact.gather(1, top), atol=1e-4)
    assert head(x[:0]).shape == (0, 4096)


def test_bf16_batches_widened_to_float32_give_onednns_bfloat16_products():
    """A CPU without bfloat16 arithmetic takes batches through float32 GEMMs on the widened
    weight (`bf16_widened`); oneDNN's bfloat16 GEMM on the same rows is the reference: equal up to
    the order of the additions (one bfloat16 step of the result at most), slices' seams too."""
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(1000, 64, generator=gen).to(torch.bfloat16)
    x = torch.randn(40, 64, generator=gen)
    ours = bf16_widened(x, weight, slice_rows=300)
    theirs = torch.nn.functional.linear(x.to(torch.bfloat16), weight).float()
    assert ours.shape == theirs.shape == (40, 1000)
    assert torch.equal(ours, ours.to(torch.bfloat16).float())  # rounded to bfloat16 as theirs
    step = theirs.abs().clamp_min(1e-3) * 2.0 ** -7  # one bfloat16 step at each value
    assert bool(((ours - theirs).abs() <= step).all())
    assert float((ours == theirs).float().mean()) > 0.9


def test_int8_row_precision_does_not_depend_on_the_rows_batched_with_it():
    """Activation scales are per row: a row batched with a 1000x outlier keeps the precision
    it has alone. (Not bit for bit: a row alone takes fbgemm's own per-call quantization, the
    same scale computed by a shorter path, so it can round differently.)"""
    layer = _layer()
    head = Int8Linear(layer, rescore_top=0)
    gen = torch.Generator().manual_seed(1)
    row = torch.randn(1, 64, generator=gen)
    outlier = torch.randn(1, 64, generator=gen) * 1000
    alone, batched = head(row), head(torch.cat([row, outlier]))[:1]
    exact = layer(row)
    bound = float(exact.abs().max())
    assert float((alone - exact).abs().max()) < 0.02 * bound
    assert float((batched - exact).abs().max()) < 0.02 * bound
    per_call = torch.ops.quantized.linear_dynamic(torch.cat([row, outlier]), head.packed,
                                                  False)[:1]  # one scale for the whole call
    assert float((per_call - exact).abs().max()) > 0.1 * bound


@pytest.mark.parametrize("rotate", [0, 32])
def test_a_one_copy_int8_layer_keeps_the_copy_its_cpu_runs_faster(rotate):
    """The head keeps one copy of its int8 weights: oneDNN's where its GEMM runs on AMX tiles,
    fbgemm's elsewhere (`head_onednn`), serving lone rows and batches alike, each row within
    int8's error of the float32 layer and a lone row as it is in a batch."""
    layer = _layer()
    one = Int8Linear(layer, rescore_top=0, rotate=rotate, one_copy=True)
    assert one.onednn == head_onednn()
    assert (one.packed is None) == one.onednn
    assert hasattr(one, "onednn_packed") == one.onednn
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(16, 64, generator=gen)
    exact = layer(x)
    bound = float(exact.abs().max())
    batched = one(x)
    assert float((batched - exact).abs().max()) < 0.02 * bound
    assert float((one(x[:1]) - exact[:1]).abs().max()) < 0.02 * bound


def test_int8_head_matches_fp32_on_rows_of_any_offset_and_scale():
    layer = _layer()
    head = Int8Linear(layer, rescore_top=0)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(16, 64, generator=gen) * torch.logspace(-3, 3, 16).unsqueeze(1) + 5.0
    exact = layer(x)
    err = (head(x) - exact).abs().amax(1) / exact.abs().amax(1)
    assert float(err.max()) < 0.02, err


def test_unknown_format_is_refused():
    with pytest.raises(ValueError, match="choose from"):
        apply_weight_format(nn.Module(), "fp8")


def test_cli_offers_every_format():
    from lifeline import cli
    from lifeline.model import weight_format

    assert cli.WEIGHT_FORMATS == weight_format.WEIGHT_FORMATS


def test_hadamard_rotation_is_orthogonal_and_blockwise():
    h = hadamard(32)
    assert torch.allclose(h @ h, torch.eye(32), atol=1e-6)  # symmetric and orthogonal
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(4))
    assert torch.allclose(rotate_columns(x, h), x @ torch.block_diag(h, h, h), atol=1e-5)
    assert rotation_block(640) == 32 and rotation_block(2048, 256) == 256
    assert rotation_block(48) == 0  # no power-of-two block of at least 32 divides it


@pytest.mark.parametrize("block", [2, 32, 64, 256])
@pytest.mark.parametrize("rows", [1, 16, 512])
def test_the_fast_transform_rotates_as_the_block_diagonal_matmul(block, rows):
    """`lifeline_ext::hadamard_rows` (what `rotate_columns` runs on the CPU where built: one
    row, a batch, a prefill's rows across threads, a strided input) against the float64 product
    with the block-diagonal matrix of `hadamard(block)`."""
    if not native_hadamard():
        pytest.skip("the native operators are not built here")
    gen = torch.Generator().manual_seed(block + rows)
    wide = torch.randn(rows, 2 * 512, generator=gen)
    x = wide[:, ::2]  # every other column: not contiguous
    h = hadamard(block)
    exact = (x.double() @ torch.block_diag(*[h.double()] * (512 // block))).float()
    ours = torch.ops.lifeline_ext.hadamard_rows(x, block)
    assert ours.is_contiguous() and ours.shape == x.shape
    torch.testing.assert_close(ours, exact, rtol=1e-5, atol=1e-5)
    assert torch.equal(rotate_columns(x, h), ours)
    with pytest.raises(RuntimeError, match="power of two"):
        torch.ops.lifeline_ext.hadamard_rows(x, 3 * block)


def test_rotated_int8_rows_keep_their_precision_around_an_outlier_channel():
    """A channel 50x the others sets an unrotated row's scale and crushes the rest; the
    rotation spreads it over its block first. Errors are measured against the output of the
    other channels (the outlier's own contribution would hide them): 6-9% unrotated, ~0.58x
    that rotated, across seeds."""
    layer = _layer(rows=256, cols=128)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(16, 128, generator=gen)
    x[:, 7] *= 50
    exact = layer(x)
    rest = layer(torch.cat([x[:, :7], torch.zeros(16, 1), x[:, 8:]], 1))
    errors = {}
    for rotate in (0, 32):
        ours = Int8Linear(layer, rescore_top=0, rotate=rotate)
        for n in (16, 1):  # the batched and the lone-row paths
            errors[rotate, n] = float((ours(x[:n]) - exact[:n]).norm() / rest[:n].norm())
    for n in (16, 1):
        assert errors[32, n] < 0.7 * errors[0, n], errors


@pytest.mark.parametrize("kind", ["gemma3", "qwen2"])
def test_value_rotation_folded_into_the_weights_leaves_the_logits_unchanged(kind, tmp_path):
    """int8-all rotates every head's values inside v_proj (bias included) and o_proj: exact in
    float32, so the model's logits must not move."""
    from tests.test_models_hf import _config, _prompt

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_config(kind)).float().eval()
    if kind == "qwen2":
        for layer in model.model.layers:
            torch.nn.init.normal_(layer.self_attn.v_proj.bias, std=0.5)
    model.save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), enable_prefix_caching=False)
    ids = _prompt(40, seed=6)
    before = llm.prompt_logits(ids)
    for layer in llm.loaded.model.layers:
        assert _fold_value_rotation(layer.self_attn) == {"o_proj"}
    after = llm.prompt_logits(ids)
    assert torch.allclose(before, after, atol=1e-4), float((before - after).abs().max())


@pytest.mark.parametrize("kind", [BF16Linear, Int8Linear])
def test_head_shortlist_proves_the_argmax_or_says_it_cannot(kind):
    head = kind(_layer(rows=4096))
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(7))
    logits, known = head(x, with_argmax=True)
    assert torch.equal(logits, head(x))
    assert known.shape == (32,) and bool((known >= 0).all())
    assert torch.equal(known, logits.argmax(-1))
    # the shortlist's exact best (4.0) does not beat its lowest approximation (5.0): unknown;
    # ties go to the lowest token id, as argmax does
    approx = torch.tensor([[9.0, 5.0, 7.0], [9.0, 5.0, 7.0]])
    ids = torch.tensor([[10, 3, 7], [10, 3, 7]])
    exact = torch.tensor([[4.0, 1.0, 2.0], [8.0, 6.0, 8.0]])
    assert shortlist_argmax(approx, ids, exact, 4096).tolist() == [-1, 7]


@pytest.mark.parametrize("rotate", [0, 32])
def test_int8_batches_through_onednn_agree_with_fbgemm(rotate):
    """Batches of rows take oneDNN's int8 GEMM where it exists (faster at 16 rows and in
    prefill), lone rows fbgemm's: both quantize each row by its own scale, so they must agree
    to within the int8 rounding of either, and both stay as close to float32."""
    if not onednn_int8():
        pytest.skip("this PyTorch has no oneDNN int8 GEMM, or it saturates on this CPU")
    layer = _layer(rows=1024, cols=128)
    ours = Int8Linear(layer, rescore_top=0, rotate=rotate)
    assert ours.onednn
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(16, 128, generator=gen) * torch.logspace(-2, 2, 16).unsqueeze(1) + 0.5
    exact = layer(x)
    onednn = ours.int8_matmul(x)
    ours.onednn = False
    fbgemm = ours.int8_matmul(x)
    lone = torch.cat([ours.int8_matmul(row) for row in x.split(1)])
    scale = exact.abs().amax(1, keepdim=True)
    for y in (onednn, fbgemm, lone):
        assert float(((y - exact) / scale).abs().max()) < 0.02
    assert float(((onednn - fbgemm) / scale).abs().max()) < 0.01


def test_top_logits_by_chunks_finds_the_same_tokens_as_topk():
    gen = torch.Generator().manual_seed(9)
    y = torch.randn(5, 128 * 300, generator=gen)
    y[1, 1000:1064] += 10  # the whole top in a few neighbouring chunks
    y[2, ::128] += 10  # one per chunk, in different chunks
    values, ids = top_logits(y, 64)
    ref_ids = y.topk(64, dim=-1).indices
    assert torch.equal(ids.sort(-1).values, ref_ids.sort(-1).values)
    assert torch.equal(y.gather(1, ids), values)
    odd = torch.randn(2, 1000, generator=gen)  # not a whole number of chunks: plain topk
    assert torch.equal(top_logits(odd, 8)[1].sort(-1).values, odd.topk(8)[1].sort(-1).values)


def test_weights_as_stored_follow_llamacpp_on_smollm2_up_to_ties():
    """SmolLM2's Q4_1 layers computed from the file's blocks (`gguf`): no float32 copy of a
    layer stays, and greedy text follows llama-server's on the same file (its fixtures,
    tests/fixtures/smollm2_llamacpp.json) except where llama.cpp's own top choices are a near
    tie (its logprob margin, as tests/test_smollm2_reference.py allows)."""
    from lifeline.model.default import smollm2_model_path
    from lifeline.model.gguf_rows import GGUFLinear
    from tests.test_smollm2_reference import assert_follows_llamacpp_greedy

    llm = LLM(load_model(smollm2_model_path()), weights="gguf")
    model = llm.loaded.model
    linears = [m for m in model.layers.modules() if isinstance(m, nn.Linear)]
    assert not linears, linears[:2]
    stored = [m for m in model.layers.modules() if isinstance(m, GGUFLinear)]
    assert len(stored) == 4 * len(model.layers)  # qkv, o, gate_up, down
    # Q4_1: every layer repacked, eight rows interleaved (the one-row product's layout)
    assert all(m.qtype != m.stored_qtype for m in stored)
    assert_follows_llamacpp_greedy(llm)


def test_weights_as_stored_need_a_gguf_file(tmp_path):
    from tests.test_models_hf import _config

    transformers.AutoModelForCausalLM.from_config(_config("qwen2")).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="need a GGUF file"):
        LLM(str(tmp_path), weights="gguf")


def test_one_loaded_gguf_model_behind_two_engines_is_formatted_once():
    """A gateway may put one loaded model behind two backends: the second engine finds the
    weights already in its format (the head reads the file's rows, its float32 copy gone) and
    gives the same tokens; another format on the same weights is refused, not stacked."""
    from lifeline.model.default import smollm2_model_path

    loaded = load_model(smollm2_model_path())
    params = SamplingParams(max_tokens=12, temperature=0.0)
    first = LLM(loaded, weights="int8-all").generate("The capital of France is", params)
    second = LLM(loaded, weights="int8-all").generate("The capital of France is", params)
    assert first[0].token_ids == second[0].token_ids
    assert loaded.weight_format.count("->int8-all") == 1, loaded.weight_format
    with pytest.raises(ValueError, match="already int8-all"):
        LLM(loaded, weights="bf16")


def test_gguf_int8_takes_a_lone_row_from_the_blocks_and_a_batch_through_int8():
    """`gguf-int8` on the default model (Gemma 3's Q4_K_M: q/k Q5_0 with v Q5_0 or Q8_0, o
    Q4_K, down Q4_K or Q6_K): every projection holds the file's blocks for a lone row and an
    int8 copy for batches, q/k/v and gate/up one int8 GEMM each even where the file's types
    differ; the two copies give the same projection (the values unrotated in both: the KV
    cache must not depend on which copy wrote it), each within int8's error of the other."""
    from lifeline.model.gguf_rows import GGUFLinear
    from lifeline.model.weight_format import ConcatLinear, RowSplitLinear

    model = apply_weight_format(load_model().model, "gguf-int8")
    assert model.applied_weight_format == "gguf-int8"
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(6, model.config.hidden_size, generator=gen)
    mixed = 0
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        splits = [attn.qkv_proj.linear, attn.o_proj, mlp.gate_up_proj.linear, mlp.down_proj]
        assert all(isinstance(split, RowSplitLinear) for split in splits), splits
        assert all(split.batch.rescore_top == 0 and split.batch.weight is None for split in splits)
        mixed += isinstance(attn.qkv_proj.linear.lone, ConcatLinear)
        for split in splits:
            assert isinstance(split.lone, (GGUFLinear, ConcatLinear))
            rows = x if split.in_features == x.shape[1] else torch.randn(
                6, split.in_features, generator=gen)
            lone = torch.cat([split(row) for row in rows.split(1)])
            assert torch.equal(lone[:1], split.lone(rows[:1]))
            batch = split(rows)
            bound = float(lone.abs().max())
            assert float((batch - lone).abs().max()) < 0.05 * bound, split
    assert mixed == 9  # the layers whose v is Q8_0 beside Q5_0 q and k


@pytest.mark.parametrize("rotate", [0, 32])
def test_int8_rows_are_the_bytes_torch_quantize_per_channel_gives(rotate):
    """`_quantize_rows` writes the quantizer's arithmetic out (twice as fast): the same int8
    values, scales and dequantized row sums as `torch.quantize_per_channel`, ties at half a
    step rounded to even as it rounds them, and the weight it reads left as it was."""
    gen = torch.Generator().manual_seed(11)
    weight = torch.randn(300, 64, generator=gen) * torch.logspace(-4, 3, 300).unsqueeze(1)
    weight[0] = (torch.arange(64) - 31.5) / 4  # every value half a step of 1/4 off the grid
    weight[0, 0] = 127 / 4  # the row's largest: a scale of exactly 1/4
    weight[1] = 0.0  # an all-zero row: the smallest scale, every value 0
    before = weight.clone()
    rotation = hadamard(rotate) if rotate else None
    values, scales, row_sums = _quantize_rows(weight, rotation)
    assert torch.equal(weight, before)
    source = rotate_columns(weight, rotation) if rotation is not None else weight
    expected = torch.quantize_per_channel(source, scales, torch.zeros(300, dtype=torch.long), 0,
                                          torch.qint8)
    assert torch.equal(values, expected.int_repr())
    assert torch.equal(scales, (source.abs().amax(1).clamp_min(1e-12) / 127).double())
    assert torch.equal(row_sums, expected.dequantize().sum(1))
    if not rotate:  # the ties did round to even
        assert values[0, :4].tolist() == [127, -30, -30, -28]
