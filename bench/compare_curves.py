"""Held-out accuracy and mean reward of several runs on one figure, from each run folder's metrics.jsonl.

    uv run python bench/compare_curves.py --out curve.png "full fine-tuning=/tmp/full-run" "LoRA r16=/tmp/lora-run"

Each ``LABEL=RUN_DIR`` reads ``RUN_DIR/metrics.jsonl`` (and ``summary.json`` for the accuracy before RL, if there).
Prints one line per run: the held-out accuracy before, at its best and at the end.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def load(run: Path) -> tuple[list[dict], float | None]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    summary = run / "summary.json"
    before = json.loads(summary.read_text()).get("eval_before") if summary.is_file() else None
    return rows, before


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("runs", nargs="+", help="LABEL=RUN_DIR")
    args = p.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (acc, rew) = plt.subplots(1, 2, figsize=(11, 4))
    for spec in args.runs:
        label, run = spec.split("=", 1)
        rows, before = load(Path(run))
        points = [(r["rollout"] + 1, r["eval/accuracy"]) for r in rows if "eval/accuracy" in r]
        if before is not None:
            points.insert(0, (0, before))
        acc.plot(*zip(*points, strict=True), marker="o", label=label)
        rew.plot([r["rollout"] + 1 for r in rows], [r["rollout/reward/mean"] for r in rows], label=label, alpha=0.8)
        best = max(a for _, a in points)
        print(f"{label}: held-out {points[0][1]:.3f} before, best {best:.3f}, end {points[-1][1]:.3f}")
    acc.set(xlabel="rollout", ylabel="held-out accuracy", title="held-out accuracy")
    rew.set(xlabel="rollout", ylabel="mean reward", title="rollout reward")
    for ax in (acc, rew):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(args.out, dpi=100)


if __name__ == "__main__":
    main()
