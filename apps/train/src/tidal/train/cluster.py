"""The running pieces of a job, started together and stopped together.

Ray, the placement group, the rollout manager's engines, the actor group's ranks and the weight sync between them.

A debug mode starts only half of it: ``--debug-rollout-only`` no actor; ``--debug-train-only`` and
``--load-debug-rollout-data`` no engine (the rollout manager then replays saved rollouts).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tidal.train.actor_group import ActorGroup
from tidal.train.async_plan import AsyncPlan, resolve_async_plan
from tidal.train.config import JobConfig
from tidal.train.data import PromptDataset
from tidal.train.handoff import HandOffLog
from tidal.train.logs import TERMINAL, LogPlan, adopt_ray_logger
from tidal.train.rollout_manager import RolloutManager, RolloutRun
from tidal.train.terminal import waiting
from tidal.train.weight_sync import SyncPlan, WeightExport, WeightSync, resolve_sync_plan

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Cluster:
    """The handles the training loop calls."""

    rollouts: RolloutManager
    """Generation, evaluation and the engines' weights."""
    actors: ActorGroup | None
    """Training and checkpoints; None under --debug-rollout-only."""
    async_plan: AsyncPlan
    """How far generation runs ahead of training (the rollout buffer's bound)."""
    weights: WeightSync | None = None
    """Hands the actor's weights to the engines; None without an actor."""


def rollout_manager_of(
    job: JobConfig,
    train_data: PromptDataset,
    out: Path,
    *,
    plan: SyncPlan | None = None,
    async_plan: AsyncPlan | None = None,
    handoff: HandOffLog | None = None,
) -> RolloutManager:
    """The rollout handle of ``job`` writing into run folder ``out``, from the sections it needs."""
    run = RolloutRun(
        run_dir=Path(job.train.output_dir or out),
        log_dir=out / "logs",
        verbose=job.logging.verbose,
        fault_tolerant=job.train.use_fault_tolerance,
        resync_timeout=None if job.train.debug_rollout_only else job.sync.update_weight_timeout,
    )
    return RolloutManager(
        job.rollout,
        job.placement,
        job.eval,
        train_data,
        model=job.actor.hf_checkpoint,
        rollout_batch_size=job.batching.rollout_batch_size,
        run=run,
        async_plan=async_plan or resolve_async_plan(job.train, job.rollout, job.actor),
        plan=plan,
        handoff=handoff,
    )


def actor_group_of(job: JobConfig, *, plan: SyncPlan, async_plan: AsyncPlan, handoff: HandOffLog) -> ActorGroup:
    """The actor handle of ``job``, from the sections it needs."""
    return ActorGroup(
        job.actor,
        job.batching,
        job.ckpt,
        job.parallel,
        num_ranks=job.placement.num_actor_gpus,
        seed=job.train.seed,
        n_samples_per_prompt=job.rollout.n_samples_per_prompt,
        log=LogPlan.of_run(job.train.output_dir, job.logging.verbose),
        plan=plan,
        off_policy_correction=async_plan.off_policy_correction,
        handoff=handoff,
    )


@contextmanager
def start_cluster(job: JobConfig, out: Path, train_data: PromptDataset) -> Iterator[Cluster]:
    """Start Ray and place, then start the engines and build the actor at the same time (the engine takes longest).

    Everything started is stopped when the block ends, also on an error or Ctrl-C during start-up.
    """
    from tidal.placement import create_placement, ray_session

    with_engines = not (job.train.debug_train_only or job.rollout.load_debug_rollout_data is not None)
    plan = resolve_sync_plan(job.sync, job.offload, job.placement, job.rollout, job.actor)
    async_plan = resolve_async_plan(job.train, job.rollout, job.actor)
    handoff = HandOffLog(out / "handoff.jsonl")
    rollouts = rollout_manager_of(job, train_data, out, plan=plan, async_plan=async_plan, handoff=handoff)
    actors = weights = None
    if not job.train.debug_rollout_only:
        actors = actor_group_of(job, plan=plan, async_plan=async_plan, handoff=handoff)
        export = WeightExport(root=out / "weights", max_shard_bytes=job.sync.update_weight_buffer_size)
        weights = WeightSync(plan, export, actors, handoff, pipeline_stages=job.parallel.pipeline_model_parallel_size)
        rollouts.weight_source = weights.resync  # --use-fault-tolerance: a restarted engine gets the actor's weights
    _announce(job, plan, with_engines=with_engines, with_actor=actors is not None)
    adopt_ray_logger()
    with ray_session(job.placement):
        from tidal.train.watchdog import stop_on_sigterm

        stop_on_sigterm()  # again: ray.init installed its own handler (SystemExit), which skips the save on the way out
        placement = create_placement(job.placement)
        try:
            with waiting("starting the SGLang engine(s) and the actor"):
                if with_engines:
                    rollouts.start(placement)
                if actors is not None:
                    actors.start(placement)
                    actors.wait_ready()
                rollouts.wait_ready()
            urls, ranks = rollouts.engine_urls or "(none)", len(actors or [])
            logger.info("engines ready at %s; actor ready on %d rank(s)", urls, ranks, extra=TERMINAL)
            yield Cluster(rollouts=rollouts, actors=actors, weights=weights, async_plan=async_plan)
        finally:
            if weights is not None:
                weights.close()  # while the engines still run
            try:
                rollouts.shutdown()  # the router, then the engines' servers (their process groups)
            finally:
                if actors is not None:
                    actors.kill()
                placement.remove()


def _announce(job: JobConfig, plan: SyncPlan, *, with_engines: bool, with_actor: bool) -> None:
    """The start-up block: where Ray runs, what it places, how weights move (shown without --verbose)."""
    from tidal.placement import detect_gpus, plan_local_gpus

    cfg, parallel, cpu_mode = job.placement, job.parallel, False
    if cfg.cluster_address:
        logger.info("Ray: the cluster at %s", cfg.cluster_address, extra=TERMINAL)
    else:
        local = plan_local_gpus(cfg, detect_gpus())
        cpu_mode = local.logical
        logger.info("Ray: local, %d CPUs, %s", cfg.num_cpus_local, local.describe(), extra=TERMINAL)
    sizes = (parallel.tensor_model_parallel_size, parallel.context_parallel_size, parallel.pipeline_model_parallel_size)
    parallel = "tp {}, cp {}, pp {}".format(*sizes)
    actor = f"actor on {cfg.num_actor_gpus} GPU(s) ({parallel})" if with_actor else "no actor"
    external = job.rollout.rollout_external_engine_addrs
    engines = f"{len(external)} external SGLang server(s)" if external else f"{cfg.num_engines} SGLang engine(s)"
    engines = engines if with_engines else "no engine"
    shared = with_actor and with_engines and not external
    where = ("; co-located on the same GPUs" if cfg.colocate else "; on separate GPUs") if shared else ""
    logger.info("%s; %s%s", actor, engines, where, extra=TERMINAL)
    if with_engines and with_actor:
        on = {True: "on", False: "off"}
        offload = f"offload: actor {on[plan.offload_train]}, engines {on[plan.offload_rollout]}"
        if cpu_mode and (plan.offload_train or plan.offload_rollout):
            offload += " (CPU mode: the hand-off runs as on a GPU but frees no memory)"
        logger.info("weight sync: %s; %s", plan.transport, offload, extra=TERMINAL)
