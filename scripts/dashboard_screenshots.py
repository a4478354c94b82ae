"""The screenshots of docs/diagnosis.md: the live view while `lifeline bench` loads a real
server, with its slowest request's diagnosis open, and the bench's HTML report of that run.

    .venv/bin/python scripts/dashboard_screenshots.py --out docs/img

A server with the default model on loopback (four sequences at a time, so the bench's six users
queue), Debian's chromium through Playwright (as tests/test_dashboard_browser.py drives it).
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from playwright.sync_api import Page, sync_playwright

from lifeline.engine.engine import EngineConfig
from lifeline.model.loader import load_model
from lifeline.server.config import ServerConfig
from lifeline.server.testing import ServerThread

CHROMIUM = "/usr/bin/chromium"
VIEWPORT = {"width": 1400, "height": 1000}
BENCH = ["--concurrency", "6", "--requests", "24", "--input-tokens", "400", "--output-tokens",
         "48", "--prefix-groups", "2", "--prefix-tokens", "200", "--quiet"]
FINISHED_BEFORE_SHOT = 12
"""Requests the bench has finished when the live view is photographed (it still runs)."""


def _finished(base_url: str) -> list[dict]:
    rows = httpx.get(base_url + "/debug/requests", timeout=30).json()["data"]
    return [r for r in rows if r.get("state") == "finished"]


def _shoot_dashboard(page: Page, base_url: str, out: Path) -> None:
    deadline = time.monotonic() + 600
    while len(_finished(base_url)) < FINISHED_BEFORE_SHOT and time.monotonic() < deadline:
        time.sleep(0.5)
    slowest = max(_finished(base_url), key=lambda r: r["timings"]["ttft_ms"] or 0)
    page.click(f'.row[data-request-id="{slowest["id"]}"] .id')
    page.wait_for_selector("#diagnosis .finding", timeout=60000)
    page.wait_for_timeout(1200)
    page.screenshot(path=str(out / "dashboard.png"), full_page=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("docs/img"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    engine = EngineConfig(kv_cache_memory_bytes=256 << 20, max_num_seqs=4,
                          max_num_batched_tokens=256)
    with ServerThread(load_model(), ServerConfig(engine=engine)) as srv, \
            tempfile.TemporaryDirectory() as tmp, sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True,
                                    args=["--no-sandbox"])
        page = browser.new_page(viewport=VIEWPORT)
        page.goto(srv.base_url + "/dashboard")
        page.wait_for_selector("body[data-events]", timeout=60000)
        report = Path(tmp) / "report.html"
        bench = subprocess.Popen([sys.executable, "-m", "lifeline.cli", "bench", "--url",
                                  srv.base_url + "/v1", "--html", str(report), *BENCH])
        _shoot_dashboard(page, srv.base_url, args.out)
        if bench.wait(900) != 0:
            print("lifeline bench failed", file=sys.stderr)
            return 1
        page.goto(report.as_uri())
        page.screenshot(path=str(args.out / "bench_report.png"), full_page=True)
        browser.close()
    print(f"wrote {args.out / 'dashboard.png'} and {args.out / 'bench_report.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
