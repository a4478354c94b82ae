"""Intra-op threads by what the machine leaves free (`EngineConfig.adaptive_threads`).

PyTorch's parallel kernels (the int8 GEMMs, oneDNN, Lifeline's C++ operators, Inductor's
loops) split each call over a team of threads and wait for the last one at its end. While
another process keeps one of two cores busy, the second thread of the team shares that core,
and every call waits for the scheduler to give it a slice: one user's decode on SmolLM2 fell
from ~15 to ~40 ms a token, its p90 token gap to ~130 ms, where one thread on the free core
decodes at ~17 ms (docs/performance.md). So the engine thread asks, every `interval` seconds,
how much CPU the machine's other processes used over the last interval and runs with the
cores they leave (at least one, at most the configured count), changing only after two
readings agree.

What counts as "other": the busy time of the CPUs this process may run on (`/proc/stat`'s
per-CPU lines, user + system + irq + softirq), less this process's own (`/proc/self/stat`,
every thread of it). Niced time is left out, so that the background compile's child (nice 19,
which yields to the server) does not count, unless this process is niced itself. Where
`/proc` cannot be read (not Linux), the governor keeps the configured count.
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

INTERVAL_S = 0.25
"""How often the engine thread reads the CPU counters (~30 µs a reading)."""
MARGIN = 0.35
"""Cores others must leave beyond a whole number for it to count as free: with one core busy
and two threads of ours on two cores the other process gets about half a core (the two share
one), which reads as 1.5 free and must give one thread."""


@dataclass(frozen=True, slots=True)
class Reading:
    at: float
    """Monotonic seconds."""
    machine: int
    """Busy clock ticks of this process's CPUs, all processes."""
    own: int
    """This process's clock ticks (all its threads)."""


def _read_proc(cpus: frozenset[int], count_nice: bool) -> Reading | None:
    try:
        with open("/proc/stat") as f:
            lines = f.read().splitlines()
        with open("/proc/self/stat") as f:
            own = f.read()
    except OSError:
        return None
    machine = 0
    for line in lines:
        name, _, rest = line.partition(" ")
        if not name.startswith("cpu") or name == "cpu" or int(name[3:]) not in cpus:
            continue
        user, nice, system, _idle, _iowait, irq, softirq = (int(v) for v in rest.split()[:7])
        machine += user + system + irq + softirq + (nice if count_nice else 0)
    fields = own[own.rindex(")") + 2:].split()
    return Reading(time.monotonic(), machine, int(fields[11]) + int(fields[12]))


class ThreadGovernor:
    """`poll()` from the thread that runs the steps; it sets that thread's intra-op thread
    count (`torch.set_num_threads`) when what the machine leaves free has changed."""

    def __init__(self, threads: int, interval: float = INTERVAL_S,
                 read: Callable[[], Reading | None] | None = None, cores: int | None = None,
                 set_threads: Callable[[int], None] = torch.set_num_threads):
        try:
            cpus = frozenset(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            cpus = frozenset(range(os.cpu_count() or 1))
        self.max_threads = max(1, threads)
        self.threads = self.max_threads
        """The count in force."""
        self.cores = cores or len(cpus)
        self.interval = interval
        self.others = 0.0
        """Cores the other processes used over the last interval."""
        self.changes = 0
        """How many times the count changed."""
        count_nice = _niceness() > 0
        self._read = read or (lambda: _read_proc(cpus, count_nice))
        self._tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self._set = set_threads
        self._last = self._read()
        self._pending: int | None = None

    def poll(self) -> int | None:
        """Read the counters if an interval has passed; the new thread count where it changed
        (and set it), else None."""
        if self._last is None:
            return None
        now = time.monotonic()
        if now - self._last.at < self.interval:
            return None
        reading = self._read()
        if reading is None:
            return None
        seconds = reading.at - self._last.at
        busy = (reading.machine - self._last.machine) - (reading.own - self._last.own)
        self._last = reading
        self.others = max(0.0, busy / self._tick / seconds) if seconds > 0 else 0.0
        wanted = max(1, min(self.max_threads, int(self.cores - self.others + MARGIN)))
        if wanted == self.threads:
            self._pending = None
            return None
        if self._pending != wanted:  # two readings in a row before changing
            self._pending = wanted
            return None
        self._pending = None
        self.threads = wanted
        self.changes += 1
        self._set(wanted)
        return wanted


def _niceness() -> int:
    try:
        return os.nice(0)
    except OSError:
        return 0
