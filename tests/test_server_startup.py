"""A server's start, phase by phase, its KV cache's size, and no compile after `/ready`: a real
server on loopback loads a tiny random Gemma 3 (sliding and global layers) saved by
transformers, with `lifeline serve`'s defaults (int8-all, compiled), and is then loaded with
every shape of step a client can cause. The KV figures are checked against the model's own
config.json, the compile counter against a compile this test makes itself."""
import json
import re
import threading
import time

import httpx
import pytest
import torch

from lifeline.engine.engine import EngineConfig
from lifeline.engine.startup import PHASES
from lifeline.model.loader import load_model
from lifeline.server.config import ServerConfig
from lifeline.server.testing import ServerThread
from tests.word_models import tiny_gemma3

BLOCK = 4
BLOCKS = 48


def _metric(text: str, name: str, **labels) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} {labels} not in /metrics")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma3")
    tiny_gemma3(path, layers=4)
    config = ServerConfig(served_model_name="tiny", engine=EngineConfig(
        compile=True, weights="int8-all", block_size=BLOCK, num_kv_blocks=BLOCKS,
        max_num_batched_tokens=32, adaptive_threads=True))
    with ServerThread(lambda: load_model(path), config) as srv:
        deadline = time.monotonic() + 600
        while httpx.get(srv.base_url + "/ready").status_code != 200:  # loads in the background
            assert time.monotonic() < deadline, "not ready in 600 s"
            time.sleep(0.1)
        yield srv, json.loads((path / "config.json").read_text())


def test_ready_reports_the_phases_of_the_start(served):
    srv, _ = served
    phases = httpx.get(srv.base_url + "/ready").json()["startup_seconds"]
    assert set(PHASES) | {"other", "ready"} == set(phases), phases
    assert all(s >= 0 for s in phases.values())
    assert phases["read_weights"] > 0 and phases["compile_warmup"] > 0
    parts = sum(s for p, s in phases.items() if p != "ready")
    assert parts == pytest.approx(phases["ready"], rel=1e-6)
    metrics = httpx.get(srv.base_url + "/metrics").text
    for phase, seconds in phases.items():
        assert _metric(metrics, "lifeline:startup_seconds", phase=phase) == pytest.approx(seconds)


def test_the_kv_cache_size_is_the_models_own(served):
    srv, cfg = served
    per_layer = 2 * cfg["num_key_value_heads"] * cfg["head_dim"] * 4  # K and V in float32
    metrics = httpx.get(srv.base_url + "/metrics").text
    assert _metric(metrics, "lifeline:kv_cache_bytes_per_token") == (
        per_layer * cfg["num_hidden_layers"])
    # an explicit block count gives each group (sliding, global) that many blocks
    assert _metric(metrics, "lifeline:kv_cache_pool_bytes") == (
        BLOCKS * BLOCK * per_layer * cfg["num_hidden_layers"])


def _load(srv) -> None:
    """Every kind of step: lone decodes, batches of decodes, chunked long prompts beside them,
    prefix-cache hits, prompt logprobs, several choices, streams."""
    url = srv.base_url + "/v1/completions"
    bodies = [{"prompt": [2 + (i * 7 + j) % 80 for j in range(n)], "max_tokens": t,
               "ignore_eos": True, "temperature": 0}
              for i, (n, t) in enumerate([(3, 9), (70, 4), (1, 12), (33, 6), (5, 3), (120, 2)])]
    bodies += [dict(bodies[1], logprobs=3, echo=True), dict(bodies[3], n=3, temperature=1),
               dict(bodies[0], stream=True), dict(bodies[5])]  # the last: a prefix-cache hit
    errors = []

    def send(body):
        try:
            httpx.post(url, json={"model": "tiny", **body}, timeout=120).raise_for_status()
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    send(bodies[2])  # alone: one-token steps
    threads = [threading.Thread(target=send, args=(b,)) for b in bodies]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def test_nothing_compiles_after_ready_under_load(served):
    srv, _ = served
    _load(srv)
    metrics = httpx.get(srv.base_url + "/metrics").text
    assert _metric(metrics, "lifeline:compiles_after_ready_total") == 0, re.findall(
        r"lifeline:compiles.*", metrics)
    # the counter counts: a compile in this process (it is process-wide) moves it
    fn = torch.compile(lambda x: torch.sin(x) * 2)
    fn(torch.ones(3))
    metrics = httpx.get(srv.base_url + "/metrics").text
    assert _metric(metrics, "lifeline:compiles_after_ready_total") >= 1


def test_metrics_show_the_threads_steps_run_with(served):
    """`adaptive_threads`: the count in force, between one and the configured count (PyTorch's
    own, here), what other processes used, and how often it changed."""
    srv, _ = served
    _load(srv)
    metrics = httpx.get(srv.base_url + "/metrics").text
    assert 1 <= _metric(metrics, "lifeline:intraop_threads") <= torch.get_num_threads()
    assert _metric(metrics, "lifeline:cpu_other_processes_cores") >= 0
    assert _metric(metrics, "lifeline:intraop_thread_changes_total") >= 0
