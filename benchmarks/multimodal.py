"""What an image costs a request on this CPU: TTFT of a text prompt against the same prompt
with one image, split into the image's stages (preprocess, vision encoder, projector) and the
language model's prefill, for the vision-language presets with dummy weights; and the second
turn, where the encoder cache (and the prefix cache) hold the image.

    .venv/bin/python benchmarks/multimodal.py [--quick] [--json out.json] [--svg docs/img/multimodal_ttft.svg]

- `smolvlm-256m` (SigLIP-512 + pixel shuffle ×4 + SmolLM2-135M; the published config),
  the engine's default weights (`int8-all` for the decoder; the tower runs in float32), at
  two image shapes: SmolVLM's processor scales the longest edge to 2,048 px and tiles it
  into 512-px tiles plus the whole image, 64 tokens each (a square image: 17 frames, 1,088
  tokens; a 2:1 one: 9 frames, 576 tokens).
- `gemma-3-4b`'s tower alone (SigLIP-so400m at 896 px, pooled to 256 tokens): one frame
  encoded (its 4B decoder in float32 does not fit here). `--quick` skips it.

Each configuration runs `--repeats` times after a warm-up; the table shows medians. The
machine's speed drifts: compare the ratios within one run.
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lifeline import LLM, SamplingParams  # noqa: E402
from lifeline.media.images import DecodedImage, pixel_hash  # noqa: E402
from lifeline.media.inputs import encode_placeholder, splice_ids  # noqa: E402
from lifeline.media.prepare import ImagePreparer  # noqa: E402
from lifeline.model.loader import build_vision, load_preset  # noqa: E402
from lifeline.model.presets import preset_config  # noqa: E402

TEXT_TOKENS = 64


def picture(width: int, height: int, seed: int) -> DecodedImage:
    rng = np.random.default_rng(seed)
    im = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB")
    return DecodedImage(im, pixel_hash(im), "PNG", 0, "RGB")


def smolvlm_specials(spec) -> dict[str, int]:
    """Token ids for the placeholder's specials (dummy weights: any distinct ids do)."""
    names = ["<fake_token_around_image>", "<global-img>",
             *[f"<row_{r + 1}_col_{c + 1}>" for r in range(6) for c in range(6)]]
    return {"<image>": spec.image_token_id, **{n: 49152 + i for i, n in enumerate(names)}}


def run_case(llm: LLM, preparer: ImagePreparer, image: DecodedImage | None, text_seed: int,
             specials: dict[str, int]) -> dict[str, float]:
    """One request of TEXT_TOKENS text tokens (+ the image), one output token: its stages."""
    rng = np.random.default_rng(text_seed)
    ids = [int(t) for t in rng.integers(100, 40000, TEXT_TOKENS)]
    spans, preprocess = [], 0.0
    if image is not None:
        prepared = preparer.prepare(image)
        preprocess = prepared.timings["preprocess_s"]
        ids = splice_ids([*ids[:8], specials["<image>"], *ids[8:]], specials["<image>"],
                         [encode_placeholder(prepared.placeholder, specials,
                                             lambda s: [198] * s.count("\n"))])
        spans = preparer.spans(ids, [prepared])
    t0 = time.perf_counter()
    out = llm.generate({"prompt_token_ids": ids, "images": spans},
                       SamplingParams(max_tokens=1, temperature=0), use_progress=False)[0]
    wall = time.perf_counter() - t0
    timing = spans[0].timings if spans else {}
    encode = timing.get("encode_s", 0.0)
    project = timing.get("project_s", 0.0)
    tl = out.timeline
    engine_ttft = tl.first_token - tl.arrival
    return {"prompt_tokens": len(ids), "cached_tokens": out.num_cached_tokens,
            "preprocess_ms": preprocess * 1e3, "encode_ms": encode * 1e3,
            "project_ms": project * 1e3,
            "prefill_ms": (tl.first_token - tl.first_scheduled - encode - project) * 1e3,
            "rest_ms": (engine_ttft - (tl.first_token - tl.first_scheduled)) * 1e3,
            "ttft_ms": (engine_ttft + preprocess) * 1e3, "wall_ms": wall * 1e3,
            "encoder_cache_hit": float(bool(timing.get("encoder_cache_hit")))}


def median_case(rows: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]}


def svg_bars(results: list[dict], path: Path) -> None:
    """Stacked horizontal bars of each case's TTFT by stage."""
    colours = {"preprocess_ms": "#8e6c8a", "encode_ms": "#d1495b", "project_ms": "#edae49",
               "prefill_ms": "#00798c", "rest_ms": "#9e9e9e"}
    width, left, bar, gap = 760, 260, 22, 12
    top = 40
    biggest = max(r["ttft_ms"] for r in results) or 1.0
    scale = (width - left - 30) / biggest
    rows = []
    for i, r in enumerate(results):
        y = top + i * (bar + gap)
        rows.append(f'<text x="{left - 8}" y="{y + 15}" text-anchor="end" font-size="12">'
                    f'{r["label"]}</text>')
        x = left
        for key, colour in colours.items():
            w = max(r[key], 0.0) * scale
            if w > 0:
                rows.append(f'<rect x="{x:.1f}" y="{y}" width="{w:.1f}" height="{bar}" '
                            f'fill="{colour}"><title>{key[:-3]} {r[key]:,.0f} ms</title></rect>')
            x += w
        rows.append(f'<text x="{x + 4:.1f}" y="{y + 15}" font-size="11">'
                    f'{r["ttft_ms"]:,.0f} ms</text>')
    legend_y = top + len(results) * (bar + gap) + 10
    legend = "".join(
        f'<rect x="{left + i * 110}" y="{legend_y}" width="12" height="12" fill="{c}"/>'
        f'<text x="{left + i * 110 + 16}" y="{legend_y + 11}" font-size="11">{k[:-3]}</text>'
        for i, (k, c) in enumerate(colours.items()))
    height = legend_y + 30
    path.write_text(
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'font-family="sans-serif"><text x="10" y="20" font-size="14">TTFT by stage, '
        f'one image vs text only (this CPU)</text>{"".join(rows)}{legend}</svg>\n')


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="one repeat, no Gemma 3 tower")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    ap.add_argument("--svg", default=None)
    args = ap.parse_args()
    repeats = 1 if args.quick else args.repeats
    console = Console(width=160)
    torch.manual_seed(0)
    loaded = load_preset("smolvlm-256m")
    llm = LLM(loaded, weights="int8-all", max_num_batched_tokens=2048,
              enable_prefix_caching=True)
    spec = loaded.config.vision
    preparer = ImagePreparer(spec)
    specials = smolvlm_specials(spec)
    cases = [("smolvlm-256m, text only", None),
             ("smolvlm-256m, 512×512 image", (512, 512)),
             ("smolvlm-256m, 1024×512 image", (1024, 512))]
    results = []
    seed = 0
    with Progress(console=console) as progress:
        task = progress.add_task("requests", total=(len(cases) + 1) * (repeats + 1))
        for label, size in cases:
            rows = []
            for r in range(repeats + 1):  # the first is a warm-up
                seed += 1
                image = picture(*size, seed) if size else None  # a new image: no cache hit
                row = run_case(llm, preparer, image, seed, specials)
                if r:
                    rows.append(row)
                progress.advance(task)
            results.append({"label": label, **median_case(rows)})
        # the second turn: the same image after other text (the encoder cache holds it)
        rows = []
        for r in range(repeats + 1):
            seed += 1
            image = picture(512, 512, 1000 + r)
            run_case(llm, preparer, image, seed, specials)
            row = run_case(llm, preparer, image, seed + 5000, specials)
            if r:
                rows.append(row)
            progress.advance(task)
        results.append({"label": "smolvlm-256m, same 512×512 image again", **median_case(rows)})
    gemma = None
    if not args.quick:
        cfg = preset_config("gemma-3-4b")
        tower = build_vision(cfg).eval()
        frame = torch.from_numpy(ImagePreparer(cfg.vision).prepare(
            picture(1200, 900, 7)).processed.pixel_values)
        tower.encode_stages(frame)  # warm-up
        _, enc, proj = tower.encode_stages(frame)
        gemma = {"label": "gemma-3-4b tower, one 896-px frame", "frames": frame.shape[0],
                 "tokens": 256, "encode_ms": enc * 1e3, "project_ms": proj * 1e3,
                 "params": tower.vision_model.config.params()}
    table = Table("case", "prompt tokens", "preprocess ms", "encoder ms", "projector ms",
                  "prefill ms", "rest ms", "TTFT ms", "× text only",
                  title=f"an image's part of TTFT ({machine()})")
    base = results[0]["ttft_ms"]
    for r in results:
        table.add_row(r["label"], f"{r['prompt_tokens']:,.0f}", f"{r['preprocess_ms']:,.1f}",
                      f"{r['encode_ms']:,.1f}", f"{r['project_ms']:,.1f}",
                      f"{r['prefill_ms']:,.1f}", f"{r['rest_ms']:,.1f}", f"{r['ttft_ms']:,.1f}",
                      f"{r['ttft_ms'] / base:.2f}×")
    console.print(table)
    if gemma:
        console.print(f"{gemma['label']}: encoder {gemma['encode_ms']:,.0f} ms, projector "
                      f"{gemma['project_ms']:,.1f} ms ({gemma['params'] / 1e6:,.0f}M "
                      "parameters, float32)")
    out = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
           "machine": machine(), "results": results, "gemma3_tower": gemma}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    if args.svg:
        svg_bars(results, Path(args.svg))


if __name__ == "__main__":
    main()
