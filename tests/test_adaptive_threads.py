"""Intra-op threads by the cores other processes leave free (lifeline.engine.threads): the
governor's rule on given readings, its reading of a real busy process through /proc, and an
engine stepping with it while another process keeps a core busy, whose greedy text is the one
it gives with a fixed thread count."""
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from lifeline.bench.workloads import WORDS
from lifeline.engine.engine import EngineConfig
from lifeline.engine.sampling_params import SamplingParams
from lifeline.engine.threads import Reading, ThreadGovernor
from lifeline.llm import LLM
from lifeline.model.loader import load_model
from tests.word_models import tiny_gemma3

TICK = os.sysconf("SC_CLK_TCK")


class Readings:
    """Readings one second apart in which other processes use `others` cores and this one
    `own`."""

    def __init__(self):
        self.at, self.machine, self.own = 0.0, 0, 0
        self.others, self.own_cores = 0.0, 1.0

    def __call__(self) -> Reading:
        self.at += 1.0
        self.own += round(self.own_cores * TICK)
        self.machine += round((self.others + self.own_cores) * TICK)
        return Reading(self.at, self.machine, self.own)


def _governor(readings: Readings, threads: int, cores: int, applied: list[int]) -> ThreadGovernor:
    g = ThreadGovernor(threads, interval=0.0, read=readings, cores=cores,
                       set_threads=applied.append)
    return g


def test_a_busy_core_takes_one_thread_after_two_readings_and_gives_it_back():
    readings, applied = Readings(), []
    g = _governor(readings, threads=2, cores=2, applied=applied)
    assert g.poll() is None and g.threads == 2  # nothing else running
    readings.others = 0.5  # another process shares a core with one of ours
    assert g.poll() is None and g.threads == 2  # one reading is not enough
    assert g.poll() == 1 and g.threads == 1 and applied == [1]
    readings.others = 1.0  # it has the core to itself now
    assert g.poll() is None and g.threads == 1
    readings.others = 0.1  # a client's few percent: both cores free again
    assert g.poll() is None
    assert g.poll() == 2 and applied == [1, 2] and g.changes == 2
    assert g.others == pytest.approx(0.1, abs=0.02)


def test_the_count_stays_within_one_and_the_configured_threads():
    readings, applied = Readings(), []
    g = _governor(readings, threads=4, cores=8, applied=applied)
    readings.others = 2.0  # 6 free: still the 4 configured
    for _ in range(3):
        assert g.poll() is None
    readings.others = 7.9  # nothing free: one thread, never none
    g.poll()
    assert g.poll() == 1 and applied == [1]
    readings.others = 5.0  # 3 free
    g.poll()
    assert g.poll() == 3 and applied == [1, 3]


def test_a_flicker_of_one_reading_changes_nothing():
    readings, applied = Readings(), []
    g = _governor(readings, threads=2, cores=2, applied=applied)
    for others in (1.0, 0.0, 1.0, 0.0, 0.0):
        readings.others = others
        g.poll()
    assert applied == [] and g.threads == 2


def test_without_proc_the_configured_count_stays():
    g = ThreadGovernor(2, interval=0.0, read=lambda: None, set_threads=pytest.fail)
    assert g.poll() is None and g.threads == 2


@pytest.fixture
def busy_core():
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


def test_a_real_busy_process_is_read_from_proc(busy_core):
    """Other test processes may be busy too: they only add to what the governor reads."""
    cores = len(os.sched_getaffinity(0))
    applied = []
    g = ThreadGovernor(cores, interval=0.1, set_threads=applied.append)
    seen, deadline = [], time.monotonic() + 5
    while time.monotonic() < deadline and not applied:
        time.sleep(0.12)
        g.poll()
        seen.append(g.others)
    assert max(seen) >= 0.8, seen
    assert applied and applied[-1] <= max(1, cores - 1), (applied, seen)


def test_an_engine_steps_with_the_free_cores_and_its_text_does_not_change(tmp_path, busy_core):
    path = tmp_path / "gemma3"
    path.mkdir()
    tiny_gemma3(path, layers=2)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = [" ".join(WORDS[:6]), " ".join(WORDS[10:13])]
    results = {}

    def run(adaptive: bool) -> None:  # a thread of its own: thread counts are per thread
        torch.set_num_threads(2)
        llm = LLM(load_model(path), weights="int8-all", adaptive_threads=adaptive)
        governor = llm.engine.threads
        if adaptive:
            governor.interval, governor.cores = 0.05, 2  # two cores, one busy, on any machine
            deadline = time.monotonic() + 20
            while governor.changes == 0 and time.monotonic() < deadline:
                llm.generate(prompts, params)  # each step polls the governor
        texts = [r.token_ids for r in llm.generate(prompts, params)]
        results[adaptive] = (texts, governor, torch.get_num_threads())

    for adaptive in (False, True):
        t = threading.Thread(target=run, args=(adaptive,))
        t.start()
        t.join()
    assert results[False][1] is None and results[False][2] == 2
    texts, governor, threads_after = results[True]
    assert governor is not None and governor.changes >= 1, governor.others
    # what the governor set is what the stepping thread runs with
    assert threads_after == governor.threads
    assert texts == results[False][0]


def test_engine_config_takes_it_off_by_default():
    assert EngineConfig().adaptive_threads is False
