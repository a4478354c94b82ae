"""Lifeline against Hugging Face transformers on the same Gemma 3 270M weights, in one run.

Each engine runs in its own process, one after the other, so peak RSS is per engine:

    .venv/bin/python benchmarks/engine_vs_transformers.py --json results.json [--quick]

transformers serves 16 users the way it can: one left-padded batch of 16 prompts.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import sys
import sysconfig
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from multiprocessing import get_context
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
THREADS = 2
USERS = 16
SHORT = 128
LONG = 1024


@dataclass(slots=True)
class Prompts:
    """Token ids (BOS first) cut from one natural text at distinct offsets, so no two prompts
    share a first KV block and the prefix cache never helps a timed run."""
    warm_single: list[int]
    single: list[int]
    warm_batch: list[list[int]]
    batch: list[list[int]]
    warm_long: list[int]
    long: list[int]


def make_prompts() -> Prompts:
    from lifeline.model.default import default_model_path
    from lifeline.tokenizer import load_tokenizer

    text = (Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt").read_text()
    ids = load_tokenizer(default_model_path()).encode(" ".join(text.split()))
    bos, body = ids[:1], ids[1:]

    def cut(k: int, n: int) -> list[int]:
        return bos + body[11 + 53 * k: 10 + 53 * k + n]

    lengths = [SHORT - USERS // 2 + i for i in range(USERS)]  # 120..135, mean ~128
    return Prompts(cut(0, SHORT), cut(1, SHORT),
                   [cut(2 + i, n) for i, n in enumerate(lengths)],
                   [cut(2 + USERS + i, n) for i, n in enumerate(lengths)],
                   bos + body[:LONG - 1], bos + body[1500:1500 + LONG - 1])


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def decode_rate(times: list[float]) -> float:
    return (len(times) - 1) / (times[-1] - times[0])


# ---- Lifeline ---------------------------------------------------------------------------

def run_lifeline(prompts: Prompts, n_out: int) -> dict[str, Any]:
    import torch

    from lifeline import LLM, SamplingParams

    torch.set_num_threads(THREADS)
    llm = LLM()
    sp = SamplingParams(max_tokens=n_out, temperature=0, ignore_eos=True)
    res = lifeline_single(llm, prompts, sp)
    res.update(lifeline_batch(llm, prompts, sp))
    res["prefill_tok_s_default_budget"] = lifeline_prefill(llm, prompts)
    loaded = llm.loaded
    del llm
    res["prefill_tok_s"] = lifeline_prefill(LLM(loaded, max_num_batched_tokens=2 * LONG), prompts)
    res["peak_rss_mib"] = peak_rss_mib()
    return res


def _generate(llm: Any, prompts: list[list[int]], sp: Any) -> list[Any]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_progress=False)
    if any(o.num_cached_tokens for o in outs):
        raise RuntimeError("a timed prompt hit the prefix cache")
    return outs


def lifeline_single(llm: Any, prompts: Prompts, sp: Any) -> dict[str, Any]:
    _generate(llm, [prompts.warm_single], sp)
    out = _generate(llm, [prompts.single], sp)[0]
    tl = out.timeline
    return {"decode_tok_s": decode_rate(tl.token_times), "ttft_s": tl.first_token - tl.arrival,
            "single_tokens": out.token_ids}


def lifeline_batch(llm: Any, prompts: Prompts, sp: Any) -> dict[str, Any]:
    _generate(llm, prompts.warm_batch, sp)
    start = time.perf_counter()
    outs = _generate(llm, prompts.batch, sp)
    wall = time.perf_counter() - start
    return {"batch_tok_s": sum(len(o.token_ids) for o in outs) / wall, "batch_wall_s": wall}


def lifeline_prefill(llm: Any, prompts: Prompts) -> float:
    from lifeline import SamplingParams

    sp = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    _generate(llm, [prompts.warm_long], sp)
    tl = _generate(llm, [prompts.long], sp)[0].timeline
    return len(prompts.long) / (tl.first_token - tl.arrival)


# ---- transformers -----------------------------------------------------------------------

class TokenClock:
    """A generate() streamer that stamps every put: the prompt's, then each new token's."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.puts: list[float] = []

    def put(self, value: Any) -> None:
        self.puts.append(time.perf_counter())

    def end(self) -> None:
        pass


def run_transformers(prompts: Prompts, n_out: int) -> dict[str, Any]:
    import torch

    sys.path.insert(0, str(ROOT))
    from lifeline.model.default import default_model_path
    from tests.reference.gemma3_hf import build_reference_gemma3

    torch.set_num_threads(THREADS)
    model, _ = build_reference_gemma3(default_model_path())
    model.set_attn_implementation("sdpa")  # transformers' default; the reference builds eager
    with torch.inference_mode():
        res = hf_single(model, prompts, n_out)
        res.update(hf_batch(model, prompts, n_out))
        res["prefill_tok_s"] = hf_prefill(model, prompts)
    res["prefill_tok_s_default_budget"] = res["prefill_tok_s"]
    res["peak_rss_mib"] = peak_rss_mib()
    return res


def hf_generate(model: Any, batch: list[list[int]], n_out: int, streamer: Any = None) -> Any:
    import torch

    width = max(len(p) for p in batch)
    pad = model.config.pad_token_id
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
    return model.generate(input_ids=ids, attention_mask=mask, do_sample=False, pad_token_id=pad,
                          max_new_tokens=n_out, min_new_tokens=n_out, streamer=streamer)


def hf_single(model: Any, prompts: Prompts, n_out: int) -> dict[str, Any]:
    hf_generate(model, [prompts.warm_single], n_out)
    clock = TokenClock()
    out = hf_generate(model, [prompts.single], n_out, clock)
    return {"decode_tok_s": decode_rate(clock.puts[1:]), "ttft_s": clock.puts[1] - clock.start,
            "single_tokens": out[0, len(prompts.single):].tolist()}


def hf_batch(model: Any, prompts: Prompts, n_out: int) -> dict[str, Any]:
    hf_generate(model, prompts.warm_batch, n_out)
    start = time.perf_counter()
    out = hf_generate(model, prompts.batch, n_out)
    wall = time.perf_counter() - start
    n_new = out.shape[0] * (out.shape[1] - max(len(p) for p in prompts.batch))
    return {"batch_tok_s": n_new / wall, "batch_wall_s": wall}


def hf_prefill(model: Any, prompts: Prompts) -> float:
    hf_generate(model, [prompts.warm_long], 1)
    clock = TokenClock()
    hf_generate(model, [prompts.long], 1, clock)
    return len(prompts.long) / (clock.puts[1] - clock.start)


# ---- report -----------------------------------------------------------------------------

ROWS = [  # key, label, format
    ("decode_tok_s", "decode tok/s, 1 request ({short}-token prompt)", "{:.1f}"),
    ("ttft_s", "TTFT s, 1 request ({short}-token prompt)", "{:.3f}"),
    ("batch_tok_s", "total output tok/s, {users} concurrent requests", "{:.1f}"),
    ("prefill_tok_s", "prefill tok/s, {long}-token prompt (budget {budget})", "{:.0f}"),
    ("prefill_tok_s_default_budget", "prefill tok/s, {long}-token prompt (budget 512)", "{:.0f}"),
    ("peak_rss_mib", "peak RSS MiB", "{:.0f}"),
]


def in_own_process(fn: Any, *args: Any) -> dict[str, Any]:
    with ProcessPoolExecutor(1, mp_context=get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


def machine() -> str:
    def first(path: str, key: str) -> str:
        lines = Path(path).read_text().splitlines()
        return next(line.split(":", 1)[1].strip() for line in lines if line.startswith(key))

    mem_gib = int(first("/proc/meminfo", "MemTotal").split()[0]) / 2**20
    isa = "AVX-512" if "avx512f" in first("/proc/cpuinfo", "flags").split() else "no AVX-512"
    return (f"{first('/proc/cpuinfo', 'model name')} ({os.cpu_count()} cores, {isa}), "
            f"{THREADS} torch threads, {mem_gib:.0f} GiB RAM")


def foreign_cpu_s() -> float:
    """CPU seconds the whole machine has been busy, less this process and its children: other
    work competing for the 2 cores shows as a share of wall time well above 0."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split()[1:9]]
    busy = sum(fields[i] for i in (0, 1, 2, 5, 6, 7)) / os.sysconf("SC_CLK_TCK")
    own = [resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    return busy - sum(r.ru_utime + r.ru_stime for r in own)


def print_table(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"Gemma 3 270M fp32, {result['n_out']} output tokens, {THREADS} threads")
    for col in ("measure", "Lifeline", "transformers", "Lifeline / transformers"):
        table.add_column(col, justify="left" if col == "measure" else "right")
    names = {"short": SHORT, "users": USERS, "long": LONG, "budget": 2 * LONG}
    for key, label, fmt in ROWS:
        ll, hf = result["lifeline"][key], result["transformers"][key]
        table.add_row(label.format(**names), fmt.format(ll), fmt.format(hf), f"{ll / hf:.2f}")
    console = Console(width=120)
    console.print(table)
    console.print("ratio > 1: Lifeline faster (for TTFT and memory: Lifeline larger)")
    print(f"other processes used {result['foreign_cpu_share']:.2f} cores on average meanwhile")
    print(f"greedy tokens identical for the first {result['same_greedy_prefix']} of "
          f"{result['n_out']} (1-request run)")


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="32 output tokens instead of 64")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    n_out = 32 if args.quick else 64
    prompts = make_prompts()
    result: dict[str, Any] = {
        "date": datetime.date.today().isoformat(), "machine": machine(), "n_out": n_out,
        "command": " ".join([Path(sys.executable).name, *sys.argv]), "threads": THREADS,
        "prompt_tokens": {k: [len(p) for p in v] if isinstance(v[0], list) else len(v)
                          for k, v in asdict(prompts).items()}}
    busy, start = foreign_cpu_s(), time.perf_counter()
    for name, fn in (("lifeline", run_lifeline), ("transformers", run_transformers)):
        result[name] = in_own_process(fn, prompts, n_out)
    result["foreign_cpu_share"] = (foreign_cpu_s() - busy) / (time.perf_counter() - start)
    result["same_greedy_prefix"] = common_prefix(result["lifeline"]["single_tokens"],
                                                 result["transformers"]["single_tokens"])
    result["ratio"] = {k: result["lifeline"][k] / result["transformers"][k] for k, _, _ in ROWS}
    print_table(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
