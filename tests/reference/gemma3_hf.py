"""Gemma 3 as Hugging Face transformers computes it, on weights dequantized from a GGUF file.

An independent reference for tests: it reads the file with the `gguf` package and runs
transformers' `Gemma3ForCausalLM` in float32; it never imports lifeline.
"""

from pathlib import Path

import numpy as np
import torch
from gguf import GGUFReader, ReaderTensor
from gguf.quants import dequantize
from transformers import DynamicCache, Gemma3ForCausalLM, Gemma3TextConfig

# llama.cpp's Gemma 3 defaults where the file is silent (src/models/gemma3.cpp, llama-hparams.h).
SLIDING_WINDOW_PATTERN = 6
LOCAL_ROPE_THETA = 10_000.0

LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm"}


def gguf_field(reader: GGUFReader, key: str, default: object = None) -> object:
    field = reader.get_field(key)
    return default if field is None else field.contents()


def gemma3_config(reader: GGUFReader) -> Gemma3TextConfig:
    """The transformers config equivalent to llama.cpp's reading of the file's metadata."""
    arch = gguf_field(reader, "general.architecture")
    if arch != "gemma3":
        raise ValueError(f"expected a gemma3 GGUF, got {arch!r}")
    n_layers = int(gguf_field(reader, "gemma3.block_count"))
    layer_types = [
        "full_attention" if (i + 1) % SLIDING_WINDOW_PATTERN == 0 else "sliding_attention"
        for i in range(n_layers)
    ]
    local_theta = gguf_field(reader, "gemma3.rope.freq_base_swa", LOCAL_ROPE_THETA)
    head_dim = int(gguf_field(reader, "gemma3.attention.key_length"))
    return Gemma3TextConfig(
        vocab_size=len(reader.get_field("tokenizer.ggml.tokens").data),
        hidden_size=int(gguf_field(reader, "gemma3.embedding_length")),
        intermediate_size=int(gguf_field(reader, "gemma3.feed_forward_length")),
        num_hidden_layers=n_layers,
        num_attention_heads=int(gguf_field(reader, "gemma3.attention.head_count")),
        num_key_value_heads=int(gguf_field(reader, "gemma3.attention.head_count_kv")),
        head_dim=head_dim,
        hidden_activation="gelu_pytorch_tanh",
        max_position_embeddings=int(gguf_field(reader, "gemma3.context_length")),
        rms_norm_eps=float(gguf_field(reader, "gemma3.attention.layer_norm_rms_epsilon")),
        rope_parameters={
            "full_attention": {
                "rope_type": "default",
                "rope_theta": float(gguf_field(reader, "gemma3.rope.freq_base")),
            },
            "sliding_attention": {"rope_type": "default", "rope_theta": float(local_theta)},
        },
        query_pre_attn_scalar=head_dim,
        sliding_window=int(gguf_field(reader, "gemma3.attention.sliding_window")),
        layer_types=layer_types,
        tie_word_embeddings=True,
        bos_token_id=int(gguf_field(reader, "tokenizer.ggml.bos_token_id")),
        eos_token_id=int(gguf_field(reader, "tokenizer.ggml.eos_token_id")),
        pad_token_id=int(gguf_field(reader, "tokenizer.ggml.padding_token_id")),
        attn_implementation="eager",
    )


def hf_name(gguf_name: str, layer_tensors: dict[str, str] = LAYER_TENSORS,
            global_tensors: dict[str, str] = GLOBAL_TENSORS) -> str:
    """A GGUF tensor's Hugging Face name, by the architecture's two maps."""
    stem = gguf_name.removesuffix(".weight")
    if stem in global_tensors:
        return global_tensors[stem] + ".weight"
    blk, index, kind = stem.split(".")
    if blk != "blk" or kind not in layer_tensors:
        raise KeyError(f"unexpected GGUF tensor {gguf_name!r}")
    return f"model.layers.{index}.{layer_tensors[kind]}.weight"


def dequantized(tensor: ReaderTensor) -> torch.Tensor:
    # The GGUF shape lists the fastest axis first; numpy's (rows, cols) is HF's (out, in).
    shape = tuple(int(n) for n in reversed(tensor.shape))
    array = dequantize(tensor.data, tensor.tensor_type).reshape(shape)
    return torch.from_numpy(np.array(array, dtype=np.float32, copy=True))


def hf_state_dict(reader: GGUFReader) -> dict[str, torch.Tensor]:
    """HF-named float32 tensors; norm weights lose the 1 that llama.cpp's converter added."""
    state: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        weight = dequantized(tensor)
        if tensor.name.removesuffix(".weight").endswith("norm"):
            weight -= 1.0
        state[hf_name(tensor.name)] = weight
    return state


def build_reference_gemma3(gguf_path: str | Path) -> tuple[Gemma3ForCausalLM, Gemma3TextConfig]:
    """transformers' Gemma3ForCausalLM in float32, eager attention, holding the file's weights."""
    reader = GGUFReader(str(gguf_path))
    config = gemma3_config(reader)
    model = Gemma3ForCausalLM(config)
    missing, unexpected = model.load_state_dict(hf_state_dict(reader), strict=False)
    del reader
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise ValueError(f"weights do not fit: missing {missing}, unexpected {unexpected}")
    if model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr():
        raise ValueError("lm_head is not tied to the token embedding")
    return model.eval().requires_grad_(False), config


@torch.inference_mode()
def reference_logits(
    model: Gemma3ForCausalLM, token_ids: list[int], logits_to_keep: int = 0
) -> torch.Tensor:
    """Float32 logits [T, V] for every position, or for the last `logits_to_keep` positions."""
    input_ids = torch.tensor([token_ids], dtype=torch.long)
    out = model(input_ids=input_ids, use_cache=False, logits_to_keep=logits_to_keep)
    return out.logits[0].float()


def assert_logits_agree(ours: torch.Tensor, ref: torch.Tensor, atol: float) -> None:
    """Every position's logits within `atol` of the reference's, and the same argmax."""
    assert ours.shape == ref.shape
    diff = (ours - ref).abs().amax(dim=-1)
    assert float(diff.max()) < atol, f"worst position {int(diff.argmax())}"
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


@torch.inference_mode()
def reference_greedy(
    model: Gemma3ForCausalLM, token_ids: list[int], max_new_tokens: int
) -> tuple[list[int], torch.Tensor]:
    """Greedy continuation, ignoring end-of-sequence tokens, and the logits [N, V] behind each pick."""
    cache = DynamicCache(config=model.config)
    step_input = torch.tensor([token_ids], dtype=torch.long)
    picked: list[int] = []
    step_logits: list[torch.Tensor] = []
    for _ in range(max_new_tokens):
        out = model(input_ids=step_input, past_key_values=cache, use_cache=True, logits_to_keep=1)
        logits = out.logits[0, -1].float()
        picked.append(int(logits.argmax()))
        step_logits.append(logits)
        step_input = torch.tensor([[picked[-1]]], dtype=torch.long)
    return picked, torch.stack(step_logits)
