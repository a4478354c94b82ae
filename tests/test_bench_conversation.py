"""The conversational length distribution that ships with the package (issue #4): the file is
in the package (and in a wheel built from it), `--length-dist conversation` draws from it when no
`--length-file` is given, prompt lengths are exact, the draws' statistics are the file's, and
the numbers that lifeline/bench/data/README.md quotes are the file's."""
import asyncio
import bisect
import csv
import fnmatch
import importlib.util
import json
import random
import re
import shutil
import statistics
import subprocess
import sys
import tomllib
import zipfile
from importlib import resources
from pathlib import Path

import pytest

from lifeline.bench.conversation import SHIPPED, shipped_pairs
from lifeline.bench.workloads import Lengths, random_requests
from tests.test_bench_client import scripted  # noqa: F401  (the scripted SSE server)

ROOT = Path(__file__).resolve().parents[1]
DATA = resources.files("lifeline.bench") / "data"


class WordTokenizer:
    """One id per word: exact counts without a server."""

    async def encode(self, text: str) -> list[int]:
        return [len(w) for w in text.split()]

    async def decode(self, ids: list[int]) -> str:
        return " ".join("w" * i for i in ids)


def _column(pairs, k):
    return [p[k] for p in pairs]


def test_the_distribution_is_a_file_of_the_installed_package():
    import lifeline.bench

    path = DATA / SHIPPED
    assert path.is_file()
    assert Path(str(path)).resolve().parent.parent == Path(lifeline.bench.__file__).resolve().parent
    with path.open(newline="") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["ContextTokens", "GeneratedTokens"]
    pairs = shipped_pairs()
    assert len(pairs) == len(rows) - 1 == 1000
    assert all(i > 0 and o > 0 for i, o in pairs)
    assert (DATA / "README.md").is_file()
    readme = (DATA / "README.md").read_text()
    for cited in ("vidur", "0.0.26", "CC-BY", "Splitwise", "scripts/make_conversation_lengths.py"):
        assert cited in readme
    globs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-data"]["lifeline.bench"]
    for name in (f"data/{SHIPPED}", "data/README.md"):
        assert any(fnmatch.fnmatch(name, g) for g in globs)


def test_a_wheel_built_from_the_source_carries_the_distribution(tmp_path):
    setuptools = pytest.importorskip("setuptools")
    if int(setuptools.__version__.split(".")[0]) < 68:
        pytest.skip("pyproject.toml builds with setuptools >= 68")
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "lifeline", src / "lifeline",
                    ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(tmp_path / "wheel"), str(src)], check=True, timeout=300)
    (wheel,) = (tmp_path / "wheel").glob("lifeline-*.whl")
    with zipfile.ZipFile(wheel) as z:
        shipped = z.read(f"lifeline/bench/data/{SHIPPED}")
        assert "lifeline/bench/data/README.md" in z.namelist()
    assert shipped == (DATA / SHIPPED).read_bytes()


def test_conversation_without_a_file_draws_exact_lengths_from_the_shipped_pairs():
    lengths = Lengths(128, 128, "conversation")
    assert lengths.pairs == shipped_pairs()
    known = set(shipped_pairs())
    for chat in (False, True):
        reqs = asyncio.run(random_requests(WordTokenizer(), lengths, 40, chat=chat, seed=5))
        for r in reqs:
            assert (r.prompt_tokens, r.max_tokens) in known
            n = len(r.prompt) if not chat else len(r.prompt.split())
            assert n == r.prompt_tokens
        assert len({(r.prompt_tokens, r.max_tokens) for r in reqs}) > 30
    # a trace file's pairs still take precedence
    assert Lengths(1, 1, "conversation", pairs=((5, 6),)).pair(random.Random(0)) == (5, 6)


def _ks(sample, population):
    """Kolmogorov-Smirnov distance between a sample and the population it was drawn from."""
    s, p = sorted(sample), sorted(population)
    return max(abs(bisect.bisect_right(s, x) / len(s) - bisect.bisect_right(p, x) / len(p))
               for x in set(p))


def test_draws_have_the_statistics_of_the_shipped_distribution():
    pairs = shipped_pairs()
    lengths, rng = Lengths(1, 1, "conversation"), random.Random(11)
    draws = [lengths.pair(rng) for _ in range(20_000)]
    assert set(draws) <= set(pairs)
    for k in (0, 1):
        got, want = _column(draws, k), _column(pairs, k)
        assert statistics.fmean(got) == pytest.approx(statistics.fmean(want), rel=0.03)
        assert statistics.median(got) == pytest.approx(statistics.median(want), rel=0.05)
        # 1.95 / sqrt(n) is the 0.1% critical value for n = 20,000 draws
        assert _ks(got, want) < 1.95 / len(draws) ** 0.5
    r_draws = statistics.correlation([float(i) for i, _ in draws], [float(o) for _, o in draws])
    r_file = statistics.correlation([float(i) for i, _ in pairs], [float(o) for _, o in pairs])
    assert r_draws == pytest.approx(r_file, abs=0.03)


def test_the_readme_quotes_the_files_statistics():
    readme = (DATA / "README.md").read_text()
    pairs = shipped_pairs()
    for k, label in ((0, "prompt"), (1, "output")):
        xs = _column(pairs, k)
        q = statistics.quantiles(xs, n=100, method="inclusive")
        row = re.search(rf"^\| sample, {label} \|(.*)\|$", readme, re.MULTILINE).group(1)
        cells = [c.strip().replace(",", "") for c in row.split("|")]
        assert cells == [str(len(xs)), f"{statistics.fmean(xs):.1f}", f"{q[9]:.0f}",
                         f"{statistics.median(xs):.0f}", f"{q[89]:.0f}", f"{q[98]:.0f}",
                         str(min(xs)), str(max(xs))]


def test_the_script_that_derived_it_samples_deterministically():
    spec = importlib.util.spec_from_file_location(
        "make_conversation_lengths", ROOT / "scripts" / "make_conversation_lengths.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    trace = [(i, i + 1) for i in range(1, script.ROWS + 1)]
    kept = script.sample(trace)
    assert len(kept) == script.COUNT == len(shipped_pairs())
    assert kept[0] == trace[0] and kept == script.sample(trace)
    assert kept[-1] == trace[(script.COUNT - 1) * script.ROWS // script.COUNT]


def test_bench_command_draws_shipped_lengths_without_a_file(scripted, tmp_path):  # noqa: F811
    from lifeline.cli import main

    _, url = scripted
    out = tmp_path / "out.json"
    assert main(["bench", "--url", url, "--model", "m", "--requests", "3", "--warmup", "0",
                 "--concurrency", "3", "--length-dist", "conversation", "--seed", "2",
                 "--json", str(out), "--quiet"]) == 0
    results = json.loads(out.read_text())
    assert results["settings"]["length_dist"] == "conversation"
    known = set(shipped_pairs())
    for rec in results["requests"]:
        assert rec["ok"]
        assert (rec["expected_prompt_tokens"], rec["usage_output_tokens"]) in known
        assert rec["usage_prompt_tokens"] == rec["expected_prompt_tokens"]
