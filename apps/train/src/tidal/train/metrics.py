"""Run metrics: one JSON record per rollout in ``metrics.jsonl``, and the one-line summary per rollout."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class MetricsLog:
    """``metrics.jsonl``, plus optionally TensorBoard events and an offline W&B run in the run folder.

    One JSON object per line, flushed, so a killed run keeps every finished record.
    """

    def __init__(self, path: Path, *, tensorboard: bool = False, wandb: dict[str, Any] | None = None) -> None:
        """Append to ``path``; ``wandb`` holds ``wandb.init`` arguments (None: no W&B)."""
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._tb = None
        self._wandb = None
        if tensorboard:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(str(path.parent / "tensorboard"))
        if wandb is not None:
            import wandb as wandb_lib

            self._wandb = wandb_lib.init(**wandb)

    def read(self) -> list[dict[str, Any]]:
        """Every record written so far (a resumed run's history)."""
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text(encoding="utf-8").splitlines() if line.strip()]

    def truncate(self, start_rollout: int) -> int:
        """Drop records of rollouts ``>= start_rollout`` (a resumed run redoes them); returns how many."""
        records = self.read()
        kept = [r for r in records if r.get("rollout", -1) < start_rollout]
        if len(kept) != len(records):
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in kept), encoding="utf-8")
            tmp.replace(self.path)
        return len(records) - len(kept)

    def write(self, record: dict[str, Any]) -> None:
        """Append ``record`` (and log its numbers to TensorBoard / W&B, stepped by rollout)."""
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(record, sort_keys=True) + "\n")
        step = int(record.get("rollout", 0))
        scalars = {k: float(v) for k, v in record.items() if isinstance(v, int | float) and k != "rollout"}
        if self._tb is not None:
            for key, value in scalars.items():
                self._tb.add_scalar(key, value, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)

    def close(self) -> None:
        """Flush and close the TensorBoard writer and the W&B run."""
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def rollout_line(record: dict[str, Any], num_rollout: int) -> str:
    """``rollout 3/10 | reward 0.42 | loss -0.013 | acc 0.51 | 12.3 s (gen 4.1, train 6.0, sync 0.4)``."""
    parts = [
        f"rollout {record['rollout'] + 1}/{num_rollout}",
        f"reward {record['rollout/reward/mean']:.3f}",
        f"loss {record.get('train/loss', float('nan')):.4f}",
    ]
    if "eval/accuracy" in record:
        parts.append(f"held-out acc {record['eval/accuracy']:.3f}")
    phases = {
        "gen": record.get("time/generate", 0.0),
        "logp": record.get("time/log_probs", 0.0),
        "train": record.get("time/train", 0.0),
        "sync": record.get("time/weight_sync", 0.0),
    }
    detail = ", ".join(f"{k} {v:.1f}" for k, v in phases.items())
    parts.append(f"{sum(phases.values()):.1f} s ({detail})")
    return " | ".join(parts)
