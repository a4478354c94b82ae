"""A Llama-architecture GGUF file (SmolLM2-135M-Instruct) as Hugging Face transformers computes it.

An independent reference for tests: it reads the file with the `gguf` package, dequantizes with
gguf's numpy code, undoes llama.cpp's converter's q/k row order, and runs transformers'
`LlamaForCausalLM` in float32 with eager attention; it never imports lifeline. Greedy decoding
and logits: tests.reference.gemma3_hf's `reference_greedy` and `reference_logits` (they take any
causal LM). `reference_tokenizer` is the file's vocabulary run by Hugging Face `tokenizers`."""

from pathlib import Path

import torch
from gguf import GGUFReader
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM

from tests.reference.gemma3_hf import dequantized, gguf_field, hf_name

LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
CONTROL = 3
"""GGUF token type of control tokens."""
GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                  "output": "lm_head"}


def llama_config(reader: GGUFReader) -> LlamaConfig:
    """The transformers config equivalent to llama.cpp's reading of the file's metadata."""
    arch = gguf_field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"expected a llama GGUF, got {arch!r}")
    hidden = int(gguf_field(reader, "llama.embedding_length"))
    heads = int(gguf_field(reader, "llama.attention.head_count"))
    return LlamaConfig(
        vocab_size=len(reader.get_field("tokenizer.ggml.tokens").data),
        hidden_size=hidden,
        intermediate_size=int(gguf_field(reader, "llama.feed_forward_length")),
        num_hidden_layers=int(gguf_field(reader, "llama.block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(gguf_field(reader, "llama.attention.head_count_kv", heads)),
        head_dim=int(gguf_field(reader, "llama.rope.dimension_count", hidden // heads)),
        hidden_act="silu",
        max_position_embeddings=int(gguf_field(reader, "llama.context_length")),
        rms_norm_eps=float(gguf_field(reader, "llama.attention.layer_norm_rms_epsilon")),
        rope_parameters={"rope_type": "default",
                         "rope_theta": float(gguf_field(reader, "llama.rope.freq_base", 10000.0))},
        tie_word_embeddings=not any(t.name == "output.weight" for t in reader.tensors),
        bos_token_id=int(gguf_field(reader, "tokenizer.ggml.bos_token_id")),
        eos_token_id=int(gguf_field(reader, "tokenizer.ggml.eos_token_id")),
        attn_implementation="eager",
    )


def _hf_rope_rows(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """convert_hf_to_gguf.py reorders each head's q/k rows from halves (HF's rotate_half) to
    interleaved pairs (llama.cpp's RoPE): row 2i+j of a head came from row j*half+i."""
    rows, cols = weight.shape
    half = rows // heads // 2
    return weight.view(heads, half, 2, cols).permute(0, 2, 1, 3).reshape(rows, cols)


def hf_state_dict(reader: GGUFReader, config: LlamaConfig) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        name = hf_name(tensor.name, LAYER_TENSORS, GLOBAL_TENSORS)
        weight = dequantized(tensor)
        if name.endswith("q_proj.weight"):
            weight = _hf_rope_rows(weight, config.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            weight = _hf_rope_rows(weight, config.num_key_value_heads)
        state[name] = weight
    return state


def build_reference_llama(gguf_path: str | Path) -> LlamaForCausalLM:
    """transformers' LlamaForCausalLM in float32, eager attention, holding the file's weights."""
    reader = GGUFReader(str(gguf_path))
    config = llama_config(reader)
    model = LlamaForCausalLM(config)
    missing, unexpected = model.load_state_dict(hf_state_dict(reader, config), strict=False)
    del reader
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if unexpected or set(missing) - tied:
        raise ValueError(f"weights do not fit: missing {missing}, unexpected {unexpected}")
    if tied and model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr():
        raise ValueError("lm_head is not tied to the token embedding")
    return model.eval().requires_grad_(False)


def reference_tokenizer(gguf_path: str | Path) -> Tokenizer:
    """The file's vocabulary and merges in Hugging Face `tokenizers`, with SmolLM2's own
    tokenizer.json pre-tokenizer (single digits, then GPT-2's byte-level split) and its control
    tokens as special tokens."""
    reader = GGUFReader(str(gguf_path))
    tokens = reader.get_field("tokenizer.ggml.tokens").contents()
    types = reader.get_field("tokenizer.ggml.token_type").contents()
    merges = [tuple(m.split(" ", 1)) for m in reader.get_field("tokenizer.ggml.merges").contents()]
    tokenizer = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(text, special=True, normalized=False)
                                  for text, kind in zip(tokens, types) if kind == CONTROL])
    return tokenizer
