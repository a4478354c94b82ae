"""`lifeline plan` as a user runs it: the catalog, a plan whose JSON `lifeline bench compare`
reads beside another, Users @ SLO, a sweep, the HTML report, and clear errors."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from lifeline.cli import main
from lifeline.plan.hardware import CATALOG

BASE = ["plan", "--model", "llama-3.1-8b", "--quiet"]


def plan(tmp_path, name: str, *args: str) -> dict:
    out = tmp_path / f"{name}.json"
    assert main([*BASE, *args, "--json", str(out)]) == 0
    return json.loads(out.read_text())


def test_list_hardware_shows_every_catalog_entry_with_its_price_source():
    r = subprocess.run([sys.executable, "-m", "lifeline.cli", "plan", "--list-hardware"],
                       capture_output=True, text=True, timeout=60, env={"COLUMNS": "250",
                                                                         "PATH": ""})
    assert r.returncode == 0, r.stderr
    for hw_id in ("a100-80gb", "h100-sxm", "h200", "b200", "l40s", "rtx-4090", "mi300x"):
        assert hw_id in r.stdout and hw_id in CATALOG
    assert "Lambda" in r.stdout


def test_a_plan_is_a_bench_result_that_compare_reads(tmp_path, capsys):
    h100 = plan(tmp_path, "h100", "--hardware", "h100-sxm", "--weights", "fp8", "--kv-dtype",
                "fp8", "--concurrency", "8", "--requests", "40")
    a100 = plan(tmp_path, "a100", "--hardware", "a100-80gb", "--concurrency", "8",
                "--requests", "40")
    for r in (h100, a100):
        assert r["schema"] == "lifeline.bench/1" and r["summary"]["successful"] == 40
        assert r["settings"]["concurrency"] == 8
        assert r["summary"]["cost"]["dollars_per_million_output_tokens"] > 0
        assert all(rec["server_timings"]["source"] == "lifeline-plan" for rec in r["requests"])
    # a faster card, fp8 weights: more throughput, a shorter TPOT
    assert (h100["summary"]["output_throughput_tok_s"]
            > 1.5 * a100["summary"]["output_throughput_tok_s"])
    assert h100["plan"]["bounds"]["decode"] == "memory bandwidth"
    capsys.readouterr()
    assert main(["bench", "compare", str(tmp_path / "a100.json"),
                 str(tmp_path / "h100.json")]) == 0
    table = capsys.readouterr().out
    assert "TPOT p50 ms" in table and "a100" in table and "h100" in table


def test_find_max_users_answers_users_at_slo_per_gpu_and_per_dollar(tmp_path):
    r = plan(tmp_path, "slo", "--hardware", "h100-sxm", "--find-max-users", "--slo",
             "ttft=300ms,tpot=12ms", "--requests", "16", "--input-tokens", "512",
             "--output-tokens", "64", "--max-users", "512")
    search = r["search"]
    users = search["max_users"]
    assert 1 < users < 512
    met = {t["concurrency"]: t["met"] for t in search["trials"]}
    assert met[users] and not met.get(users + 1, False)
    assert all(ok for n, ok in met.items() if n <= users)
    cost = r["summary"]["cost"]
    assert cost["users_per_gpu"] == users
    price = CATALOG["h100-sxm"].price_per_hour
    assert cost["users_per_dollar_hour"] == pytest.approx(users / price)
    assert cost["cost_per_hour"] == CATALOG["h100-sxm"].price_per_hour


def test_two_gpus_of_tensor_parallelism_serve_a_model_one_cannot_hold(tmp_path, capsys):
    assert main(["plan", "--model", "llama-3.1-70b", "--hardware", "h100-sxm", "--quiet",
                 "--requests", "4"]) == 2
    assert "does not fit" in capsys.readouterr().err
    r = plan(tmp_path, "tp2", "--hardware", "h100-sxm", "--requests", "4")  # warm the path
    assert r["plan"]["tp"] == 1
    out = tmp_path / "70b.json"
    assert main(["plan", "--model", "llama-3.1-70b", "--hardware", "h100-sxm", "--tp", "2",
                 "--quiet", "--requests", "8", "--concurrency", "4", "--json", str(out)]) == 0
    tp2 = json.loads(out.read_text())
    assert tp2["plan"]["devices"] == 2
    assert tp2["plan"]["phases"]["decode"]["by_kind_s"]["comm"] > 0
    assert tp2["summary"]["cost"]["cost_per_hour"] == 2 * CATALOG["h100-sxm"].price_per_hour


def test_a_sweep_and_the_html_report(tmp_path):
    html = tmp_path / "r.html"
    r = plan(tmp_path, "sweep", "--hardware", "l40s", "--sweep", "1,4,16", "--requests", "16",
             "--output-tokens", "32", "--html", str(html))
    rows = r["sweep"]["trials"]
    assert [t["concurrency"] for t in rows] == [1, 4, 16]
    speeds = [t["output_throughput_tok_s"] for t in rows]
    assert speeds == sorted(speeds)
    page = html.read_text()
    assert page.count("<svg") == 6 and "queue" in page and "decode" in page  # 2: diagnosis
    assert "<h2>Diagnosis</h2>" in page and "a plan:" in page


@pytest.mark.parametrize("args, message", [
    (["--hardware", "h999"], "unknown hardware"),
    (["--hardware", "h100-sxm", "--weights", "fp8", "--rate", "2", "--turns", "2"],
     "multi-turn"),
])
def test_bad_plans_are_clear_errors(args, message, capsys):
    assert main([*BASE, *args, "--requests", "2"]) == 2
    assert message in capsys.readouterr().err.lower()


def test_this_cpu_needs_a_calibration(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LIFELINE_CACHE", str(tmp_path))
    assert main([*BASE, "--hardware", "this-cpu", "--requests", "2"]) == 2
    assert "lifeline plan calibrate" in capsys.readouterr().err
