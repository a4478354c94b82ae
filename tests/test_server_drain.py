"""`lifeline serve` as a user runs it (a subprocess on the default model): `/ready` says 503
while the model loads; SIGTERM drains: new requests get 503 with Retry-After, `/ready` 503,
the request in flight finishes, then the process exits by itself; each request left one JSON
line in the access log."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from lifeline.server.testing import free_port


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "server.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "lifeline.cli", "serve", "--port", str(port),
         "--shutdown-timeout", "60", "--no-compile"],  # the compiled start: test_server_startup
        stdout=log.open("w"), stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    base = f"http://127.0.0.1:{port}"
    statuses = []
    try:
        deadline = time.monotonic() + 600  # a loaded machine compiles slowly
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                statuses.append(httpx.get(base + "/ready", timeout=2).status_code)
            except httpx.TransportError:
                pass
            if statuses and statuses[-1] == 200:
                break
            time.sleep(0.2)
        assert statuses and statuses[-1] == 200, "the server did not become ready"
        yield proc, base, statuses, log
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


def test_ready_is_503_while_the_model_loads(served):
    _, _, statuses, _ = served
    assert 503 in statuses and statuses[-1] == 200


def test_serve_restarts_itself_so_the_weights_sit_in_huge_pages(served):
    """`lifeline serve` re-executes itself (same process id) with glibc's malloc asking for
    transparent huge pages, where the kernel grants them on request only."""
    proc, _, _, _ = served
    mode = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    glibc = os.confstr("CS_GNU_LIBC_VERSION")
    if "[madvise]" not in mode or tuple(map(int, glibc.split()[1].split(".")[:2])) < (2, 35):
        pytest.skip(f"not applied here: THP {mode.strip()!r}, {glibc}")
    environ = Path(f"/proc/{proc.pid}/environ").read_bytes().split(b"\0")
    assert b"GLIBC_TUNABLES=glibc.malloc.hugetlb=1" in environ
    rollup = Path(f"/proc/{proc.pid}/smaps_rollup").read_text().splitlines()
    huge = next(int(line.split()[1]) for line in rollup if line.startswith("AnonHugePages:"))
    assert huge > 200_000, huge  # kB: most of the ~270 MB of int8 weights (and more)


def test_sigterm_drains_in_flight_requests_and_refuses_new_ones(served):
    proc, base, _, log = served
    body = {"model": "gemma-3-270m", "prompt": "Tell me a story.", "max_tokens": 40,
            "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    events = []
    with httpx.Client(base_url=base, timeout=60) as http, \
            http.stream("POST", "/v1/completions", json=body) as stream:
        lines = stream.iter_lines()
        for line in lines:
            if line.startswith("data:"):
                events.append(line)
                break
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        with httpx.Client(base_url=base, timeout=10) as other:
            refused = other.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
            ready = other.get("/ready")
            health = other.get("/health")
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"]["code"] == "draining"
        assert int(refused.headers["retry-after"]) >= 1
        assert ready.status_code == 503 and health.status_code == 200
        for line in lines:
            if line.startswith("data:"):
                events.append(line)
    assert events[-1] == "data: [DONE]"
    final = json.loads(events[-2][len("data: "):])
    assert final["usage"]["completion_tokens"] == 40 and final["timings"]["e2e_ms"] > 0
    assert proc.wait(30) == 0, "the process exits once the drain is done, well before 60 s"
    records = [json.loads(line) for line in log.read_text().splitlines()
               if line.startswith("{")]
    by_status = {(r["endpoint"], r["status"]) for r in records}
    assert ("/v1/completions", 200) in by_status and ("/v1/completions", 503) in by_status
    done = next(r for r in records if r["status"] == 200)
    assert done["completion_tokens"] == 40 and done["timings"]["e2e_ms"] > 0


def test_sigterm_while_the_model_loads_exits_without_waiting_for_the_load(tmp_path):
    """A load that never ends (its file is a pipe nobody writes) must not hold the process:
    SIGTERM stops a server that is still loading, as `/ready` 503 promised it could."""
    pipe = tmp_path / "never.gguf"
    os.mkfifo(pipe)
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "lifeline.cli", "serve", "--model", str(pipe), "--port",
         str(port), "--no-huge-pages"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        text=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=2).status_code == 503:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
