"""The diagnosis of the engines people run, replayed: `/metrics` and `/slots` sequences and
bench results captured from real `llama-server` and vLLM (CPU) servers on loopback by
`benchmarks/diagnose_peers.py --capture tests/fixtures/peers` go through the parser, the join
and the diagnosis again, and each scenario's first-ranked cause is held, as it was when
captured, to the number measured another way in the same session (a control run with the limit
lifted, the server's own counters). SGLang cannot run here (its CPU backend needs AMX and a
source build): its case is written from its documented metric names."""
import copy
import json
from pathlib import Path

import pytest

from lifeline.bench.compare import attribute
from lifeline.bench.diagnose import diagnose
from lifeline.bench.server_join import join
from lifeline.bench.server_state import (
    ENGINES,
    detect,
    parse,
    parse_families,
    reduce,
    reduce_slots,
    wanted_families,
)

FIXTURES = Path(__file__).parent / "fixtures" / "peers"
TOLERANCE = 0.20
CAPTURED = sorted(p.stem for p in FIXTURES.glob("*.json"))


def _replay(results: dict) -> dict:
    """The join and the diagnosis, again, on captured results (what they wrote is not kept in
    the fixture)."""
    results = copy.deepcopy(results)
    state = results.get("server_state")
    if state:
        state["summary"] = join(results, state)
    results["summary"]["diagnoses"] = diagnose(results)
    return results


def _lifeline_metrics_text() -> str:
    """A live Lifeline /metrics body, its model's name needing escapes: histograms observed,
    counters moved."""
    from tests.test_observe import fake_engine, record

    from lifeline.observe.metrics import Metrics

    metrics = Metrics(MODEL)
    for _ in range(3):
        metrics.observe(record())
    metrics.update_stats(fake_engine(300, 120, 2))
    return metrics.render()[0].decode()


MODEL = 'odd"model\\name'


@pytest.mark.parametrize("engine", ["llama.cpp", "vllm", "lifeline"])
def test_a_sample_after_the_first_reads_the_same_record_from_far_fewer_lines(engine):
    """After the first sample the sampler parses only the families a record reads, without
    buckets (a tenth of prometheus_client's parse time on Lifeline's and vLLM's bodies): the
    records are the same, for every model filter."""
    text = _lifeline_metrics_text() if engine == "lifeline" else (
        FIXTURES / f"{engine}.metrics.txt").read_text()
    full, fast = parse(text), parse_families(text, wanted_families(engine))
    assert set(fast) <= set(full) and not any(
        n.endswith(("_bucket", "_created")) for f in fast.values() for n, _, _ in f["samples"])
    for model in (None, MODEL, "absent"):
        record = reduce(engine, full, model)
        assert record and reduce(engine, fast, model) == record, model
    if engine == "lifeline":  # the escaped name was read back as written
        assert {s[1]["model_name"] for f in fast.values() for s in f["samples"]} == {MODEL}


def test_the_fixtures_cover_every_scenario_of_both_engines():
    assert {"slots", "prefill", "batch", "prefix", "context"} <= set(CAPTURED)
    assert {"vllm_seqs", "vllm_prefix"} <= set(CAPTURED)


@pytest.mark.parametrize("engine,name", [("llama.cpp", "llama.cpp.metrics"),
                                         ("vllm", "vllm.metrics")])
def test_captured_metrics_parse_to_the_engines_fields(engine, name):
    families = parse((FIXTURES / f"{name}.txt").read_text())
    assert detect(families) == engine
    record = reduce(engine, families)
    for key in ("running", "waiting", "prompt_tokens", "generation_tokens"):
        assert key in record, key
    assert record["running"] >= 1  # taken under load
    if engine == "vllm":
        assert isinstance(record["queue_s"], list) and "kv_usage" in record
        assert {"prefix_queries", "preemptions", "prefill_s"} <= set(record)
    else:
        # this build's names: no KV gauge, prompt tokens computed and cached counted apart
        assert {"prompt_seconds", "decode_calls", "cached_tokens"} <= set(record)


def test_captured_slots_name_the_slots_and_their_context():
    slots = reduce_slots(json.loads((FIXTURES / "llama.cpp.slots.txt").read_text()))
    assert slots["slots"] == 2 and 1 <= slots["slots_busy"] <= 2
    assert slots["slot_n_ctx"] == 4096


@pytest.mark.parametrize("name", CAPTURED)
def test_a_captured_scenario_ranks_its_cause_first_again(name):
    fixture = json.loads((FIXTURES / f"{name}.json").read_text())
    check = fixture["check"]
    results = _replay(fixture["results"])
    diagnoses = results["summary"]["diagnoses"]
    reference = check["independent_ms"]
    if name in ("prefix", "vllm_prefix"):
        control = _replay(fixture["control"])
        att = attribute(dict(control, _label="cached"), dict(results, _label="uncached"))
        top = att["ttft"]["rows"][0]
        assert top["cause"] == "prefill", att["ttft"]["rows"]
        found = top["delta_ms"]
        assert "prefix cache" in att["ttft"]["finding"]["title"]
    elif name == "context":
        failures = diagnoses["failures"]
        assert failures[0]["kind"] == "context" and "-c" in failures[0]["fix"]
        found = float(failures[0]["count"])
    else:
        section = "output" if check["expected"] in ("batch",) else "ttft"
        first = diagnoses[section]["findings"][0]
        assert first["cause"] == check["expected"], diagnoses[section]["findings"]
        found = first["ms"]
        if check["expected"] == "queue":
            assert results["server_state"]["summary"]["capacity"] == (
                2 if name in ("slots", "vllm_seqs") else results["server_state"]["summary"][
                    "capacity"])
            # the network is never named for time the server showed queueing
            network = [f for f in diagnoses["ttft"]["findings"]
                       if f["cause"] == "client_network"]
            assert not network or network[0]["ms"] < 0.2 * first["ms"]
            knob = "-np" if name == "slots" else "--max-num-seqs"
            assert knob in first["fix"] or "VLLM_CPU_KVCACHE_SPACE" in first["fix"]
    assert abs(found - reference) <= TOLERANCE * abs(reference), (found, reference)


def test_llama_cpp_against_vllm_on_the_same_load_names_the_slots():
    """`bench compare` of llama.cpp's 2 slots against vLLM's 8 sequences on 8 users."""
    llama = _replay(json.loads((FIXTURES / "slots.json").read_text())["results"])
    vllm = _replay(json.loads((FIXTURES / "vllm_seqs.json").read_text())["control"])
    att = attribute(dict(vllm, _label="vllm"), dict(llama, _label="llama.cpp"))
    finding = att["ttft"]["finding"]
    assert att["ttft"]["rows"][0]["cause"] == "queue"
    assert "one of llama.cpp's 2 slots" in finding["title"]
    assert "vllm ran up to" in finding["title"]
    assert [e["engine"] for e in att["engines"]] == ["vllm", "llama.cpp"]


# --- SGLang, from its documented metric names ------------------------------------------------

SGLANG_MODEL = "meta-llama/Llama-3.1-8B-Instruct"


def _sglang_text(running: float, queue: float, usage: float, prompt: float, ttft: tuple) -> str:
    """One `/metrics` body in the names and shapes of SGLang's production-metrics page."""
    label = f'{{model_name="{SGLANG_MODEL}"}}'
    lines = []
    for name, kind, value in (("sglang:prompt_tokens_total", "counter", prompt),
                              ("sglang:generation_tokens_total", "counter", prompt / 2),
                              ("sglang:token_usage", "gauge", usage),
                              ("sglang:cache_hit_rate", "gauge", 0.0),
                              ("sglang:num_running_reqs", "gauge", running),
                              ("sglang:num_used_tokens", "gauge", usage * 160000),
                              ("sglang:gen_throughput", "gauge", 86.5),
                              ("sglang:num_queue_reqs", "gauge", queue)):
        lines += [f"# HELP {name} documented", f"# TYPE {name} {kind}", f"{name}{label} {value}"]
    hist = "sglang:time_to_first_token_seconds"
    lines += [f"# HELP {hist} Histogram of time to first token in seconds.",
              f"# TYPE {hist} histogram", f"{hist}_sum{label} {ttft[0]}",
              f'{hist}_bucket{{le="+Inf",model_name="{SGLANG_MODEL}"}} {ttft[1]}',
              f"{hist}_count{label} {ttft[1]}"]
    return "\n".join(lines) + "\n"


def test_sglang_from_its_documented_metrics():
    """Eight users on a server that runs four at once: four wait two seconds in its queue."""
    samples = []
    for k in range(21):
        t = k * 0.2
        late = t >= 2.0
        text = _sglang_text(4, 0 if late else 4, 0.3, 128 * (8 if late else 4),
                            (0.4 + (8.4 if t >= 2.1 else 0), 4 + (4 if t >= 2.1 else 0)))
        families = parse(text)
        assert detect(families) == "sglang"
        samples.append({"t": t, **reduce("sglang", families, SGLANG_MODEL)})
    assert set(ENGINES["sglang"]) >= {"running", "waiting", "kv_usage"}
    records = [{"index": i, "id": f"r{i}", "ok": True, "sent_s": 0.0,
                "ttft_ms": 2100.0 if i >= 4 else 100.0, "e2e_ms": 4000.0, "tpot_ms": 30.0,
                "output_tokens": 64, "expected_prompt_tokens": 128, "server_timings": None,
                "timings_raw": None} for i in range(8)]
    results = {"settings": {"concurrency": 8}, "summary": {}, "requests": records,
               "server_state": {"engine": "sglang", "samples": samples, "interval_s": 0.2,
                                "config": {}}}
    results = _replay(results)
    summary = results["server_state"]["summary"]
    assert summary["capacity"] == 4 and summary["waiting_max"] == 4
    late = [r["server_state"] for r in results["requests"][4:]]
    assert all(s["queue_ms"] == pytest.approx(2000, abs=150) for s in late)
    first = results["summary"]["diagnoses"]["ttft"]["findings"][0]
    assert first["cause"] == "queue" and "--max-running-requests" in first["fix"]


def test_the_timeline_holds_each_sample_halfway_to_its_neighbours():
    from lifeline.bench.server_join import Timeline, waiting

    t = Timeline([{"t": 0.0, "waiting": 0, "running": 1}, {"t": 1.0, "waiting": 3, "running": 2},
                  {"t": 2.0, "waiting": 0, "running": 2}])
    assert t.at(0.49)["waiting"] == 0 and t.at(0.51)["waiting"] == 3
    assert t.seconds(0.0, 3.0, waiting) == pytest.approx(1.0)   # 0.5 to 1.5
    assert t.seconds(1.2, 1.4, waiting) == pytest.approx(0.2)
    assert t.seconds(-5.0, 0.4, waiting) == 0.0
    assert t.mean(0.0, 2.0, "running") == pytest.approx((0.5 * 1 + 1.5 * 2) / 2)
    assert t.peak(0.0, 0.4, "running") == 1
