"""How new weights reach the engines, and how a co-located actor and its engines hand the GPU to each other.

:func:`resolve_sync_plan` turns --update-weight-transport and --offload* into one :class:`SyncPlan` before any
process starts; both handles (the actor group and the rollout manager) follow it. The order of one rollout with
--offload (slime's):

    generate -> engines release weights + KV cache -> actor onload -> train
    -> engines resume weights -> sync -> engines resume KV cache -> actor offload -> (evaluate) -> generate ...

:class:`HandOffLog` writes each of those calls, with its rollout, to ``RUN/handoff.jsonl``: what the end-to-end
tests read to check the order, and what a user reads when a co-located run runs out of memory.
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class SyncPlan:
    """The weight sync and memory hand-off a job runs, resolved from its flags."""

    transport: str
    """"tensor", "nccl" or "disk" (--update-weight-transport, resolved)."""
    bucket_bytes: int
    """Bytes per bucket or shard (--update-weight-buffer-size)."""
    timeout_s: float
    """Bound of one sync (--update-weight-timeout)."""
    check_equal: bool = False
    """Compare engine and actor log-probs on a probe after each sync (--check-weight-update-equal)."""
    tolerance: float = 0.05
    """Largest mean probe gap accepted (--check-weight-update-tolerance)."""
    offload_train: bool = False
    """The actor leaves the GPU while the engines generate."""
    offload_rollout: bool = False
    """The engines release their memory while the actor trains."""


def resolve_sync_plan(train, placement, rollout) -> SyncPlan:
    """The plan of a job's TrainConfig, PlacementConfig and RolloutConfig.

    Raises:
        ValueError: --update-weight-transport tensor without co-located engines, or --offload-rollout with
            external engines (tidal does not manage the memory of a server it did not start).
    """
    external = bool(rollout.rollout_external_engine_addrs)
    colocated = placement.colocate and not external
    transport = train.update_weight_transport or ("tensor" if colocated else "nccl")
    if transport == "tensor" and not colocated:
        where = "--rollout-external-engine-addrs" if external else "--no-colocate"
        raise ValueError(
            f"--update-weight-transport tensor hands the engines handles to the actor's own memory, so the engines "
            f"must share its GPUs; with {where} use --update-weight-transport nccl (or disk)"
        )
    offload = colocated if train.offload is None else train.offload
    offload_train = offload if train.offload_train is None else train.offload_train
    offload_rollout = offload if train.offload_rollout is None else train.offload_rollout
    if offload_rollout and external:
        raise ValueError(
            "--offload-rollout (or --offload) releases the engines' memory, but --rollout-external-engine-addrs "
            "servers are run elsewhere: drop --offload-rollout"
        )
    if (offload_train or offload_rollout) and not placement.colocate:
        logger.warning("--offload frees GPU memory for the other side of a co-located job; with --no-colocate it "
                       "only costs time")  # fmt: skip
    return SyncPlan(
        transport=transport,
        bucket_bytes=train.update_weight_buffer_size,
        timeout_s=train.update_weight_timeout,
        check_equal=train.check_weight_update_equal,
        tolerance=train.check_weight_update_tolerance,
        offload_train=offload_train,
        offload_rollout=offload_rollout,
    )


class HandOffLog:
    """Appends ``{"rollout", "event", "t"}`` lines to a JSONL file (None: keeps nothing) as the calls happen."""

    def __init__(self, path: Path | None) -> None:
        """Log into ``path`` (appended to: a resumed run continues the file)."""
        self.path = path
        self.rollout: int | None = None
        """The rollout the next events belong to (set when its generation starts; None before the first)."""

    def add(self, event: str, **info: float) -> None:
        """Record ``event`` (e.g. ``"engines.release"``) with numbers about it."""
        if self.path is None:
            return
        line = {"rollout": self.rollout, "event": event, "t": round(time.time(), 3), **info}
        with self.path.open("a") as f:
            f.write(json.dumps(line) + "\n")


def probe_gap(engine_samples: list[list[tuple[list[int], list[float]]]], actor_log_probs: list[list[float]]) -> dict:
    """Metrics of engine vs actor log-probs on the probe: mean and max |gap| over every engine's sampled tokens.

    ``engine_samples[e][i]`` is engine ``e``'s ``(prompt + response tokens, response log-probs)`` of probe prompt
    ``i``; ``actor_log_probs`` holds the actor's log-probs of the same token lists, engine-major, in tidal's
    convention (position t scores token t).
    """
    gaps: list[float] = []
    flat = [sample for samples in engine_samples for sample in samples]
    for (tokens, engine_lp), actor_lp in zip(flat, actor_log_probs, strict=True):
        response = actor_lp[len(tokens) - len(engine_lp) :]
        gaps += [abs(a - e) for a, e in zip(response, engine_lp, strict=True)]
    if not gaps or not all(math.isfinite(g) for g in gaps):
        return {"weight_sync/probe_logprob_abs_diff/mean": math.inf, "weight_sync/probe_logprob_abs_diff/max": math.inf}
    return {
        "weight_sync/probe_logprob_abs_diff/mean": sum(gaps) / len(gaps),
        "weight_sync/probe_logprob_abs_diff/max": max(gaps),
    }
