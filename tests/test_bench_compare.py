"""`lifeline bench compare`: runs side by side, each value with its ratio to the first run."""
import json

from rich.console import Console

from lifeline.bench.compare import compare_table, load
from lifeline.bench.metrics import Chunk, RequestTrace, request_metrics, summarize
from lifeline.cli import main


def _results(path, ttft_s: float, model: str) -> str:
    traces = [RequestTrace(sent=0.0, chunks=[Chunk(ttft_s), Chunk(ttft_s + 0.1)], done=ttft_s + 0.1,
                           output_tokens=2, prompt_tokens=8) for _ in range(3)]
    summary = summarize([request_metrics(t) for t in traces], duration_s=1.0)
    path.write_text(json.dumps({"schema": "lifeline.bench/1", "summary": summary,
                                "settings": {"model": model, "concurrency": 4}, "requests": []}))
    return str(path)


def test_compare_shows_each_run_against_the_first(tmp_path, capsys):
    a = _results(tmp_path / "engine_a.json", 0.2, "dense")
    b = _results(tmp_path / "engine_b.json", 0.3, "moe")
    console = Console(record=True, width=120)
    console.print(compare_table([load(a), load(b)]))
    text = console.export_text()
    assert "engine_a" in text and "engine_b" in text and "moe" in text
    ttft_row = next(line for line in text.splitlines() if "TTFT p50" in line)
    assert "200.00" in ttft_row and "300.00" in ttft_row and "(1.50×)" in ttft_row
    assert "Concurrent Users" not in text  # no run searched: the row is left out
    assert main(["bench", "compare", a, b]) == 0
    assert "(1.50×)" in capsys.readouterr().out


def test_compare_refuses_what_is_not_a_bench_result(tmp_path):
    other = tmp_path / "x.json"
    other.write_text("{}")
    assert main(["bench", "compare", str(other)]) == 2
    assert main(["bench", "frobnicate", str(other)]) == 2
