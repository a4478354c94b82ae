"""`lifeline bench` sampling a real server's own `/metrics` during a run, and the join that gives
each request a queue from it. The server is Lifeline's (on loopback, a tiny random model), which
also reports every request's queue in its `timings`: that is the independent number the join,
which reads only the metrics, is held to. Stripping those timings down to what llama.cpp
reports (the prefill alone) and diagnosing again shows what the join does for a server that
reports no queue: the queue ranks first, not the network."""
import asyncio
import copy

import pytest

from lifeline.bench.compare import attribute, compare_html, engine_of
from lifeline.bench.diagnose import diagnose
from lifeline.bench.run import BenchSettings, run_bench
from lifeline.bench.server_join import join
from lifeline.bench.server_state import MAX_SAMPLES
from tests.test_diagnosis import _random_model, _serve
from tests.word_models import word_tokenizer

TOLERANCE = 0.20


@pytest.fixture(scope="module")
def two_seqs(tmp_path_factory):
    path = tmp_path_factory.mktemp("two")
    with _serve(_random_model(word_tokenizer(path), path), path, max_num_seqs=2) as srv:
        yield srv


def _bench(srv, **settings) -> dict:
    settings.setdefault("warmup", 1)
    return asyncio.run(run_bench(BenchSettings(url=srv.base_url + "/v1", **settings)))


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


@pytest.fixture(scope="module")
def queued(two_seqs):
    """Eight users on two sequences, outputs long enough that each wait spans many samples."""
    return _bench(two_seqs, concurrency=8, requests=24, input_tokens=16, output_tokens=96)


def test_the_sampler_reads_lifelines_metrics_through_the_run(queued):
    state = queued["server_state"]
    assert state["engine"] == "lifeline" and not state["errors"]
    samples = state["samples"]
    assert 5 <= len(samples) <= MAX_SAMPLES
    assert all(b["t"] > a["t"] for a, b in zip(samples, samples[1:]))
    gaps = sorted(b["t"] - a["t"] for a, b in zip(samples, samples[1:]))
    assert gaps[len(gaps) // 2] <= 0.25 + 0.05
    summary = state["summary"]
    assert summary["running_max"] == 2 and summary["waiting_max"] >= 4
    assert summary["capacity"] == 2
    # the server's own histograms over the run: 24 measured requests (the warm-up is before)
    assert summary["queue_ms_count"] >= 24
    assert summary["prompt_tokens"] >= 24 * 16


def test_the_join_finds_each_requests_queue_from_the_metrics_alone(queued):
    records = [r for r in queued["requests"] if r["ok"]]
    own = _mean(r["timings_raw"]["queue_ms"] for r in records)
    joined = _mean(r["server_state"]["queue_ms"] for r in records)
    assert own > 300
    assert abs(joined - own) <= TOLERANCE * own, (joined, own)
    held = [r["server_state"] for r in records if r["timings_raw"]["queue_ms"] > 200]
    assert held and all(s["limit"] == "max_num_seqs" for s in held)


def test_a_server_that_reports_no_queue_gets_the_queue_not_the_network(queued):
    """What llama.cpp reports (prefill and decode, no queue, no arrival): the queue is found
    from the sampled state and ranks first; the network keeps only its own small part."""
    results = copy.deepcopy(queued)
    for r in results["requests"]:
        t = r.get("server_timings") or {}
        r["server_timings"] = {"source": "llama.cpp", "front_ms": None, "queue_ms": None,
                               "prefill_ms": t.get("prefill_ms"), "decode_ms": t.get("decode_ms"),
                               "server_ttft_ms": None, "server_e2e_ms": None,
                               "cached_tokens": t.get("cached_tokens")}
        r.pop("server_state", None)
        r["timings_raw"] = {"prompt_ms": t.get("prefill_ms")}
    results["step_log"] = None
    own = _mean(r["timings_raw"]["queue_ms"] for r in queued["requests"] if r["ok"])
    results["server_state"]["summary"] = join(results, results["server_state"])
    diagnoses = diagnose(results)
    first = diagnoses["ttft"]["findings"][0]
    assert first["cause"] == "queue", diagnoses["ttft"]
    assert abs(first["ms"] - own) <= TOLERANCE * own
    network = next((f for f in diagnoses["ttft"]["findings"]
                    if f["cause"] == "client_network"), {"share": 0.0})
    assert network["share"] < 0.1
    assert "requests waiting" in first["evidence"]
    assert any("reports no queue time per request" in m for m in diagnoses["missing"])
    # without the sampled state the same data blames the network (what the issue saw)
    bare = copy.deepcopy(results)
    for r in bare["requests"]:
        r.pop("server_state", None)
    assert diagnose(bare)["ttft"]["findings"][0]["cause"] == "client_network"


def test_sampling_off_leaves_no_state_and_compare_names_the_engines(two_seqs, queued,
                                                                      tmp_path):
    off = _bench(two_seqs, concurrency=2, requests=6, input_tokens=16, output_tokens=24,
                 server_metrics="off")
    assert off["server_state"] is None
    assert all("server_state" not in r for r in off["requests"])
    a, b = dict(off, _label="two-users"), dict(queued, _label="eight-users")
    att = attribute(a, b)
    assert att["engines"][1]["engine"] == "lifeline"
    assert engine_of(b)["capacity"] == 2
    finding = att["ttft"]["finding"]
    assert finding["numbers"]["top"] == "queue"
    assert "queued for one of lifeline's 2 sequences" in finding["title"]
    page = compare_html([a, b], [att])
    assert "where eight-users differs from two-users" in page and "<table>" in page


def test_a_wrong_metrics_url_is_a_note_not_a_failure(two_seqs):
    r = _bench(two_seqs, concurrency=1, requests=2, input_tokens=8, output_tokens=4,
               server_metrics=two_seqs.base_url + "/no-such-metrics")
    assert r["server_state"] is None
    assert any("not sampled" in n for n in r["diagnosis_notes"])
    assert r["summary"]["successful"] == 2


def test_a_request_through_the_gateway_carries_the_upstreams_side_of_its_wait(two_seqs):
    """A gateway in front of the two-sequence server (an upstream, sampled by the gateway):
    each request's `timings.backend.state` holds the upstream's waiting seen by the gateway,
    held to the upstream's own queue time; the bench run through the gateway keeps the
    gateway's stages and the upstream's queue together."""
    from lifeline.gateway.config import parse_config
    from lifeline.gateway.testing import GatewayThread

    config = f"""
        [health]
        interval_s = 60
        [backends.up]
        base_url = "{two_seqs.base_url}/v1"
        model = "tiny"
        state_interval_s = 0.1
        [models.tiny]
        backends = ["up"]
        """
    with GatewayThread(parse_config(config, ".toml")) as gw:
        r = asyncio.run(run_bench(BenchSettings(
            url=gw.base_url + "/v1", model="tiny", concurrency=6, requests=12, warmup=1,
            input_tokens=16, output_tokens=64, server_metrics="off")))
    records = [x for x in r["requests"] if x["ok"]]
    assert len(records) == 12
    states = [x["timings_raw"]["backend"]["state"] for x in records]
    assert all(s["engine"] == "lifeline" and s["capacity"] == 2 for s in states)
    own = _mean(x["timings_raw"]["backend"]["timings"]["queue_ms"] for x in records)
    seen = _mean(s["queue_ms"] for s in states)
    assert own > 200
    assert abs(seen - own) <= TOLERANCE * own + 50, (seen, own)
    first = r["summary"]["diagnoses"]["ttft"]["findings"][0]
    assert first["cause"] == "queue"
    assert all(x["server_timings"]["source"] == "gateway/lifeline" for x in records)
    assert all(x["timings_raw"]["gateway_ms"] is not None for x in records)
