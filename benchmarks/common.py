"""What the benchmarks in this folder share: the machine line, a meter of other processes' CPU
use, and prompts cut from one natural text (Python's LICENSE.txt, so they never change)."""
from __future__ import annotations

import os
import resource
import sysconfig
import time
from pathlib import Path

THREADS = 2


def machine() -> str:
    def first(path: str, key: str) -> str:
        lines = Path(path).read_text().splitlines()
        return next(line.split(":", 1)[1].strip() for line in lines if line.startswith(key))

    mem_gib = int(first("/proc/meminfo", "MemTotal").split()[0]) / 2**20
    flags = first("/proc/cpuinfo", "flags").split()
    isa = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
    return (f"{first('/proc/cpuinfo', 'model name')} ({os.cpu_count()} cores, {isa}), "
            f"{mem_gib:.0f} GiB RAM")


def _busy_s() -> float:
    fields = [int(x) for x in Path("/proc/stat").read_text().split()[1:9]]
    return sum(fields[i] for i in (0, 1, 2, 5, 6, 7)) / os.sysconf("SC_CLK_TCK")


class ForeignLoad:
    """Cores used by processes other than this one and its reaped children, averaged over the
    time since construction. Children still running (servers) must be passed to `share`."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.busy = _busy_s() - _own_s()

    def share(self, own_pids: tuple[int, ...] = ()) -> float:
        own = _own_s() + sum(_pid_cpu_s(pid) for pid in own_pids)
        return (_busy_s() - own - self.busy) / (time.perf_counter() - self.start)


def _own_s() -> float:
    usage = [resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    return sum(r.ru_utime + r.ru_stime for r in usage)


def _pid_cpu_s(pid: int) -> float:
    """CPU seconds of a live process and its reaped children (0 if it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return sum(int(fields[i]) for i in (11, 12, 13, 14)) / os.sysconf("SC_CLK_TCK")


def license_token_ids() -> list[int]:
    """BOS followed by the whole of Python's LICENSE.txt, whitespace collapsed, in the default
    model's tokenizer."""
    from lifeline.model.default import default_model_path
    from lifeline.tokenizer import load_tokenizer

    text = (Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt").read_text()
    return load_tokenizer(default_model_path()).encode(" ".join(text.split()))


def distinct_prompts(ids: list[int], lengths: list[int], first: int = 0) -> list[list[int]]:
    """BOS + consecutive slices 53 tokens apart, so no two prompts share a first KV block."""
    bos, body = ids[:1], ids[1:]
    return [bos + body[11 + 53 * (first + k): 10 + 53 * (first + k) + n]
            for k, n in enumerate(lengths)]
