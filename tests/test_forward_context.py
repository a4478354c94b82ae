"""The forward context (lifeline/model/context.py): what a step's attention reads besides its
tokens, set around each forward. Models against transformers through it: tests/test_models_hf.py
(eager) and tests/test_compiled.py (compiled)."""
import threading

import pytest
import torch

from lifeline.model.config import ModelConfig
from lifeline.model.context import forward_context, get_context
from lifeline.model.layers.attention import AttentionMetadata, PrefillSeq
from lifeline.model.loader import build_model, init_dummy_weights


def _tiny() -> torch.nn.Module:
    cfg = ModelConfig("qwen3", vocab_size=64, hidden_size=32, num_layers=2, num_heads=2,
                      num_kv_heads=1, head_dim=16, intermediate_size=64, qk_norm=True)
    model = build_model(cfg)
    init_dummy_weights(model)
    return model.eval()


def _prefill_meta(n: int) -> AttentionMetadata:
    slots = torch.arange(n)
    return AttentionMetadata(slot_mapping=slots, num_decodes=0,
                             prefills=[PrefillSeq(0, n, n, slots)])


def test_a_model_called_outside_a_forward_context_says_so():
    model = _tiny()
    with pytest.raises(RuntimeError, match="no forward context"):
        model(torch.arange(3), torch.arange(3))


def test_a_forward_writes_the_pools_of_its_context_and_leaves_no_context_behind():
    model = _tiny()
    pools = [(torch.zeros(8, 1, 16), torch.zeros(8, 1, 16)) for _ in range(2)]
    with torch.inference_mode(), forward_context(_prefill_meta(3), pools):
        hidden = model(torch.arange(3), torch.arange(3))
    assert hidden.shape == (3, 32)
    for k, v in pools:  # three slots written, the rest untouched
        assert k[:3].abs().sum(-1).all() and not k[3:].any() and not v[3:].any()
    with pytest.raises(RuntimeError, match="no forward context"):
        get_context()


def test_the_context_is_reset_when_a_forward_fails():
    with pytest.raises(ValueError), forward_context(_prefill_meta(1), []):
        raise ValueError
    with pytest.raises(RuntimeError):
        get_context()


def test_each_thread_reads_its_own_context():
    both_set = threading.Barrier(2)
    read: dict[int, int] = {}

    def step(n: int) -> None:
        with forward_context(_prefill_meta(n), []):
            both_set.wait()
            read[n] = get_context().meta.prefills[0].num_tokens

    threads = [threading.Thread(target=step, args=(n,)) for n in (2, 5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert read == {2: 2, 5: 5}
