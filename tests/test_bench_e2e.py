"""`lifeline bench` as a user runs it, against a real Lifeline server on loopback (a tiny
random-weight Llama behind a word-level tokenizer, so it is fast): the JSON results hold the
documented summary, and the request and token counts agree with what the server reported in
`usage` and counted in its own Prometheus totals."""
import json

import httpx
import pytest

from lifeline.cli import main
from lifeline.engine.engine import EngineConfig
from lifeline.server.config import ServerConfig
from lifeline.server.testing import ServerThread
from tests.word_models import tiny_llama, word_tokenizer

REQUESTS, WARMUP, USERS, INPUT, OUTPUT = 12, 1, 4, 24, 6
DIST_KEYS = {"mean", "p50", "p90", "p95", "p99"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("words")
    loaded = tiny_llama(word_tokenizer(path), path, max_position=256)
    config = ServerConfig(served_model_name="tiny", engine=EngineConfig(num_kv_blocks=256))
    with ServerThread(loaded, config) as srv:
        yield srv


def _counter(base_url: str, name: str) -> float:
    text = httpx.get(base_url + "/metrics").text
    line = next(li for li in text.splitlines()
                if li.startswith(name + "{") and 'model_name="tiny"' in li)
    return float(line.rsplit(" ", 1)[1])


def test_closed_loop_run_reports_the_summary_and_the_servers_token_counts(server, tmp_path):
    out = tmp_path / "out.json"
    prompt_before = _counter(server.base_url, "lifeline:prompt_tokens_total")
    output_before = _counter(server.base_url, "lifeline:generation_tokens_total")
    rc = main(["bench", "--url", server.base_url + "/v1", "--concurrency", str(USERS),
               "--requests", str(REQUESTS), "--warmup", str(WARMUP),
               "--input-tokens", str(INPUT), "--output-tokens", str(OUTPUT),
               "--slo", "ttft=60s,tpot=10s", "--json", str(out), "--quiet"])
    assert rc == 0
    results = json.loads(out.read_text())
    s = results["summary"]
    for key in ("ttft_ms", "ttfat_ms", "tbt_ms", "tpot_ms", "e2e_ms"):
        assert DIST_KEYS <= set(s[key]) and s[key]["p50"] > 0, key
    for key in ("output_throughput_tok_s", "total_throughput_tok_s", "request_throughput_rps",
                "goodput_rps"):
        assert s[key] > 0, key
    assert results["settings"]["model"] == "tiny"
    assert s["requests"] == s["successful"] == REQUESTS and s["errors"] == {}
    assert s["slo"]["met"] and s["goodput_rps"] == pytest.approx(s["request_throughput_rps"])

    records = results["requests"]
    assert len(records) == REQUESTS
    assert all(r["usage_prompt_tokens"] == r["expected_prompt_tokens"] == INPUT for r in records)
    assert all(r["usage_output_tokens"] == r["output_tokens"] == OUTPUT for r in records)
    assert all(len(r["tbt_ms"]) == OUTPUT - 1 for r in records)
    assert s["prompt_tokens"] == REQUESTS * INPUT and s["output_tokens"] == REQUESTS * OUTPUT
    sent = REQUESTS + WARMUP
    assert _counter(server.base_url, "lifeline:prompt_tokens_total") - prompt_before == sent * INPUT
    assert _counter(server.base_url, "lifeline:generation_tokens_total") - output_before \
        == sent * OUTPUT

    for r in records:  # the server's TTFT sits inside the client's, and the stages add up
        split = r["ttft_split_ms"]
        assert r["server_timings"]["source"] == "lifeline"
        assert split["client_network"] >= 0 and split["queue"] >= 0 and split["prefill"] > 0
        assert sum(split.values()) == pytest.approx(r["ttft_ms"])
    assert s["ttft_stages"]["queue_ms"]["count"] == REQUESTS
    first = s["diagnoses"]["ttft"]["findings"][0]
    assert s["diagnosis"].startswith("TTFT (p50 ") and first["title"] in s["diagnosis"]


def test_find_max_users_on_a_small_budget_reports_the_search_and_cost(server, tmp_path):
    out = tmp_path / "search.json"
    rc = main(["bench", "--url", server.base_url + "/v1", "--find-max-users", "--max-users", "4",
               "--requests", "4", "--warmup", "0", "--input-tokens", "16", "--output-tokens", "4",
               "--slo", "ttft=60s,e2e=120s", "--cost-per-hour", "2", "--gpus", "2",
               "--json", str(out), "--quiet"])
    assert rc == 0
    results = json.loads(out.read_text())
    search = results["search"]
    assert search["max_users"] == 4  # a generous SLO holds up to the limit
    assert [t["concurrency"] for t in search["trials"]] == [1, 2, 4]
    assert all(t["met"] for t in search["trials"])
    assert results["settings"]["concurrency"] == 4
    assert results["summary"]["requests"] == 16  # at least 4 requests per user
    c = results["summary"]["cost"]
    assert c["users_per_gpu"] == 2 and c["dollars_per_million_output_tokens"] > 0


def test_chat_run_counts_the_template_and_times_the_first_token_not_the_role_chunk(server,
                                                                                    tmp_path):
    out = tmp_path / "chat.json"
    rc = main(["bench", "--url", server.base_url + "/v1", "--endpoint", "chat",
               "--concurrency", "2", "--requests", "4", "--input-tokens", "20",
               "--output-tokens", "5", "--json", str(out), "--quiet"])
    assert rc == 0
    records = json.loads(out.read_text())["requests"]
    assert len(records) == 4 and all(r["ok"] for r in records)
    assert all(r["usage_output_tokens"] == r["output_tokens"] == 5 for r in records)
    assert all(r["usage_prompt_tokens"] > r["expected_prompt_tokens"] == 20 for r in records)
    # the server sends its role chunk before any token: timing it would put the client's TTFT
    # before the server's
    assert all(r["ttft_split_ms"]["client_network"] >= 0 for r in records)


def test_multi_turn_sessions_grow_the_prompt_and_hit_the_prefix_cache(server, tmp_path):
    out = tmp_path / "turns.json"
    rc = main(["bench", "--url", server.base_url + "/v1", "--endpoint", "chat", "--turns", "3",
               "--concurrency", "2", "--requests", "6", "--warmup", "0", "--input-tokens", "40",
               "--output-tokens", "4", "--json", str(out), "--quiet"])
    assert rc == 0
    records = json.loads(out.read_text())["requests"]
    # the users share the 6-request budget: a faster one can finish its session and open the
    # next (turns 0,1,2,0 + 0,1), so only the shape of the count is fixed
    turns = [r["turn"] for r in records]
    assert len(turns) == 6 and turns.count(0) >= turns.count(1) >= turns.count(2) >= 1
    by_turn = {t: [r for r in records if r["turn"] == t] for t in (0, 1, 2)}
    first, last = by_turn[0][0]["usage_prompt_tokens"], by_turn[2][0]["usage_prompt_tokens"]
    assert last > first + 2 * 40  # two more prompts and two answers in the history
    assert all(r["server_timings"]["cached_tokens"] > 0 for r in by_turn[2])


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_exact_tokens_asks_for_logprobs_and_the_event_counts_agree_with_usage(server, tmp_path,
                                                                              endpoint):
    """Lifeline streams one token an event, so this checks that both endpoints accept the
    logprobs request and the counts parsed from it; multi-token events are covered against the
    scripted server."""
    out = tmp_path / "exact.json"
    rc = main(["bench", "--url", server.base_url + "/v1", "--endpoint", endpoint,
               "--exact-tokens", "--concurrency", "2", "--requests", "4", "--warmup", "0",
               "--input-tokens", "12", "--output-tokens", "5", "--json", str(out), "--quiet"])
    assert rc == 0
    records = json.loads(out.read_text())["requests"]
    assert all(r["ok"] and r["event_tokens"] == r["usage_output_tokens"] == 5 for r in records)


def test_long_context_prompts_fill_the_servers_context(server, tmp_path):
    out = tmp_path / "long.json"
    rc = main(["bench", "--url", server.base_url + "/v1", "--long-context", "--concurrency", "2",
               "--requests", "2", "--warmup", "0", "--output-tokens", "4", "--json", str(out),
               "--quiet"])
    assert rc == 0
    results = json.loads(out.read_text())
    context = httpx.get(server.base_url + "/v1/models").json()["data"][0]["max_model_len"]
    assert results["settings"]["input_tokens"] == context - 4 - 16
    assert all(r["ok"] and r["usage_prompt_tokens"] == context - 20 for r in results["requests"])
