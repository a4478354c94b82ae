"""A server's start leaves `gguf-int8`'s slow conversions for after `/ready`
(lifeline.model.weight_format, `defer_batches`; lifeline.engine.background_compile): the layers'
weights stay in the GGUF file's blocks (a lazy load dequantizes none of them), the head reads
the file's rows, and batches take the blocks too until the background thread has built the
int8 copies. Meanwhile greedy text follows llama.cpp's on the same file (its fixtures, up to its
own near ties), and once built the model is the whole format's, bit for bit: the same outputs
and the same compiled graphs' key. A server stopped while the copies are built exits cleanly."""
import dataclasses
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch
from torch import nn

from lifeline import LLM
from lifeline.engine.background_compile import engine_building, engine_built
from lifeline.model.compiled import compile_forward
from lifeline.model.default import smollm2_model_path
from lifeline.model.gguf_rows import GGUFLinear
from lifeline.model.loader import load_model, materialize_weights
from lifeline.model.weight_format import (
    Int8Linear,
    RowSplitLinear,
    apply_weight_format,
    pending_weights,
)
from lifeline.server.testing import free_port
from tests.test_smollm2_reference import assert_follows_llamacpp_greedy

ROOT = Path(__file__).resolve().parent.parent


def test_a_lazy_load_dequantizes_on_demand_to_the_loaders_own_values():
    """The layers a lazy load leaves in the file's blocks are the eager load's float32 values
    once materialized (the kernels' row decoder is the dequantizer, bit for bit), the head tied
    to the embedding again; the norms load as before."""
    path = smollm2_model_path()
    lazy = load_model(path, lazy=True).model
    plain = load_model(path).model
    left = {n for n, p in lazy.named_parameters() if p.is_meta}
    assert left == set(lazy.lazy_weights) and left, sorted(left)[:3]
    assert "embed_tokens.weight" in left  # the head is tied to it: its rows, read once
    assert all(n.startswith("layers.") and n.endswith("_proj.weight")
               for n in left - {"embed_tokens.weight"})
    materialize_weights(lazy)
    assert not lazy.lazy_weights
    ours, theirs = dict(lazy.named_parameters()), dict(plain.named_parameters())
    assert ours.keys() == theirs.keys()
    for name, value in theirs.items():
        assert torch.equal(ours[name], value), name
    assert lazy.lm_head.weight is lazy.embed_tokens.weight


def test_a_start_serves_from_the_blocks_then_runs_the_whole_format(tmp_path, monkeypatch):
    monkeypatch.setenv("LIFELINE_CACHE_DIR", str(tmp_path))
    whole = apply_weight_format(load_model(smollm2_model_path()).model, "gguf-int8")
    engine_building()  # as a server's other backend still starting: the thread waits
    try:
        llm = LLM(load_model(smollm2_model_path(), lazy=True), weights="gguf-int8",
                  compile=True, compile_in_background=True)
        model, engine = llm.loaded.model, llm.engine
        try:
            assert engine.compile_state == "loading"
            assert pending_weights(model) is not None
            splits = [m for m in model.modules() if isinstance(m, RowSplitLinear)]
            assert len(splits) == 4 * len(model.layers)
            assert all(s.batch is None for s in splits)
            assert isinstance(model.lm_head, GGUFLinear)
            assert not [n for n, p in model.named_parameters() if p.is_meta]
            assert not [m for m in model.layers.modules() if type(m) is nn.Linear]
            assert_follows_llamacpp_greedy(llm)  # prefills (batches) and decodes, all from the blocks
        finally:
            engine_built()
        compile = engine.background_compile
        deadline = time.monotonic() + 120
        while compile.weights_seconds is None and compile.state != "failed":
            assert time.monotonic() < deadline, "the copies for batches were not built"
            time.sleep(0.05)
        assert compile.state == "compiling", compile.state  # an empty cache: a child compiles
        assert pending_weights(model) is None
        assert all(isinstance(s.batch, Int8Linear) for s in splits)
        assert isinstance(model.lm_head, Int8Linear)
        # the key of the graphs a child compiles for the whole format is this model's
        identity = repr(dataclasses.replace(llm.loaded.config, name=""))
        assert compile.forward.directory.name == compile_forward(whole, identity).directory.name
        gen = torch.Generator().manual_seed(5)
        for ours, theirs in zip(splits, [m for m in whole.modules()
                                         if isinstance(m, RowSplitLinear)]):
            x = torch.randn(3, ours.in_features, generator=gen)
            assert torch.equal(ours(x), theirs(x))
            assert torch.equal(ours(x[:1]), theirs(x[:1]))
        hidden = torch.randn(2, model.config.hidden_size, generator=gen)
        assert torch.equal(model.lm_head(hidden), whole.lm_head(hidden))
        assert_follows_llamacpp_greedy(llm)
    finally:
        engine.close()
    assert compile._proc is not None and compile._proc.poll() is not None  # no child left


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_server_stopped_while_the_copies_are_built_exits_cleanly(tmp_path):
    """SIGTERM at `/ready`, with the copies for batches still building in the background: the
    build stops between conversions and the process exits 0 (an interpreter that exits under a
    conversion aborts: 'terminate called without an active exception')."""
    port = free_port()
    log = tmp_path / "serve.log"
    env = {**os.environ, "LIFELINE_CACHE_DIR": str(tmp_path / "cache"),
           "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "lifeline.cli", "serve", "--model", "smollm2-135m-instruct",
         "--port", str(port), "--no-huge-pages", "--kv-cache-memory-bytes", "64MiB",
         "--compile-in-background"],
        env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "not ready in time"
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/ready", timeout=5)
                if r.status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        assert r.json()["forward"] == "loading", r.json()  # the copies still building
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "terminate called" not in log.read_text()

