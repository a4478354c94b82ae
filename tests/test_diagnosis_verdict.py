"""The run's one-line verdict (`summary.diagnosis`) names what the ranked findings under it
rank first, in the JSON, the bench's printed report and its HTML report alike. A chat run with a
long system prompt against a real server on loopback (a tiny random-weight model): its TTFT is
mostly the system prompt's prefill, which a verdict made from the TTFT stages called "mostly
prefill" while the first finding named the system prompt."""
import asyncio
import html
import io
import re

import pytest
from rich.console import Console

from lifeline.bench.html import render
from lifeline.bench.report import print_report
from lifeline.bench.run import BenchSettings, run_bench
from lifeline.bench.verdict import cause_label, verdict
from tests.test_diagnosis import _random_model, _serve, _system_dataset
from tests.word_models import word_tokenizer


@pytest.fixture(scope="module")
def words(tmp_path_factory):
    path = tmp_path_factory.mktemp("verdict")
    with _serve(_random_model(word_tokenizer(path), path), path) as srv:
        yield srv


def _printed(results: dict) -> str:
    console = Console(file=io.StringIO(), width=100_000, color_system=None)
    print_report(console, results)
    return " ".join(console.file.getvalue().split())


def test_the_verdict_of_a_long_system_prompt_names_the_first_ranked_cause(words, tmp_path):
    dataset = _system_dataset(tmp_path, 1400, 5, True)
    r = asyncio.run(run_bench(BenchSettings(url=words.base_url + "/v1", endpoint="chat",
                                            concurrency=1, requests=4, warmup=1,
                                            dataset=dataset, output_tokens=4)))
    s = r["summary"]
    ttft, output = (s["diagnoses"][k]["findings"][0] for k in ("ttft", "output"))
    assert ttft["cause"] == "prompt_assembly", s["diagnoses"]["ttft"]
    line = s["diagnosis"]
    assert line.startswith(f"TTFT (p50 {s['diagnoses']['ttft']['ms_p50']:,.0f} ms) is mostly "
                           f"prompt assembly ({ttft['share']:.0%}): {ttft['title']}"), line
    assert "system prompt is" in line and ttft["fix"] in line
    assert "mostly prefill" not in line
    assert f"{cause_label('output', output['cause'])} ({output['share']:.0%}): " \
           f"{output['title']}" in line
    assert line == verdict(s["diagnoses"])
    assert f"verdict: {line}" in _printed(r)
    assert f"verdict: {html.escape(line)}" in render(r)


def _section(*findings: tuple[str, float, float], p50: float | None = None) -> dict:
    rows = [{"cause": c, "share": share, "ms": ms, "title": f"the {c} finding",
             "evidence": "", "fix": f"fix the {c}"} for c, share, ms in findings]
    return {"ms_p50": p50, "tpot_ms_p50": p50, "ttfat_ms_p50": p50, "findings": rows}


def test_a_section_is_mostly_its_first_cause_only_from_half_of_it_on():
    even = verdict({"ttft": _section(("queue", 0.4, 40.0), ("prefill", 0.35, 35.0),
                                     ("front", 0.25, 25.0), p50=98.0)})
    assert even == ("TTFT (p50 98 ms): no cause dominates; the largest is queue (40%): the "
                    "queue finding; fix: fix the queue.")
    half = verdict({"ttft": _section(("prefill", 0.5, 50.0), ("queue", 0.5, 50.0))})
    assert half == "TTFT is mostly prefill (50%): the prefill finding; fix: fix the prefill."


def test_the_verdict_takes_ttft_then_ttfat_then_tpot_and_nothing_without_findings():
    d = {"output": _section(("kv_context", 0.8, 24.0), p50=30.0),
         "answer": _section(("reasoning", 0.9, 900.0), p50=1000.0),
         "ttft": _section(("client_network", 0.7, 70.0), p50=100.0), "missing": []}
    line = verdict(d)
    heads = [m.group(0) for m in re.finditer(r"(TTFT|TTFAT|TPOT) \(p50 [^)]*\) is mostly [^(]*",
                                             line)]
    assert heads == ["TTFT (p50 100 ms) is mostly client and network ",
                     "TTFAT (p50 1,000 ms) is mostly reasoning ",
                     "TPOT (p50 30 ms) is mostly KV context "]
    assert verdict({"ttft": {"findings": []}, "output": {"findings": []}, "missing": []}) is None
    assert verdict(None) is None
