"""The loop's per-rollout bookkeeping: one record per rollout, written, plotted, checked and shown with an ETA.

A record holds the rollout's sample statistics, the actor's metrics, each phase's time, the weight sync's and the
evaluation's metrics, the transient failures survived (``rollout/http_retries``), the rollout's own time and the
share of it spent outside generation and training (``time/overhead_share``). The recorder appends it to
``metrics.jsonl`` (before the rollout's checkpoint, so a checkpoint's rollout always has its record), warns when
the engines and the actor disagree or the rewards carry no signal, redraws ``curves.png`` after each evaluation,
on the last rollout and at least every :data:`CURVES_EVERY_S`, and prints the rollout's line with an ETA.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tidal.train.logs import TERMINAL
from tidal.train.metrics import rollout_line
from tidal.train.monitors import RewardSanity, check_engine_agreement
from tidal.train.plots import write_curves
from tidal.train.summary import overhead_share

if TYPE_CHECKING:
    from tidal.train.config import JobConfig
    from tidal.train.metrics import MetricsLog
    from tidal.train.rollout_manager import RolloutManager
    from tidal.train.summary import RunResult

logger = logging.getLogger(__name__)

CURVES_EVERY_S = 30.0
"""curves.png is redrawn after each evaluation, on the last rollout, and at least this often: a redraw costs
a noticeable share of a short rollout (matplotlib renders on the driver), so it is not drawn after every one."""


class RolloutRecorder:
    """Records the rollouts ``start .. num_rollout - 1`` of one run into ``result.history`` and its files."""

    def __init__(
        self, job: JobConfig, out: Path, log: MetricsLog, result: RunResult, rollouts: RolloutManager, start: int
    ) -> None:
        """Record into ``log`` and ``result``; the HTTP retries of start-up count towards the first rollout."""
        self.job, self.out, self.log, self.result, self.rollouts = job, out, log, result, rollouts
        self.start, self.num_rollout = start, job.train.num_rollout
        self.sanity = RewardSanity(job.logging.reward_sanity_rollouts)
        self.retries_seen = 0
        self.loop_start = self.drawn = time.monotonic()

    def begin(self) -> None:
        """The first rollout starts now (the ETA counts from here)."""
        self.loop_start = self.drawn = time.monotonic()

    def samples(self, samples: list) -> None:
        """A rollout's samples came: warn when the rewards have carried no signal for a while."""
        self.sanity.observe(samples)

    def record(
        self, rollout_id: int, samples: list, metrics: dict[str, Any], times: dict[str, float], started: float
    ) -> dict:
        """Rollout ``rollout_id``'s record from its samples, metrics and phase times, written and kept.

        ``started`` is when the rollout began (``time.monotonic()``): the rollout's time is counted from it.
        """
        from tidal.rollout import rollout_metrics, version_number

        record: dict[str, Any] = {"rollout": rollout_id, **rollout_metrics(samples), **metrics, **times}
        record["rollout/weight_version"] = min(version_number(s.weight_version) for s in samples)
        retries = self.rollouts.http_retries()  # resets, refusals, timeouts, 5xx survived (generation, sync, eval)
        record["rollout/http_retries"], self.retries_seen = float(retries - self.retries_seen), retries
        record["time/rollout"] = time.monotonic() - started - times.get("time/eval", 0.0)
        record["time/overhead_share"] = overhead_share(record)
        check_engine_agreement(record, self.job.logging.mismatch_warn_threshold)
        self.log.write(record)
        self.result.history.append(record)
        return record

    def shown(self, record: dict) -> None:
        """Redraw the curves when due and print the rollout's line with the ETA of the rest."""
        rollout_id = record["rollout"]
        last = rollout_id == self.num_rollout - 1
        if last or "eval/accuracy" in record or time.monotonic() - self.drawn >= CURVES_EVERY_S:
            write_curves(self.out / "curves.png", self.result.history, eval_before=self.result.eval_before,
                         mismatch_threshold=self.job.logging.mismatch_warn_threshold)  # fmt: skip
            self.drawn = time.monotonic()
        done = rollout_id + 1 - self.start
        eta = (time.monotonic() - self.loop_start) / done * (self.num_rollout - rollout_id - 1)
        logger.info("%s | ETA %.0f s", rollout_line(record, self.num_rollout), eta, extra=TERMINAL)

    def finish(self) -> None:
        """The loop is done: the wall time, the last held-out accuracy, the log closed."""
        result = self.result
        result.wall_s = time.monotonic() - self.loop_start
        result.eval_after = next((r["eval/accuracy"] for r in reversed(result.history) if "eval/accuracy" in r), None)
        self.log.close()
