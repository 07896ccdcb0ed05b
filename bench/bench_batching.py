"""Benchmark tidal-batching: packing efficiency on RL-shaped length mixes, and planning speed.

Run: uv run python bench/bench_batching.py [--write-results]
With --write-results the "## Batching" section of bench/RESULTS.md is replaced (other sections are kept).
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np
import torch
from tidal.batching import pack_micro_batches, plan_micro_batches, plan_stats

torch.set_num_threads(1)

DP = 8
GLOBAL_BATCH = 4096
MAX_TOKENS = 16384
ALIGN = 128
SPEED_N = 100_032  # 100k rounded up to a multiple of 64 ranks (1563 samples per rank)
SPEED_DP = 64


def lognormal_mix(rng: np.random.Generator, n: int) -> np.ndarray:
    response = np.clip(rng.lognormal(np.log(700), 1.1, n), 10, 8192).astype(np.int64)
    return response + rng.integers(50, 501, n)


def bimodal_mix(rng: np.random.Generator, n: int) -> np.ndarray:
    # Most answers short; a quarter run to (or near) the response limit, as with truncated reasoning.
    long = rng.random(n) < 0.25
    short = np.clip(rng.normal(250, 120, n), 10, None)
    capped = np.clip(rng.normal(7600, 600, n), 10, 8192)
    return np.where(long, capped, short).astype(np.int64) + rng.integers(50, 501, n)


def padded_efficiency(lengths: np.ndarray, groups: list[np.ndarray]) -> float:
    """Real tokens / computed tokens when each group is padded to its longest sequence."""
    computed = sum(int(lengths[g].max()) * g.size for g in groups)
    return float(lengths.sum() / computed)


def fixed_groups(n: int, dp: int, mbs: int) -> list[np.ndarray]:
    """A conventional padded trainer: rank r takes samples r::dp in arrival order, mbs per micro-batch."""
    groups = []
    for r in range(dp):
        share = np.arange(r, n, dp)
        groups.extend(share[i : i + mbs] for i in range(0, share.size, mbs))
    return groups


def efficiency_rows(rng: np.random.Generator) -> list[dict]:
    rows = []
    mixes = (("log-normal 10-8k + prompt 50-500", lognormal_mix), ("bimodal (75% short, 25% ~8k)", bimodal_mix))
    for name, mix in mixes:
        lengths = mix(rng, GLOBAL_BATCH)
        plan = plan_micro_batches(lengths, dp_size=DP, max_tokens_per_gpu=MAX_TOKENS, pad_to_multiple_of=ALIGN)
        stats = plan_stats(plan, pad_to_multiple_of=ALIGN)
        plan_groups = [mb for r in range(DP) for mb in plan.micro_batches(r)]
        rows.append(
            {
                "mix": name,
                "mean_len": float(lengths.mean()),
                "packed": stats["batching/efficiency"],
                "num_mb": plan.num_micro_batches,
                "fill": stats["batching/budget_fill"],
                "imbalance": stats["batching/rank_imbalance"],
                "pad_plan": padded_efficiency(lengths, plan_groups),
                "pad_mbs4": padded_efficiency(lengths, fixed_groups(lengths.size, DP, 4)),
                "pad_mbs8": padded_efficiency(lengths, fixed_groups(lengths.size, DP, 8)),
            }
        )
    return rows


def timed(fn, repeats: int = 7) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def speed_rows(rng: np.random.Generator) -> list[tuple[str, float]]:
    lengths = lognormal_mix(rng, SPEED_N)
    bimodal = bimodal_mix(rng, SPEED_N)
    rows = [
        (
            f"plan, dynamic {MAX_TOKENS} tok, log-normal",
            timed(lambda: plan_micro_batches(lengths, dp_size=SPEED_DP, max_tokens_per_gpu=MAX_TOKENS)),
        ),
        (
            f"plan, dynamic {MAX_TOKENS} tok, bimodal",
            timed(lambda: plan_micro_batches(bimodal, dp_size=SPEED_DP, max_tokens_per_gpu=MAX_TOKENS)),
        ),
        (
            "plan, dynamic 8704 tok (bin-packing path), log-normal",
            timed(lambda: plan_micro_batches(lengths, dp_size=SPEED_DP, max_tokens_per_gpu=8704), repeats=3),
        ),
        (
            "plan, fixed micro-batch 8, log-normal",
            timed(lambda: plan_micro_batches(lengths, dp_size=SPEED_DP, micro_batch_size=8)),
        ),
    ]
    plan = plan_micro_batches(lengths, dp_size=SPEED_DP, max_tokens_per_gpu=MAX_TOKENS)
    seqs = [np.zeros(int(k), dtype=np.int64) for k in lengths]
    rows.append(
        (
            f"pack one rank's {plan.num_micro_batches} micro-batches (tensors, {plan.sample_indices.shape[1]} seqs)",
            timed(lambda: pack_micro_batches(plan, 0, seqs, pad_to_multiple_of=ALIGN), repeats=3),
        )
    )
    return rows


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} ({os.cpu_count()} cores visible)"
    except OSError:
        pass
    return platform.processor() or "an unknown CPU"


def render(eff: list[dict], speed: list[tuple[str, float]]) -> str:
    lines = [
        f"Efficiency: one global batch of {GLOBAL_BATCH} samples on {DP} DP ranks, --max-tokens-per-gpu {MAX_TOKENS}, "
        f"packed micro-batches aligned to {ALIGN} tokens. Padded baselines pad each micro-batch to its longest "
        "sequence.",
        "",
        "| length mix | mean len | packed (tidal) | micro-batches/rank | budget fill | rank imbalance "
        "| same plan, padded | padded, mbs 4 | padded, mbs 8 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in eff:
        lines.append(
            f"| {r['mix']} | {r['mean_len']:.0f} | **{r['packed']:.2%}** | {r['num_mb']} | {r['fill']:.1%} "
            f"| {r['imbalance']:.4%} | {r['pad_plan']:.1%} | {r['pad_mbs4']:.1%} | {r['pad_mbs8']:.1%} |"
        )
    lines += [
        "",
        f"Speed: {SPEED_N} sequences on {SPEED_DP} DP ranks, one thread, median wall clock of repeats, on {_cpu()}.",
        "",
        "| operation | ms |",
        "|---|---|",
    ]
    lines += [f"| {name} | {ms:.1f} |" for name, ms in speed]
    return "\n".join(lines)


def write_results(table: str) -> Path:
    path = Path(__file__).with_name("RESULTS.md")
    text = path.read_text() if path.exists() else "# Benchmark results\n"
    section = f"## Batching\n\nCommand: `uv run python bench/bench_batching.py --write-results`\n\n{table}\n"
    pattern = re.compile(r"^## Batching\n.*?(?=^## |\Z)", re.S | re.M)
    if pattern.search(text):
        text = pattern.sub(lambda _: section + "\n", text, count=1).rstrip("\n") + "\n"
    else:
        text = text.rstrip("\n") + "\n\n" + section
    path.write_text(text)
    return path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--write-results", action="store_true", help="replace the Batching section of RESULTS.md")
    args = parser.parse_args()
    rng = np.random.default_rng(2026)
    table = render(efficiency_rows(rng), speed_rows(rng))
    print(table)
    if args.write_results:
        print(f"\nwrote {write_results(table)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
