"""Run metrics: one JSON record per rollout in ``metrics.jsonl``, and the one-line summary per rollout."""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


class MetricsLog:
    """``metrics.jsonl``, plus optionally TensorBoard events and a W&B run (:mod:`tidal.train.wandb_run`).

    One JSON object per line, flushed and fsynced as it is written, so a killed run (or machine) keeps every
    finished record; a line torn by a kill in mid-write is dropped with a warning when the run resumes.
    """

    def __init__(self, path: Path, *, tensorboard: bool = False, wandb: dict[str, Any] | None = None) -> None:
        """Append to ``path``; ``wandb`` holds the W&B run's options (``wandb_options``; None: no W&B).

        Raises:
            WandbStartError: W&B could not start the run.
        """
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._tb = None
        self._wandb = None
        self.wandb_run: dict[str, Any] | None = None
        """Where the W&B run is (``mode``, ``url`` online, ``dir``), for ``summary.json``; None without W&B."""
        self._needs_rewrite = False  # read() found a torn last line: truncate() writes the file without it
        if tensorboard:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(str(path.parent / "tensorboard"))
        if wandb is not None:
            from tidal.train.wandb_run import start_wandb

            self._wandb, self.wandb_run = start_wandb(wandb)

    def __enter__(self) -> MetricsLog:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(failed=exc_type is not None)

    def read(self) -> list[dict[str, Any]]:
        """Every record written so far (a resumed run's history).

        A last line that is not a whole record (the run was killed while writing it) is dropped with a warning.

        Raises:
            ValueError: Another line is not a JSON record; the message names the file and the line.
        """
        if not self.path.exists():
            return []
        text = self.path.read_text(encoding="utf-8", errors="replace")
        lines = text.splitlines()
        records = []
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as e:
                if number < len(lines):
                    raise ValueError(f"{self.path}:{number} is not a JSON record ({e}); repair or delete it") from e
                logger.warning("%s: dropped a torn last line (the run was killed writing it): %.80r", self.path, line)
                self._needs_rewrite = True
        if text and not text.endswith("\n"):
            self._needs_rewrite = True  # the next append must start on a line of its own
        return records

    def truncate(self, start_rollout: int) -> int:
        """Drop records of rollouts ``>= start_rollout`` (a resumed run redoes them), and a torn last line.

        Returns how many records were dropped. The file is replaced atomically and durably.
        """
        records = self.read()
        kept = [r for r in records if r.get("rollout", -1) < start_rollout]
        if len(kept) != len(records) or self._needs_rewrite:
            tmp = self.path.with_suffix(".tmp")
            with tmp.open("w", encoding="utf-8") as f:
                f.write("".join(json.dumps(r, sort_keys=True) + "\n" for r in kept))
                f.flush()
                os.fsync(f.fileno())
            tmp.replace(self.path)
            _fsync_dir(self.path.parent)
            self._needs_rewrite = False
        return len(records) - len(kept)

    def write(self, record: dict[str, Any]) -> None:
        """Append ``record``, flushed and fsynced (and log its numbers to TensorBoard / W&B, stepped by rollout)."""
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(record, sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())
        step = int(record.get("rollout", 0))
        scalars = {k: float(v) for k, v in record.items() if isinstance(v, int | float) and k != "rollout"}
        if self._tb is not None:
            for key, value in scalars.items():
                self._tb.add_scalar(key, value, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)

    def close(self, *, failed: bool = False) -> None:
        """Flush and close the TensorBoard writer and the W&B run (marked failed when ``failed``); idempotent."""
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish(exit_code=1 if failed else 0)
            self._wandb = None


def _fsync_dir(path: Path) -> None:
    """Make a rename in ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt (Chen et al. 2021): ``1 - C(n - c, k) / C(n, k)``, ``n`` samples, ``c`` right."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def pass_ks(n: int) -> list[int]:
    """The k of the pass@k logged for ``n`` samples per prompt: 1, 2, 4, ... up to ``n``, and ``n``."""
    return sorted({*(2**i for i in range(n.bit_length()) if 2**i <= n), n})


def eval_metrics(name: str, rewards: list[list[float]]) -> dict[str, float]:
    """mean@k and pass@k (k = 1, 2, 4, ... up to n, and n) of one eval set, ``rewards[prompt][sample]``.

    mean@k is the mean reward over every sample; a sample counts as solved for pass@k when its reward is > 0.
    Keys: ``eval/<name>/mean@<n>``, ``eval/<name>/pass@<k>``.
    """
    n = len(rewards[0])
    if any(len(r) != n for r in rewards):
        raise ValueError(
            f"eval set {name!r}: every prompt needs the same number of samples, got {set(map(len, rewards))}"
        )
    out = {f"eval/{name}/mean@{n}": sum(map(sum, rewards)) / (n * len(rewards))}
    for k in pass_ks(n):
        per_prompt = [pass_at_k(n, sum(1 for x in r if x > 0), k) for r in rewards]
        out[f"eval/{name}/pass@{k}"] = sum(per_prompt) / len(per_prompt)
    return out
