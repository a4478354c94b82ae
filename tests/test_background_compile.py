"""A first start compiles in the background (lifeline/engine/background_compile.py): a real
`lifeline serve` on loopback, on a tiny random Gemma 3 saved by transformers with a word-level
tokenizer and a compile cache of its own, is ready before its forward has compiled, answers
while a child process compiles, switches to the compiled graphs under traffic with the same
greedy answers, never compiles in its own process, and leaves no child behind; a second start
on the same cache is ready before its graphs load, loads them in a thread (no child, no compile)
and answers the same; `lifeline bench` notes a forward still compiling and waits for one
loading."""
import asyncio
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from lifeline.bench.client import BenchClient
from lifeline.bench.run import settle_forward
from lifeline.server.testing import free_port
from tests.word_models import tiny_gemma3

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ["the cat sat on", "a dog and a", "one two three"]
PACE_S = 0.5
"""The pause between two rounds of traffic while a graph compiles or loads (back to back, the
rounds made this test 339 s in make test beside the other half; paced, 104 s)."""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma3-bg")
    tiny_gemma3(path, layers=3)
    return path


class Serve:
    def __init__(self, model: Path, cache: Path, log: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "LIFELINE_CACHE_DIR": str(cache), "PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "lifeline.cli", "serve", "--model", str(model), "--port",
             str(self.port), "--weights", "fp32", "--compile", "--compile-in-background",
             "--no-huge-pages", "--kv-cache-memory-bytes", "64MiB", "--served-model-name", "x"],
            env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
        self.log = log

    def ready(self, timeout: float = 300) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log.read_text()[-3000:]
            try:
                r = httpx.get(self.url + "/ready", timeout=5)
                if r.status_code == 200:
                    return r.json()
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise AssertionError("not ready in time")

    def complete(self, prompt: str) -> str:
        r = httpx.post(self.url + "/v1/completions", timeout=120, json={
            "model": "x", "prompt": prompt, "max_tokens": 6, "temperature": 0})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    def metric(self, name: str) -> float:
        for line in httpx.get(self.url + "/metrics").text.splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
        raise AssertionError(f"{name} not in /metrics")

    def children(self) -> list[int]:
        found = []  # each thread's children: the engine thread starts the child
        for task in Path(f"/proc/{self.proc.pid}/task").iterdir():
            try:
                found += [int(p) for p in (task / "children").read_text().split()]
            except OSError:
                pass
        return found

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)


def test_ready_before_compiled_then_compiled_under_traffic(model_dir, tmp_path):
    cache = tmp_path / "cache"
    server = Serve(model_dir, cache, tmp_path / "first.log")
    try:
        body = server.ready()
        assert body["forward"] == "compiling", body
        assert server.children(), "no child process compiles"
        note = asyncio.run(_settle(server.url))  # a bench run now measures the eager forward
        assert note is not None and "compiling" in note, note
        eager = [server.complete(p) for p in PROMPTS]
        answers: list[list[str]] = []
        errors: list[BaseException] = []

        def traffic() -> None:  # requests throughout the switch, a round every PACE_S:
            try:  # back to back, they and the server took a core from the compiling child
                while httpx.get(server.url + "/ready").json()["forward"] == "compiling":
                    answers.append([server.complete(p) for p in PROMPTS])
                    time.sleep(PACE_S)
            except BaseException as e:  # noqa: BLE001
                errors.append(e)

        thread = threading.Thread(target=traffic)
        thread.start()
        thread.join(600)
        assert not errors, errors
        assert answers, "no request was served while the child compiled"
        assert server.ready()["forward"] == "compiled", server.log.read_text()[-3000:]
        compiled = [server.complete(p) for p in PROMPTS]
        assert compiled == eager
        assert all(a == eager for a in answers)
        assert server.metric("lifeline:compiles_after_ready_total") == 0
        assert len(list(cache.glob("compiled/*/*.pt2"))) == 2
        assert not server.children(), "the compiling child is still there"
    finally:
        server.stop()
    again = Serve(model_dir, cache, tmp_path / "second.log")
    try:
        # ready as soon as the weights are; the cached graphs load after /ready, no child
        assert again.ready()["forward"] in ("loading", "compiled")
        assert not again.children()
        answers = []
        while (state := httpx.get(again.url + "/ready").json()["forward"]) == "loading":
            answers.append([again.complete(p) for p in PROMPTS])  # served eagerly meanwhile
            time.sleep(PACE_S)
        assert state == "compiled", again.log.read_text()[-3000:]
        assert all(a == eager for a in answers)
        assert [again.complete(p) for p in PROMPTS] == eager
        assert again.metric("lifeline:compiles_after_ready_total") == 0
        assert not again.children()
    finally:
        again.stop()
    third = Serve(model_dir, cache, tmp_path / "third.log")
    try:
        assert third.ready()["forward"] in ("loading", "compiled")
        assert asyncio.run(_settle(third.url)) is None  # a bench waits for the graphs
        assert httpx.get(third.url + "/ready").json()["forward"] == "compiled"
    finally:
        third.stop()


async def _settle(url: str) -> str | None:
    async with BenchClient(url + "/v1", "x") as client:
        return await settle_forward(client)
