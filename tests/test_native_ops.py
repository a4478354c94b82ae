"""Lifeline's C++ operators (lifeline/model/native.py) against the PyTorch paths they replace.
The int8 GEMM by handle: tests/test_compiled.py."""
import pytest
import torch

from lifeline.model.layers import attention
from lifeline.model.layers.attention import AttentionMetadata
from lifeline.model.native import native_ops


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
    longest = int(lengths.max())
    perm = torch.randperm(pool, generator=gen)
    slots = torch.zeros(len(lengths), longest, dtype=torch.long)
    for i, n in enumerate(lengths.tolist()):
        slots[i, :n] = perm[i * longest:i * longest + n]
    valid = torch.arange(longest).unsqueeze(0) < lengths.unsqueeze(1)
    meta = AttentionMetadata(slot_mapping=torch.zeros(0, dtype=torch.long),
                             num_decodes=len(lengths), decode_slots=slots,
                             decode_positions=lengths - 1, decode_valid=valid)
    q = torch.randn(len(lengths), heads, head_dim, generator=gen)
    ours = attention._decode(q, k_cache, v_cache, meta, 0.125, window)
    monkeypatch.setattr(attention, "native_ops", lambda: False)
    meta.masks.clear()
    reference = attention._decode(q, k_cache, v_cache, meta, 0.125, window)
    torch.testing.assert_close(ours, reference, atol=1e-5, rtol=1e-5)
    # and by hand: a context of one position returns its own value
    torch.testing.assert_close(ours[0], v_cache[slots[0, 0]].repeat_interleave(heads // kv_heads, 0))
