"""The running pieces of a job, started together and stopped together.

Ray, the placement group, the rollout manager's engines and the actor group's ranks.

A debug mode starts only half of it: ``--debug-rollout-only`` no actor; ``--debug-train-only`` and
``--load-debug-rollout-data`` no engine (the rollout manager then replays saved rollouts).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tidal.train.actor_group import ActorGroup, WeightExport
from tidal.train.config import JobConfig
from tidal.train.data import PromptDataset
from tidal.train.handoff import HandOffLog, resolve_sync_plan
from tidal.train.rollout_manager import RolloutManager

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Cluster:
    """The two handles the training loop calls."""

    rollouts: RolloutManager
    """Generation, evaluation and the engines' weights."""
    actors: ActorGroup | None
    """Training, weight export and checkpoints; None under --debug-rollout-only."""


@contextmanager
def start_cluster(job: JobConfig, out: Path, train_data: PromptDataset) -> Iterator[Cluster]:
    """Start Ray and place, then start the engines and build the actor at the same time (the engine takes longest).

    Everything started is stopped when the block ends, also on an error or Ctrl-C during start-up.
    """
    from tidal.placement import create_placement, ray_session

    with_engines = not (job.train.debug_train_only or job.rollout.load_debug_rollout_data is not None)
    plan = resolve_sync_plan(job.train, job.placement, job.rollout)
    handoff = HandOffLog(out / "handoff.jsonl")
    rollouts = RolloutManager(job, train_data, log_dir=out / "logs", plan=plan, handoff=handoff)
    actors = None
    if not job.train.debug_rollout_only:
        weights = WeightExport(root=out / "weights", max_shard_bytes=job.train.update_weight_buffer_size)
        actors = ActorGroup(job, weights, plan=plan, handoff=handoff)
        rollouts.weight_source = actors.resync  # --use-fault-tolerance: a restarted engine gets the actor's weights
    if with_engines and actors is not None:
        logger.info("weight sync: %s; offload: actor %s, engines %s", plan.transport,
                    "on" if plan.offload_train else "off", "on" if plan.offload_rollout else "off")  # fmt: skip
    with ray_session(job.placement):
        placement = create_placement(job.placement)
        try:
            if with_engines:
                rollouts.start(placement)
            if actors is not None:
                actors.start(placement)
                actors.wait_ready()
            rollouts.wait_ready()
            logger.info(
                "engines ready at %s; actor ready on %d rank(s)", rollouts.engine_urls or "(none)", len(actors or [])
            )
            yield Cluster(rollouts=rollouts, actors=actors)
        finally:
            if actors is not None:
                actors.close_weight_sync()  # while the engines still run
            try:
                rollouts.shutdown()  # the router, then the engines' servers (their process groups)
            finally:
                if actors is not None:
                    actors.kill()
                placement.remove()
