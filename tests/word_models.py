"""The small random-weight models the server and bench tests serve: a word-level tokenizer
over the bench's word list (one token a word, so prompt lengths are exact) and a Llama of
the size a test asks for."""
from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from lifeline.bench.workloads import WORDS
from lifeline.model.config import ModelConfig
from lifeline.model.loader import LoadedModel, build_model, init_dummy_weights
from lifeline.tokenizer import HFTokenizer


def word_tokenizer(path: Path, words: Iterable[str] = WORDS) -> HFTokenizer:
    """`[UNK]`, `</s>` (the end of sequence), then each distinct word, written under `path`."""
    vocab = {"[UNK]": 0, "</s>": 1, **{w: i + 2 for i, w in enumerate(dict.fromkeys(words))}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.decoder = decoders.WordPiece()
    backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    return HFTokenizer(path)


def tiny_llama(tokenizer: HFTokenizer, path: Path, *, hidden: int = 32, layers: int = 2,
               heads: int = 2, kv_heads: int = 1, max_position: int = 512) -> LoadedModel:
    """A random-weight Llama over `tokenizer` (head size `hidden // heads`, MLP `2 * hidden`)."""
    cfg = ModelConfig(architecture="llama", vocab_size=tokenizer.vocab_size, hidden_size=hidden,
                      num_layers=layers, num_heads=heads, num_kv_heads=kv_heads,
                      head_dim=hidden // heads, intermediate_size=2 * hidden,
                      max_position=max_position)
    model = build_model(cfg)
    init_dummy_weights(model)
    return LoadedModel(model.eval(), cfg, tokenizer, str(path), "dummy")


def tiny_gemma3(path: Path, layers: int = 4) -> None:
    """A tiny random Gemma 3 (its last layer global, the others sliding over 8 tokens) saved by
    transformers in `path`, with the word-level tokenizer."""
    import torch
    import transformers

    vocab = word_tokenizer(path).vocab_size
    torch.manual_seed(0)
    cfg = transformers.Gemma3TextConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
        sliding_window=8, query_pre_attn_scalar=32,
        layer_types=["sliding_attention"] * (layers - 1) + ["full_attention"])
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
