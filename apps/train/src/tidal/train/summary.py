"""What a finished run reports: the ``RunResult`` the loop returns and the ``summary.json`` it writes."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

STEP_FLOOR_FILE = Path.home() / ".cache" / "tidal" / "step_floor.json"
"""Where ``bench/step_floor.py`` writes the floor of a rollout and ``summary.json`` reads it."""


@dataclass(slots=True)
class RunResult:
    """What a finished run reports."""

    output_dir: Path
    checkpoint_dir: Path
    weights_dir: Path | None
    history: list[dict[str, float]] = field(default_factory=list)
    eval_before: float | None = None
    eval_after: float | None = None
    engine_pids: list[int] = field(default_factory=list)
    start_rollout_id: int = 0
    wall_s: float = 0.0
    job_key: dict[str, Any] = field(default_factory=dict)
    """The run's shape as :func:`floor_key` gives it (matched against the measured floor's)."""
    wandb: dict[str, Any] | None = None
    """Where the W&B run is (``tidal.train.wandb_run.start_wandb``); None without --use-wandb."""


def overhead_share(record: dict[str, Any]) -> float:
    """Share of the rollout's wall time spent outside the engines' generation and the actor's compute."""
    compute = sum(record.get(k, 0.0) for k in ("time/generate_engine", "time/log_probs", "time/train"))
    total = record["time/rollout"]
    return max(0.0, total - compute) / total if total > 0 else 0.0


def write_summary(result: RunResult) -> None:
    """``summary.json`` in the run folder: accuracy before and after, time per phase, where the outputs are."""
    rows = [r for r in result.history if r["rollout"] >= result.start_rollout_id]
    phases = ("time/generate", "time/log_probs", "time/train", "time/weight_sync", "time/rollout")

    def mean(key: str) -> float:
        return sum(r.get(key, 0.0) for r in rows) / max(len(rows), 1)

    rewards = [r["rollout/reward/mean"] for r in result.history]
    summary = {
        "eval_before": result.eval_before,
        "eval_after": result.eval_after,
        "reward_first": rewards[0] if rewards else None,
        "reward_last": rewards[-1] if rewards else None,
        "num_rollouts": len(rows),
        "rl_wall_s": round(result.wall_s, 1),
        "mean_time_per_rollout_s": {p.split("/")[1]: round(mean(p), 3) for p in phases},
        "overhead_share": round(mean("time/overhead_share"), 3),
        **_vs_floor(result.job_key, {p.split("/")[1]: mean(p) for p in phases}),
        "metrics": str(result.output_dir / "metrics.jsonl"),
        "curves": str(result.output_dir / "curves.png"),
        "checkpoint_dir": str(result.checkpoint_dir),
        "weights_dir": None if result.weights_dir is None else str(result.weights_dir),
        "engine_pids": result.engine_pids,
        "wandb": result.wandb,
    }
    (result.output_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")


def floor_key(job) -> dict[str, Any]:
    """What a floor measurement must share with a run to be its floor: model, rollout shape, machine."""
    return {
        "model": Path(job.actor.hf_checkpoint).name,
        "rollout_batch_size": job.batching.rollout_batch_size,
        "n_samples_per_prompt": job.rollout.n_samples_per_prompt,
        "rollout_max_response_len": job.rollout.rollout_max_response_len,
        "cpu": os.cpu_count(),
    }


def _vs_floor(key: dict[str, Any], means: dict[str, float]) -> dict[str, Any]:
    """The floor ``bench/step_floor.py`` measured for this shape and each phase's mean over it ({} when none)."""
    try:
        floor = json.loads(STEP_FLOOR_FILE.read_text())
    except (OSError, ValueError):
        return {}
    if not key or floor.get("key") != key:
        return {}
    generate, train = floor["generate_one_request_s"], floor["train_step_s"]
    parts = {"generate": generate, "log_probs": floor["forward_s"], "train": train, "rollout": generate + train}
    return {
        "floor_s": {name: round(s, 3) for name, s in parts.items()} | {"measured_at": floor.get("measured_at")},
        "vs_floor": {name: round(means[name] / s, 2) for name, s in parts.items() if s > 0},
    }
