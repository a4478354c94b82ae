"""How many streamed requests per second the bench client sustains, against a trivial local
server that answers every request at once (a bare ASGI app under uvicorn, in its own process so
the two do not share an interpreter). If a real benchmark comes near this rate, the client is
the bottleneck.

    python -m lifeline.bench.client_capacity --requests 2000 --concurrency 64 --tokens 16
"""
from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time

import httpx

from lifeline.bench.client import BenchClient, BenchRequest
from lifeline.bench.load import LoadPlan, run_load
from lifeline.bench.workloads import cycle


async def trivial_app(scope, receive, send) -> None:
    """Streams `max_tokens` one-token events, usage, [DONE]; no model, no waiting."""
    if scope["type"] != "http":
        return
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    n = json.loads(body or b"{}").get("max_tokens", 1)
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/event-stream")]})
    event = b'data: {"choices":[{"index":0,"text":" x","finish_reason":null}]}\n\n'
    for _ in range(n):
        await send({"type": "http.response.body", "body": event, "more_body": True})
    usage = json.dumps({"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": n}})
    await send({"type": "http.response.body",
                "body": f"data: {usage}\n\ndata: [DONE]\n\n".encode()})


def start_server(port: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "uvicorn", "--port", str(port),
                             "--log-level", "warning", "--no-access-log", "--loop", "asyncio",
                             "--http", "h11",
                             "lifeline.bench.client_capacity:trivial_app"])
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"max_tokens": 1})
            return proc
        except httpx.TransportError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("the trivial server did not start")


async def measure(url: str, requests: int, concurrency: int, tokens: int) -> dict[str, float]:
    async with BenchClient(url, "trivial", max_connections=concurrency) as client:
        work = cycle([BenchRequest([1], max_tokens=tokens)])
        result = await run_load(client, work, LoadPlan(concurrency=concurrency,
                                                       requests=requests, warmup=concurrency))
    ok = sum(s.trace.error is None for s in result.sent)
    return {"requests": requests, "ok": ok, "concurrency": concurrency, "tokens": tokens,
            "duration_s": result.duration_s, "requests_per_s": ok / result.duration_s,
            "events_per_s": ok * tokens / result.duration_s}


def main(argv: list[str] | None = None) -> int:
    from lifeline.server.testing import free_port

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--tokens", type=int, default=16)
    args = p.parse_args(argv)
    port = free_port()
    proc = start_server(port)
    try:
        out = asyncio.run(measure(f"http://127.0.0.1:{port}/v1", args.requests,
                                  args.concurrency, args.tokens))
    finally:
        proc.terminate()
        proc.wait(10)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
