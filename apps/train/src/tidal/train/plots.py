"""The reward and held-out accuracy curves of a run, redrawn as a PNG after every rollout."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def write_curves(path: Path, history: list[dict[str, Any]], *, eval_before: float | None = None) -> Path:
    """Draw mean reward per rollout and held-out accuracy (before RL at x=0) into ``path``; returns it."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=120)
    rollouts = [r["rollout"] + 1 for r in history]
    ax.plot(rollouts, [r["rollout/reward/mean"] for r in history], marker=".", label="train reward (mean)")
    evals = [(0, eval_before)] if eval_before is not None else []
    evals += [(r["rollout"] + 1, r["eval/accuracy"]) for r in history if "eval/accuracy" in r]
    if evals:
        xs, ys = zip(*evals, strict=True)
        ax.plot(xs, ys, marker="o", label="held-out accuracy (greedy)")
    ax.set_xlabel("rollout")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize="small")
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp)
    plt.close(fig)
    tmp.replace(path)  # a viewer never sees a half-written file
    return path
