"""Held-out accuracy against RL wall time, from the metrics.jsonl of `uv run train` runs (issue 22).

RL wall time at a record = the sum of every rollout's ``time/rollout`` and ``time/eval`` up to it (the loop's
own clock; start-up and the evaluation before RL excluded). Prints, per run, when held-out accuracy first reached
+25 points over its value before RL (taken from the run's summary.json beside metrics.jsonl) and draws every run
into one PNG.

    uv run python bench/rl_wall_curve.py --out bench/embedded_rl_wall_curve.png \
        "before (2026-12-02)=bench/embedded_rl_metrics.jsonl" "issue 22=/tmp/speed/final/metrics.jsonl"
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def curve(metrics: Path) -> list[tuple[float, float]]:
    """(RL wall seconds, held-out accuracy) at each evaluation."""
    wall, points = 0.0, []
    for line in metrics.read_text().splitlines():
        record = json.loads(line)
        wall += record.get("time/rollout", 0.0) + record.get("time/eval", 0.0)
        if "eval/accuracy" in record:
            points.append((wall, record["eval/accuracy"]))
    return points


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", help="LABEL=PATH/metrics.jsonl")
    parser.add_argument("--out", required=True)
    parser.add_argument("--gain", type=float, default=0.25)
    args = parser.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for run in args.runs:
        label, path = run.split("=", 1)
        metrics = Path(path)
        summary_file = metrics.with_name("summary.json")
        if not summary_file.exists():
            summary_file = metrics.with_name(metrics.name.replace("metrics.jsonl", "summary.json"))
        before = json.loads(summary_file.read_text())["eval_before"]
        points = [(0.0, before), *curve(metrics)]
        reached = next((t for t, acc in points if acc >= before + args.gain), None)
        print(
            f"{label}: before {before:.3f}, last {points[-1][1]:.3f} at {points[-1][0]:.0f} s; "
            f"+{args.gain * 100:.0f} points first at {'never' if reached is None else f'{reached:.0f} s'}"
        )
        ax.plot([t for t, _ in points], [a for _, a in points], marker="o", ms=3, label=label)
    ax.set_xlabel("RL wall time (s)")
    ax.set_ylabel("held-out accuracy (256 prompts, greedy)")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
