"""Lifeline's C++ operators (lifeline/model/native.py) against the PyTorch paths they replace.
The int8 GEMM by handle: tests/test_compiled.py."""
import pytest
import torch

from lifeline.model.layers import attention
from lifeline.model.layers.attention import AttentionMetadata, PrefillSeq
from lifeline.model.native import native_ops


def scattered_contexts(lengths: torch.Tensor, pool: int, gen: torch.Generator
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each context's slots at random places of a pool of `pool` slots, padded with slot 0, and
    which of them are real positions."""
    longest = int(lengths.max())
    perm = torch.randperm(pool, generator=gen)
    slots = torch.zeros(len(lengths), longest, dtype=torch.long)
    for i, n in enumerate(lengths.tolist()):
        slots[i, :n] = perm[i * longest:i * longest + n]
    return slots, torch.arange(longest).unsqueeze(0) < lengths.unsqueeze(1)


def decode_meta(slots: torch.Tensor, valid: torch.Tensor, lengths: torch.Tensor
                ) -> AttentionMetadata:
    return AttentionMetadata(slot_mapping=torch.zeros(0, dtype=torch.long),
                             num_decodes=len(lengths), decode_slots=slots,
                             decode_positions=lengths - 1, decode_valid=valid)


def test_cpu_ops_build_here():
    assert native_ops(), "the C++ operators did not build (see the warning)"


@pytest.mark.parametrize("heads,kv_heads,window", [(4, 1, None), (8, 2, None), (4, 4, 5)])
def test_decode_attention_reads_the_paged_cache_as_sdpa_does(monkeypatch, heads, kv_heads, window):
    """Contexts of different lengths, scattered over a shuffled pool of slots, padded with
    slot 0; with a sliding window, the oldest positions are masked as well."""
    gen = torch.Generator().manual_seed(0)
    head_dim, pool = 64, 200
    k_cache = torch.randn(pool, kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(pool, kv_heads, head_dim, generator=gen)
    lengths = torch.tensor([1, 7, 30, 13])  # a batch within NATIVE_DECODE_MAX
    slots, valid = scattered_contexts(lengths, pool, gen)
    meta = decode_meta(slots, valid, lengths)
    q = torch.randn(len(lengths), heads, head_dim, generator=gen)
    ours = attention._decode(q, k_cache, v_cache, meta, 0.125, window)
    monkeypatch.setattr(attention, "native_ops", lambda: False)
    meta.masks.clear()
    reference = attention._decode(q, k_cache, v_cache, meta, 0.125, window)
    torch.testing.assert_close(ours, reference, atol=1e-5, rtol=1e-5)
    # and by hand: a context of one position returns its own value
    torch.testing.assert_close(ours[0], v_cache[slots[0, 0]].repeat_interleave(heads // kv_heads, 0))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_attention_reads_a_16_bit_cache_as_sdpa_does_on_its_widened_values(monkeypatch,
                                                                                  dtype):
    """A bf16 or fp16 KV cache (`--kv-cache-dtype`): the kernel widens each element as it
    reads it; PyTorch's path gathers and widens first. Same values, so float32 tolerances."""
    gen = torch.Generator().manual_seed(1)
    heads, kv_heads, head_dim, pool = 6, 2, 64, 120
    k_cache = torch.randn(pool, kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(pool, kv_heads, head_dim, generator=gen).to(dtype)
    lengths = torch.tensor([3, 40, 17])
    slots, valid = scattered_contexts(lengths, pool, gen)
    meta = decode_meta(slots, valid, lengths)
    q = torch.randn(len(lengths), heads, head_dim, generator=gen)
    ours = attention._decode(q, k_cache, v_cache, meta, 0.125, None)
    assert ours.dtype == torch.float32
    monkeypatch.setattr(attention, "native_ops", lambda: False)
    meta.masks.clear()
    widened = attention._decode(q, k_cache.float(), v_cache.float(), meta, 0.125, None)
    torch.testing.assert_close(ours, widened, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(attention._decode(q, k_cache, v_cache, meta, 0.125, None),
                               widened, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("head_dim,heads,kv_heads", [(64, 9, 3), (128, 4, 1), (256, 4, 1),
                                                     (80, 4, 2)])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("lengths,masked", [((517, 300, 1), (0, 70, 0)), ((517,), (300,))],
                         ids=["batch", "one"])
def test_decode_attention_of_long_contexts_in_chunks_on_each_head_size(
        monkeypatch, dtype, head_dim, heads, kv_heads, threads, lengths, masked):
    """Contexts long enough to be split over the threads (flash decoding: each chunk's maximum,
    sum and weighted values, merged after), on the vector kernel's head sizes (64, 128, 256)
    and on one it has none for (80: the portable kernel); contexts masked in their first
    positions (a sliding window), one so far that whole chunks of it are masked, the masked
    positions' values NaN (never read, as a padded slot's)."""
    torch.set_num_threads(threads)
    try:
        gen = torch.Generator().manual_seed(head_dim + threads)
        pool = 1600
        k_cache = torch.randn(pool, kv_heads, head_dim, generator=gen).to(dtype)
        v_cache = torch.randn(pool, kv_heads, head_dim, generator=gen).to(dtype)
        lengths = torch.tensor(lengths)
        slots, valid = scattered_contexts(lengths, pool, gen)
        for i, n in enumerate(masked):
            valid[i, :n] = False
        meta = decode_meta(slots, valid, lengths)
        q = torch.randn(len(lengths), heads, head_dim, generator=gen)
        poisoned = v_cache.clone()  # a masked position's value is never read
        for i, n in enumerate(masked):
            poisoned[slots[i, :n]] = float("nan")
        ours = attention._decode(q, k_cache, poisoned, meta, head_dim ** -0.5, None)
        monkeypatch.setattr(attention, "native_ops", lambda: False)
        meta.masks.clear()
        reference = attention._decode(q, k_cache.float(), v_cache.float(), meta,
                                      head_dim ** -0.5, None)
        torch.testing.assert_close(ours, reference, atol=2e-5, rtol=1e-4)
    finally:
        torch.set_num_threads(2)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("head_dim,heads,kv_heads", [(64, 9, 3), (128, 4, 1), (256, 8, 2),
                                                     (64, 4, 4), (32, 16, 2)])
@pytest.mark.parametrize("tokens,past,window", [
    (1, 0, None), (5, 0, None), (130, 0, None), (257, 0, 64),  # a prompt's first chunk
    (1, 300, None), (70, 130, None), (129, 300, 100), (3, 500, 7)])  # a later chunk
def test_prefill_attention_is_sdpas_causal_attention_within_the_window(
        monkeypatch, threads, head_dim, heads, kv_heads, tokens, past, window):
    """`lifeline_ext::prefill_attention` (a KV head's query heads stacked into one block of
    rows, flash style) against PyTorch's attention over the expanded heads and the explicit
    mask: a prompt's first chunk (its own keys) and a later one (the context's keys gathered
    from a shuffled pool), with and without a sliding window, on one thread and two; block
    edges crossed (64 keys a block, about 192 stacked rows). Chunks from
    `NATIVE_PREFILL_MIN` tokens take it in `_prefill`, shorter ones SDPA."""
    if not attention.native_prefill(torch.zeros(1, 1, head_dim)):
        pytest.skip(f"the built kernel does not tile head size {head_dim}")
    torch.set_num_threads(threads)
    try:
        gen = torch.Generator().manual_seed(tokens + past + head_dim)
        context = past + tokens
        pool = context + 40
        k_cache = torch.randn(pool, kv_heads, head_dim, generator=gen)
        v_cache = torch.randn(pool, kv_heads, head_dim, generator=gen)
        slots = torch.randperm(pool, generator=gen)[:context]
        q = 2 * torch.randn(tokens, heads, head_dim, generator=gen)
        k, v = k_cache[slots[past:]], v_cache[slots[past:]]
        seq = PrefillSeq(start=0, num_tokens=tokens, context_len=context, slots=slots)
        scale = head_dim ** -0.5
        ours = torch.ops.lifeline_ext.prefill_attention(
            q, k_cache[slots], v_cache[slots], scale, -1 if window is None else window)
        taken = attention._prefill(q, k, v, k_cache, v_cache, seq, scale, window)
        monkeypatch.setattr(attention, "native_ops", lambda: False)
        reference = attention._prefill(q, k, v, k_cache, v_cache, seq, scale, window)
        assert torch.equal(taken, ours if tokens >= attention.NATIVE_PREFILL_MIN else reference)
        torch.testing.assert_close(ours, reference, atol=2e-5, rtol=1e-4)
        if tokens == 1 and past == 0:  # a lone position attends to itself alone
            torch.testing.assert_close(ours[0], v[0].repeat_interleave(heads // kv_heads, 0))
    finally:
        torch.set_num_threads(2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_a_decode_steps_kv_write_is_what_index_copy_writes(dtype):
    """`lifeline_ext::paged_attention` on a step set by `set_decode_step` writes each new
    token's keys and values into its slot itself (no `index_copy_`): the same bytes as
    `cache.index_copy_(0, slots, k.to(cache.dtype))`, rounding included, and the attention
    that follows reads them; a slot outside the pool is an error, not a write."""
    assert native_ops()
    gen = torch.Generator().manual_seed(3)
    heads, kv_heads, head_dim, pool, layers = 6, 2, 64, 96, 2
    caches = [(torch.randn(pool, kv_heads, head_dim, generator=gen).to(dtype),
               torch.randn(pool, kv_heads, head_dim, generator=gen).to(dtype))
              for _ in range(layers)]
    expected = [(k.clone(), v.clone()) for k, v in caches]
    lengths = torch.tensor([5, 12, 1])
    slots, valid = scattered_contexts(lengths, pool, gen)
    new_slots = slots[torch.arange(3), lengths - 1].contiguous()  # each context's last position
    mask = torch.zeros(slots.shape).masked_fill_(~valid, float("-inf"))
    torch.ops.lifeline_ext.set_decode_step([t for pair in caches for t in pair], new_slots, slots,
                                           mask, new_slots, slots, mask, -1)
    try:
        for layer in range(layers):
            q = torch.randn(3, heads, head_dim, generator=gen)
            k = torch.randn(3, kv_heads, head_dim, generator=gen) * 1000  # fp16 rounds these
            v = torch.randn(3, kv_heads, head_dim, generator=gen)
            out = torch.ops.lifeline_ext.paged_attention(q, k, v, layer, 0.125, None)
            ek, ev = expected[layer]
            ek.index_copy_(0, new_slots, k.to(dtype))
            ev.index_copy_(0, new_slots, v.to(dtype))
            assert torch.equal(caches[layer][0].view(torch.uint8), ek.view(torch.uint8))
            assert torch.equal(caches[layer][1].view(torch.uint8), ev.view(torch.uint8))
            assert torch.equal(out, torch.ops.lifeline_ext.decode_attention(q, ek, ev, slots,
                                                                            mask, 0.125))
        before = caches[0][0].clone()
        torch.ops.lifeline_ext.set_decode_step([t for pair in caches for t in pair],
                                               torch.tensor([3, pool]), slots[:2], mask[:2],
                                               torch.tensor([3, pool]), slots[:2], mask[:2], -1)
        with pytest.raises(RuntimeError, match="outside the cache"):
            torch.ops.lifeline_ext.paged_attention(torch.randn(2, heads, head_dim),
                                                   torch.randn(2, kv_heads, head_dim),
                                                   torch.randn(2, kv_heads, head_dim), 0, 0.125,
                                                   None)
        assert torch.equal(caches[0][0][pool - 1], before[pool - 1])
    finally:
        torch.ops.lifeline_ext.clear_decode_step()


@pytest.mark.parametrize("head_dim,positions,theta", [(256, 32768, 1e6), (64, 8192, 1e4),
                                                      (128, 131072, 5e5)])
def test_rope_rows_are_the_tables_rows_eager_and_compiled(head_dim, positions, theta):
    """On the CPU a rotary embedding holds no tables (Gemma 3's two were 64 MiB): a step's
    cos and sin rows are computed for its positions, the same bits as the rows of a table of
    every position in eager code and in compiled code (`lifeline_ext::rope_rows`: Inductor's
    own cos and sin differ in the last bit), at any count of positions."""
    from lifeline.model.layers.rotary import RotaryEmbedding, native_rows

    assert native_rows()
    rows, tables = RotaryEmbedding(head_dim, positions, theta), \
        RotaryEmbedding(head_dim, positions, theta)
    assert rows.cos is None
    tables.build_tables()
    assert tables.cos.shape == (positions, head_dim // 2)
    gen = torch.Generator().manual_seed(4)
    pos = torch.cat([torch.randint(0, positions, (517,), generator=gen),
                     torch.tensor([0, positions - 1])])
    expected = tables.rows(pos)
    for got in (rows.rows(pos), torch.ops.lifeline_ext.rope_rows(pos, rows.inv_freq)):
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    compiled = torch.compile(rows.rows, dynamic=True, fullgraph=True)
    for n in (1, 7, len(pos)):
        cos, sin = compiled(pos[:n])
        assert torch.equal(cos, expected[0][:n]) and torch.equal(sin, expected[1][:n])
