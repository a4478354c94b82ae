"""`--html`: a self-contained page whose figures are well-formed SVG — the diagnosis's share
bars, the load charts with the SLO knee for a sweep, the stacked TTFT breakdown and the
waterfall."""
import re
import xml.etree.ElementTree as ET
from datetime import UTC, datetime

from lifeline.bench.client import BenchRequest
from lifeline.bench.html import render
from lifeline.bench.load import RunResult, Sent
from lifeline.bench.metrics import Chunk, RequestTrace, Slo
from lifeline.bench.run import BenchSettings, results
from lifeline.bench.stages import normalize

TIMINGS = {"gateway_ms": 1.0, "template_ms": 0.0, "tokenize_ms": 0.5, "queue_ms": 20.0,
           "prefill_ms": 5.0, "ttft_ms": 26.5}


def _results():
    sent = []
    for i in range(6):
        t0 = i * 0.01
        trace = RequestTrace(sent=t0, chunks=[Chunk(t0 + 0.03), Chunk(t0 + 0.04)],
                             done=t0 + 0.05, output_tokens=2, prompt_tokens=8,
                             server_timings=normalize({"timings": TIMINGS}))
        sent.append(Sent(BenchRequest([1] * 8, 2, 8), trace, t0))
    out = results(BenchSettings(url="http://x/v1", model="m"), RunResult(sent, 0.0, 0.1),
                  Slo.parse("ttft=1s"), datetime.now(UTC))
    out["sweep"] = {"metric": "concurrency", "trials": [
        {"concurrency": c, "met": c < 8, "attainment": 1.0 if c < 8 else 0.5,
         "ttft_p90_ms": 10.0 * c, "tpot_p90_ms": 2.0 * c, "e2e_p90_ms": 30.0 * c,
         "output_throughput_tok_s": 100.0 * c, "goodput_rps": 1.0, "failed": 0}
        for c in (1, 2, 4, 8)]}
    return out


def test_the_report_holds_well_formed_figures_and_marks_the_slo_knee():
    page = render(_results())
    svgs = re.findall(r"<svg.*?</svg>", page, re.DOTALL)
    # the diagnosis's TTFT and TPOT bars; latency and throughput against load, TTFT stages,
    # waterfall
    assert len(svgs) == 6
    for svg in svgs:
        ET.fromstring(svg)
    assert page.count("SLO knee 4") == 2  # the largest concurrency that met the SLO
    assert "queue: 20.0 ms" in page and "verdict: TTFT (p50 30 ms) is mostly queue (67%)" in page
    diagnosis = page[page.index("<h2>Diagnosis</h2>"):]
    first_row = re.search(r"<tr><td>(\d+)%</td><td>(\w+)</td>", diagnosis)
    assert first_row.group(2) == "queue" and int(first_row.group(1)) == round(20 / 30 * 100)
    assert "<script" not in page and "http://" not in page.replace("http://x/v1", "") \
        .replace("http://www.w3.org/2000/svg", "")


def test_a_plain_run_has_no_load_charts():
    run = _results()
    del run["sweep"]
    assert len(re.findall(r"<svg", render(run))) == 4
