"""The engine loop behind the executor seam: with torch unimportable, the loop, scheduler, KV
manager and request types run requests end to end on a stand-in executor; the model executor
hands back a frozen output, its LM head's shortlist proof included."""
import dataclasses
import subprocess
import sys
import textwrap

import pytest

STAND_IN = textwrap.dedent("""
    import sys
    sys.modules["torch"] = None  # any import of torch now raises

    from types import SimpleNamespace

    from lifeline.engine.engine import EngineConfig, LLMEngine
    from lifeline.engine.executor import ModelOutput
    from lifeline.engine.sampling_params import SamplingParams
    from lifeline.model.default import default_model_path
    from lifeline.model.presets import preset_config
    from lifeline.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(default_model_path())
    ANSWER = tokenizer.encode(" Paris is the capital. Next question", add_special_tokens=False)


    class StandIn:
        '''Answers every request with ANSWER, one token a step, whatever its prompt.'''
        compiled = False

        def __init__(self, layout):
            self.steps = []

        def execute(self, scheduled):
            self.steps.append([(s.request.request_id, s.num_new_tokens, len(s.blocks.block_ids))
                               for s in scheduled.scheduled])
            sampled = [s.request for s in scheduled.scheduled if s.samples]
            return ModelOutput(tuple(r.request_id for r in sampled),
                               tuple(ANSWER[r.num_output_tokens] for r in sampled))


    model = SimpleNamespace(config=preset_config("gemma-3-270m"), tokenizer=tokenizer)
    executors = []
    engine = LLMEngine(model, EngineConfig(num_kv_blocks=64, max_num_batched_tokens=16),
                       executor=lambda layout: executors.append(StandIn(layout)) or executors[-1])
    prompt = "What is the capital of France? " * 4
    stopped = engine.add_request(prompt, SamplingParams(max_tokens=32, stop=[". Next"]))
    capped = engine.add_request(prompt, SamplingParams(max_tokens=3))
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    kv = engine.block_manager
    print(repr({
        "torch": "torch" in sys.modules and sys.modules["torch"] is not None,
        "stopped": (outputs[stopped.request_id][-1].text, stopped.finish_reason.value),
        "capped": (outputs[capped.request_id][-1].text, capped.finish_reason.value),
        "deltas": "".join(o.new_text for o in outputs[stopped.request_id]),
        "chunked": max(n for step in executors[0].steps for _, n, _ in step),
        "groups": {g for step in executors[0].steps for _, _, g in step},
        "free": kv.num_free_blocks == kv.num_blocks,
    }))
""")


def test_the_engine_loop_runs_requests_end_to_end_without_torch():
    result = subprocess.run([sys.executable, "-c", STAND_IN], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    seen = eval(result.stdout.strip().splitlines()[-1])
    assert seen["torch"] is False
    assert seen["stopped"] == (" Paris is the capital", "stop")
    assert seen["deltas"] == " Paris is the capital"
    assert seen["capped"] == (" Paris is the", "length")
    assert seen["chunked"] == 16  # the prompt ran in chunks of the step's token budget
    assert seen["groups"] == {2}  # Gemma 3: a full and a sliding-window block table
    assert seen["free"]


HTTP_SIDE = ("lifeline.server.engine_client", "lifeline.server.generation",
             "lifeline.server.responses", "lifeline.server.streams", "lifeline.server.state",
             "lifeline.server.protocol", "lifeline.server.gateway")


def test_the_http_side_of_the_engine_client_imports_without_torch():
    """What the handlers use to talk to an engine (the client protocol, generations, streams,
    the server's state) needs no torch: an engine client in another process or behind HTTP
    can serve them."""
    code = ("import sys\nsys.modules['torch'] = None\n"
            + "".join(f"import {m}\n" for m in HTTP_SIDE) + "print('ok')")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]

@pytest.fixture(scope="module")
def int8_engine():
    from lifeline.engine.engine import EngineConfig, LLMEngine
    from lifeline.model.config import ModelConfig
    from lifeline.model.loader import LoadedModel, build_model, init_dummy_weights

    cfg = ModelConfig(architecture="llama", vocab_size=4096, hidden_size=64, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128,
                      max_position=256)
    model = build_model(cfg)
    init_dummy_weights(model)
    loaded = LoadedModel(model.eval(), cfg, None, "tiny", "dummy-f32")
    return LLMEngine(loaded, EngineConfig(num_kv_blocks=32, block_size=4, weights="int8"))


def test_model_output_is_frozen_and_carries_the_heads_proof(int8_engine):
    from lifeline.engine.sampling_params import SamplingParams

    engine = int8_engine
    results = []
    execute = engine.executor.execute
    engine.executor.execute = lambda scheduled: results.append(execute(scheduled)) or results[-1]
    try:
        req = engine.add_request([5, 6, 7, 8, 9], SamplingParams(max_tokens=4, temperature=0,
                                                                 ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        del engine.executor.execute
    assert [r.token_ids for r in results] == [(t,) for t in req.output_token_ids]
    for r in results:
        assert r.request_ids == (req.request_id,)
        if r.shortlist_argmax is not None:  # greedy took the proof: it is the token
            assert r.shortlist_argmax == r.token_ids
    assert any(r.shortlist_argmax is not None for r in results)
    with pytest.raises(dataclasses.FrozenInstanceError):
        results[0].token_ids = (1,)
    assert not hasattr(engine.loaded.model.lm_head, "last_argmax")



def test_a_family_whose_logits_are_not_its_head_alone_gets_its_own_compute_logits(int8_engine):
    """The runner takes the head's argmax with its logits only where the family declares its
    logits are the head's alone (`plain_head`); a family that transforms them (here: negates,
    so greedy wants the head's argmin) gets its own `compute_logits`, on the same int8 head."""
    import torch

    from lifeline.engine.model_runner import ModelRunner
    from lifeline.model import registry

    runner = int8_engine.executor.runner
    model = runner.model
    hidden = torch.randn(3, int8_engine.loaded.config.hidden_size)
    logits, argmax = runner._logits(hidden)
    assert argmax is not None, "a plain head with a shortlist gives the proof"
    assert torch.equal(argmax, logits.argmax(-1))

    negated = dataclasses.replace(registry.family("llama"), name="negated-llama",
                                  architectures=("negated-llama",), plain_head=False)
    registry.register(negated)
    original = type(model).compute_logits
    try:
        type(model).compute_logits = lambda self, h: -self.lm_head(h)
        cfg = dataclasses.replace(int8_engine.loaded.config, architecture="negated-llama")
        other = ModelRunner(model, cfg, int8_engine.kv_layout)
        logits, argmax = other._logits(hidden)
        assert argmax is None
        assert torch.equal(logits, -model.lm_head(hidden))
    finally:
        type(model).compute_logits = original
        registry._BY_ARCHITECTURE.pop("negated-llama", None)
