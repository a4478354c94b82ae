"""The on-disk cache of compiled graphs (lifeline/model/compiled.py): a graph compiled for one
model serves another of the same configuration exactly (weights and int8 handles are inputs of
the graph, not constants in it), the key changes with what the graph bakes in, a damaged file
is compiled again, and two processes starting at once compile each graph once between them.
Tiny random models, held to transformers and to the eager engine."""
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

from lifeline import LLM, SamplingParams
from lifeline.engine.startup import compiles
from lifeline.model.compiled import CachedForward, cache_key, compile_cache_dir
from lifeline.model.loader import load_model
from tests.test_models_hf import _config, _prompt

ROOT = Path(__file__).resolve().parent.parent
ENGINE = dict(compile=True, max_num_batched_tokens=24, block_size=4)


def _tiny(path: Path, seed: int, kind: str = "gemma3", **overrides) -> Path:
    torch.manual_seed(seed)
    cfg = _config(kind)
    for name, value in overrides.items():
        setattr(cfg, name, value)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    for name, p in model.named_parameters():
        if "norm" in name:
            torch.nn.init.normal_(p, std=0.3)
    model.float().eval().save_pretrained(path)
    return path


def _forward(llm: LLM) -> CachedForward:
    forward = llm.engine.executor.runner.forward
    assert isinstance(forward, CachedForward)
    return forward


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Two tiny Gemma 3 models of one configuration and different weights."""
    root = tmp_path_factory.mktemp("cache-models")
    return [_tiny(root / f"seed{seed}", seed) for seed in (0, 1)]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LIFELINE_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / "compiled"


def _greedy(llm: LLM, ids: list[int], n: int = 8) -> list[int]:
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    return llm.generate({"prompt_token_ids": ids}, params)[0].token_ids


def test_a_graph_compiled_for_one_model_computes_another_of_its_shape(models, cache):
    first = LLM(str(models[0]), **ENGINE)
    assert (_forward(first).compiled, _forward(first).loaded) == (2, 0)
    assert compile_cache_dir() == cache and len(list(cache.glob("*/*.pt2"))) == 2
    before = compiles()
    second = LLM(str(models[1]), **ENGINE)
    assert (_forward(second).compiled, _forward(second).loaded) == (0, 2)
    assert compiles() == before, "the second model compiled"
    reference = transformers.AutoModelForCausalLM.from_pretrained(models[1]).float().eval()
    ids = _prompt(45, seed=1)
    with torch.no_grad():
        expected = reference(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(second.prompt_logits(ids), expected, atol=2e-4, rtol=1e-4)
    batched = second.generate([{"prompt_token_ids": _prompt(n, seed=n)} for n in (3, 17)],
                              SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    eager = LLM(str(models[1]), block_size=4)
    for n, result in zip((3, 17), batched):  # batched decode steps: the many-token graph
        assert result.token_ids == _greedy(eager, _prompt(n, seed=n))
    assert _greedy(second, ids[:5]) == _greedy(eager, ids[:5])  # one-token steps


def test_int8_layers_read_their_own_weights_through_a_cached_graph(models, cache):
    """The int8 GEMM's handle is a tensor the layer holds: a graph compiled for one model's
    int8 layers must call the other model's, not the ones it was traced with."""
    LLM(str(models[0]), weights="int8-all", **ENGINE)
    second = LLM(str(models[1]), weights="int8-all", enable_prefix_caching=False, **ENGINE)
    assert _forward(second).loaded == 2
    eager = LLM(str(models[1]), weights="int8-all", enable_prefix_caching=False)
    ids = _prompt(40, seed=3)
    ours, theirs = second.prompt_logits(ids), eager.prompt_logits(ids)
    assert float((ours - theirs).abs().max()) < 0.05 * float(theirs.std())
    assert _greedy(second, ids[:5]) == _greedy(eager, ids[:5])


def test_the_key_changes_with_what_a_graph_bakes_in(models, tmp_path):
    def key(path: Path, weights: str = "fp32") -> str:
        from lifeline.model.weight_format import apply_weight_format

        loaded = load_model(str(path))
        if weights != "fp32":
            apply_weight_format(loaded.model, weights)
        return cache_key(loaded.model, repr(dataclasses.replace(loaded.config, name="")))

    same = key(models[0])
    assert key(models[1]) == same  # other weights, same configuration
    assert key(_tiny(tmp_path / "eps", 0, rms_norm_eps=1e-5)) != same
    assert key(_tiny(tmp_path / "window", 0, sliding_window=16)) != same
    assert key(_tiny(tmp_path / "layers", 0, num_hidden_layers=4,
                     layer_types=["sliding_attention"] * 3 + ["full_attention"])) != same
    assert key(models[0], "int8-all") != same


def test_a_damaged_graph_is_compiled_again(models, cache, caplog):
    LLM(str(models[0]), **ENGINE)
    (damaged,) = cache.glob("*/many.pt2")
    damaged.write_bytes(b"not a graph")
    llm = LLM(str(models[0]), **ENGINE)
    assert (_forward(llm).compiled, _forward(llm).loaded) == (1, 1)
    assert "not loaded" in caplog.text
    assert damaged.stat().st_size > 1000  # replaced
    ids = _prompt(20, seed=4)
    assert _greedy(llm, ids) == _greedy(LLM(str(models[0]), block_size=4), ids)


def test_turned_off_the_forward_compiles_in_process(models, monkeypatch):
    monkeypatch.setenv("LIFELINE_COMPILE_CACHE", "0")
    assert compile_cache_dir() is None
    llm = LLM(str(models[0]), **ENGINE)
    assert llm.engine.compiled
    assert not isinstance(llm.engine.executor.runner.forward, CachedForward)


_START = """
import json, sys
from lifeline import LLM, SamplingParams
llm = LLM(sys.argv[1], compile=True, max_num_batched_tokens=24, block_size=4)
f = llm.engine.executor.runner.forward
out = llm.generate({"prompt_token_ids": [5, 6, 7, 8]},
                   SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0]
print(json.dumps([f.compiled, f.loaded, out.token_ids]))
"""


def test_two_processes_starting_at_once_compile_each_graph_once(models, cache):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, "-c", _START, str(models[0])], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-2000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert sum(r[0] for r in results) == 2 and sum(r[1] for r in results) == 2, results
    assert results[0][2] == results[1][2]
    assert len(list(cache.glob("*/*.pt2"))) == 2
