"""Where an engine's start goes, phase by phase, and the compiles that happen after it.

Phases, in the order they run (`Startup.seconds`; `/metrics` has them as
`lifeline:startup_seconds{phase}`, `benchmarks/startup.py` prints them):

- `read_weights`: the checkpoint read and dequantized (`load_model`);
- `native_ops`: Lifeline's C++ operators built, or the cached build found and loaded
  (lifeline/model/native.py);
- `weight_format`: the loaded weights turned into the format the engine runs (int8 packing,
  rotations, fused projections);
- `kv_pools`: the KV cache's pools mapped;
- `compile_warmup`: the warm-up steps, which compile the forward where it runs compiled.

The server adds `other` (the rest: Python's and PyTorch's imports, the app, the chat template)
and `ready`, the whole: from the process's start where `lifeline serve` marked it
(`mark_process_start`), else from the server's build (a server inside a process that runs other
things, as the tests'), to `/ready`.

`compiles()` counts Dynamo's compiles in this process (every frame compiled, recompiles
included), from the first call on; a server records the count at `/ready`, and
`lifeline:compiles_after_ready_total` is what it has grown by since.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

PHASES = ("read_weights", "native_ops", "weight_format", "kv_pools", "compile_warmup")


@dataclass(slots=True)
class Startup:
    seconds: dict[str, float] = field(default_factory=dict)
    """Phase -> seconds (a phase timed twice adds up)."""

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def merge(self, other: Startup | dict[str, float] | None) -> None:
        items = other.seconds if isinstance(other, Startup) else other or {}
        for name, seconds in items.items():
            self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    def ordered(self) -> dict[str, float]:
        known = [p for p in PHASES if p in self.seconds]
        return {p: self.seconds[p] for p in known + sorted(set(self.seconds) - set(known))}


_lock = threading.Lock()
_compiles = 0
_counting = False


def _count(_args: object) -> None:
    note_compile()


def count_compiles() -> None:
    """Start counting Dynamo's compiles in this process (idempotent)."""
    global _counting
    with _lock:
        if _counting:
            return
        _counting = True
    from torch._dynamo.callback import on_compile_start

    on_compile_start(_count)


def note_compile() -> None:
    """Count a compile Dynamo's callback does not report (an ahead-of-time compile,
    lifeline.model.compiled)."""
    global _compiles
    with _lock:
        _compiles += 1


def compiles() -> int:
    """Dynamo compiles in this process since `count_compiles` was first called. Where Dynamo
    was never imported nothing has compiled, and it is not imported here (seconds of a start):
    whatever compiles or loads graphs calls `count_compiles` first (lifeline.model.compiled)."""
    if "torch._dynamo" in sys.modules:
        count_compiles()
    with _lock:
        return _compiles


def process_started() -> float | None:
    """This process's start on the `time.time()` clock (Linux's /proc), None elsewhere."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rpartition(")")[2].split()
        ticks = int(fields[19])  # starttime: field 22 of the whole line, 20 after the name
        with open("/proc/uptime") as f:  # not /proc/stat's btime: whole seconds, up to 1 s off
            uptime = float(f.read().split()[0])
        return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


_process_start: float | None = None


def mark_process_start() -> None:
    """Count a server's start in this process from the process's own start (`lifeline serve`)."""
    global _process_start
    _process_start = process_started()


def marked_process_start() -> float | None:
    return _process_start
