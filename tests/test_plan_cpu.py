"""`lifeline plan calibrate` and `--hardware this-cpu`: the fit recovers what the cost model
itself priced; a quick calibration of the real engine predicts a real served run.

The served check is a smaller version of benchmarks/plan_vs_bench.py (which holds the plan to
15% of `lifeline bench` at the issue's rows): one eager engine, a quick calibration against a
server on loopback holding that engine's model, then a load point the calibration did not see,
held to a factor of two (a machine shared with other work must not make it flake)."""
import dataclasses
import random

import numpy as np
import pytest

from lifeline.model.presets import preset_config
from lifeline.plan import calibrate as cal
from lifeline.plan.cost import CostModel
from lifeline.plan.hardware import Efficiency

PEAKS = cal.Peaks(int8_ops=400e9, fp32_flops=90e9, bandwidth=20e9)
TRUE = Efficiency(gemm=0.55, memory=0.8, kv_memory=0.3, attention=0.25, combine="sum",
                  step_overhead_s=0.004, seq_overhead_s=0.0004, batch_overhead_s=0.006)


@pytest.fixture(scope="module")
def model():
    return preset_config("gemma-3-270m")


def _shapes(rng: random.Random) -> list[tuple[str, tuple[tuple[int, int], ...], int]]:
    """Steps like the calibration's: prefills alone, chunked and batched, decodes of 1-32
    requests at short and long contexts, and mixed steps."""
    out = []
    for n in (32, 64, 128, 256, 512):
        out.append((f"prefill {n}", ((n, 0),), 1))
    out.append(("prefill 1024 (chunked)", ((512, 512),), 1))
    out.append(("prefill 4×128", ((128, 0),) * 4, 4))
    for batch, ctx in ((1, 64), (1, 1024), (4, 128), (8, 256), (16, 128), (32, 64)):
        for k in range(4):
            out.append((f"decode {batch}@{ctx}", tuple((1, ctx + k) for _ in range(batch)),
                        batch))
    for _ in range(4):
        decodes = rng.randrange(1, 16)
        out.append(("mixed", ((1, rng.randrange(64, 300)),) * decodes
                    + ((512 - decodes, 0),), decodes))
    return out


def _synthesized(model, efficiency):
    hw = cal.peak_hardware(PEAKS, efficiency)
    cost = CostModel(model, hw, weights=cal.WEIGHTS, kv_dtype=cal.KV_DTYPE)
    return [cal.StepSample(label, work, sampled, cost.step(work, sampled).seconds)
            for label, work, sampled in _shapes(random.Random(0))]


def test_step_terms_price_every_step_as_the_cost_model_does(model):
    samples = _synthesized(model, TRUE)
    terms = cal.step_terms(model, cal.peak_hardware(PEAKS), samples)
    predicted = terms.predict(cal.efficiency_params(TRUE))
    np.testing.assert_allclose(predicted, [s.seconds for s in samples], rtol=1e-12)


def test_fit_recovers_the_parameters_the_cost_model_priced_with(model):
    samples = _synthesized(model, TRUE)
    terms = cal.step_terms(model, cal.peak_hardware(PEAKS), samples)
    fitted = cal.fit_steps(terms, np.array([s.seconds for s in samples]),
                           cal._weights(samples))
    np.testing.assert_allclose(fitted, cal.efficiency_params(TRUE), rtol=0.01)


def test_fit_is_robust_to_a_few_steps_a_neighbour_slowed(model):
    samples = _synthesized(model, TRUE)
    slowed = [dataclasses.replace(s, seconds=s.seconds * 1.6) if i % 9 == 4 else s
              for i, s in enumerate(samples)]
    terms = cal.step_terms(model, cal.peak_hardware(PEAKS), slowed)
    fitted = cal.fit_steps(terms, np.array([s.seconds for s in slowed]), cal._weights(slowed))
    hw = cal.peak_hardware(PEAKS, cal.efficiency_of(fitted))
    report = cal.fit_report(model, hw, samples)  # against the clean steps
    assert report.median_abs_error < 0.03, report.rows


def test_serving_is_measured_from_the_requests_own_timings():
    """The front is the server's front plus what the client saw beyond the server's TTFT (in
    the least loaded run); streaming's addition is the client's TPOT less the server's decode time per token."""
    def request(ttft, server_ttft, front, tpot, decode, tokens):
        return {"ttft_ms": ttft, "tpot_ms": tpot, "usage_output_tokens": tokens,
                "server_timings": {"server_ttft_ms": server_ttft, "front_ms": front,
                                   "decode_ms": decode}}

    runs = [{"requests": [request(60, 57, 0.5, 12.6, 12.5 * 31, 32),
                          request(70, 66, 0.7, 13.0, 12.8 * 31, 32)]},
            {"requests": [request(100, 97, 0.6, 20.0, 20.0 * 15, 16),
                          request(None, None, None, None, None, 0)]},
            # a burst: the wait for the busy event loop shows outside the server's clock
            {"requests": [request(300, 250, 0.6, 20.1, 20.0 * 15, 16)] * 3}]
    found = cal.measure_serving(runs)
    assert found["request_serial_s"] == pytest.approx(0.6e-3)
    assert found["client_network_s"] == pytest.approx(3e-3)
    assert found["request_overhead_s"] == pytest.approx(3.6e-3)
    assert found["stream_s"] == pytest.approx(0.1e-3)  # the median of every request's
    hw = cal.with_serving(cal.peak_hardware(PEAKS, TRUE), found)
    assert hw.efficiency.request_overhead_s == pytest.approx(3.6e-3)
    assert hw.efficiency.gemm == TRUE.gemm
    with pytest.raises(ValueError, match="no server timings"):
        cal.measure_serving([{"requests": [{"ttft_ms": 5.0}]}])


# -- the real engine and a real server ----------------------------------------------------------

CHECK = cal.ServedPoint(users=2, requests=6, input_tokens=160, output_tokens=40, seed=7)
"""A load point the quick calibration (1 user 48/12, 4 users 96/24) did not see."""


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    """A quick calibration of an eager `int8-all` engine (the model loaded once, converted by
    that engine), its served part against a server on loopback holding the same model, which
    then serves the check; the server's costs are the calibration's own."""
    from lifeline.engine.engine import EngineConfig, LLMEngine
    from lifeline.model.loader import load_model
    from lifeline.server.config import ServerConfig
    from lifeline.server.testing import ServerThread

    loaded = load_model()
    engine = LLMEngine(loaded, EngineConfig(weights="int8-all", compile=False))
    model = loaded.config
    result = cal.calibrate(quick=True, engine=engine, serve=False, model=model)
    del engine
    # the model is int8-all already: the server's engine takes it as it is
    with ServerThread(loaded, ServerConfig(engine=EngineConfig(weights="fp32"))) as server:
        runs = cal.measure_served(server.base_url + "/v1", cal.QUICK_SERVED_POINTS)
        found = cal.measure_serving([r for _, r in runs])
        hw, _ = cal.with_served_steps(model, cal.with_serving(result.hardware, found), runs)
        check = cal.measure_served(server.base_url + "/v1", (CHECK,))[0]
    yield model, result, hw, found, check


@pytest.mark.alone  # it times the real engine: another process's work would be in its steps
def test_quick_calibration_of_the_real_engine_fits_its_steps(quick):
    _, result, _, _, _ = quick
    e = result.hardware.efficiency
    assert result.hardware.id == "this-cpu" and result.hardware.kind == "cpu"
    assert all(0 < v <= 1 for v in (e.gemm, e.memory, e.kv_memory, e.attention))
    assert e.combine == "sum" and e.step_overhead_s + e.batch_overhead_s > 0
    assert {"prefill 512", "decode 12@32"} <= {r["label"] for r in result.engine_fit.rows}
    # seven parameters over about fifty steps of many shapes: a loose fit would be a broken
    # model of the steps, not noise
    assert result.engine_fit.median_abs_error < 0.35, result.engine_fit.rows


@pytest.mark.alone  # the calibration and the served run must see the same machine
def test_plan_of_an_unseen_point_is_within_a_factor_of_two_of_the_served_run(quick):
    model, _, hw, _, (settings, measured) = quick
    predicted = cal.summary_point(cal.simulate(settings, model, hw))
    got = cal.summary_point(measured)
    assert measured["summary"]["failed"] == 0
    for key in ("ttft_ms", "tpot_ms", "output_tok_s"):
        ratio = predicted[key] / got[key]
        assert 0.5 < ratio < 2.0, (key, predicted, got, hw.efficiency.served_step_factor)
