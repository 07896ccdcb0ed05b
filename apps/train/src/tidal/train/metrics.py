"""Run metrics: one JSON record per rollout in ``metrics.jsonl``, and the one-line summary per rollout."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class MetricsLog:
    """Appends one JSON object per line and flushes, so a killed run keeps every finished record."""

    def __init__(self, path: Path) -> None:
        """Open (append) ``path``."""
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, record: dict[str, Any]) -> None:
        """Append ``record``."""
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(record, sort_keys=True) + "\n")


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
