"""The running pieces of a job: placement, SGLang engines and actor ranks as Ray actors, started and stopped together.

A debug mode starts only half of it: ``--debug-rollout-only`` no actor, ``--debug-train-only`` no engine.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
from tidal.train.config import JobConfig
from tidal.train.data import Prompt
from tidal.train.workers import ActorWorker, EngineWorker

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class Cluster:
    """Handles of everything a job started; ``stop_cluster`` stops them all."""

    placement: Any
    engines: list = field(default_factory=list)
    actors: list = field(default_factory=list)
    engine_pids: list[int] = field(default_factory=list)
    engine_urls: list[str] = field(default_factory=list)
    router: Any = None
    driver_client: Any = None
    """The driver's own client of the one engine (partial rollout, DAPO without a router); made on first use."""


def start_cluster(job: JobConfig, out: Path, *, with_engines: bool = True, with_actor: bool = True) -> Cluster:
    """Place, then start the engines and build the actor at the same time (the engine takes longest)."""
    from tidal.placement import PortAllocator, create_placement

    cluster = Cluster(create_placement(job.placement))
    try:
        starting = []
        for url in job.rollout.external_engine_urls() if with_engines else []:  # run elsewhere: no bundle needed
            engine = EngineWorker.options(num_cpus=0).remote(
                job.actor.hf_checkpoint, host="", port=0, nccl_port=0, log_dir=str(out / "logs"),
                rollout_cfg=job.rollout, external_url=url,
            )  # fmt: skip
            cluster.engines.append(engine)
            starting.append(engine.start.remote())
        launched = 0 if job.rollout.rollout_external_engine_addrs else job.placement.num_engines
        for e in range(launched if with_engines else 0):
            ports = PortAllocator(cluster.placement.engine_node_ip(e)).engine_ports()
            engine = EngineWorker.options(**cluster.placement.engine_options(e)).remote(
                job.actor.hf_checkpoint,
                host=job.rollout.sglang_host,
                port=ports.http_port,
                nccl_port=ports.nccl_port,
                log_dir=str(out / "logs"),
                rollout_cfg=job.rollout,
                env=dict(job.placement.ray_env),
                fault_tolerant=job.train.use_fault_tolerance,
            )
            cluster.engines.append(engine)
            starting.append(engine.start.remote())
        world = job.placement.num_actor_gpus if with_actor else 0
        if world:
            rendezvous = cluster.placement.rendezvous()
            for rank in range(world):
                cluster.actors.append(
                    ActorWorker.options(**cluster.placement.actor_options(rank)).remote(
                        job.actor,
                        job.batching,
                        rank=rank,
                        world_size=world,
                        master_addr=rendezvous.master_addr,
                        master_port=rendezvous.master_port,
                        seed=job.train.seed,
                        tensor_model_parallel_size=job.train.tensor_model_parallel_size,
                        context_parallel_size=job.train.context_parallel_size,
                        pipeline_model_parallel_size=job.train.pipeline_model_parallel_size,
                        ref_load=job.ckpt.ref_load,
                    )
                )
            ray.get([a.ready.remote() for a in cluster.actors])
        cluster.engine_urls = ray.get(starting)
        cluster.engine_pids = [pid for pid in ray.get([e.pid.remote() for e in cluster.engines]) if pid is not None]
        if cluster.engines and job.rollout.router_wanted(len(cluster.engines)):
            from tidal.rollout import start_router

            port = PortAllocator(cluster.placement.engine_node_ip(0)).engine_ports().http_port
            cluster.router = start_router(
                cluster.engine_urls,
                port=port,
                log_dir=out / "logs",
                policy=job.rollout.sglang_router_policy,
                extra_router_args=job.rollout.sglang_router_args,
                request_timeout_s=job.rollout.rollout_request_timeout_s,
                max_retries=job.rollout.rollout_request_retries,
            )
        logger.info("engines ready at %s; actor ready on %d rank(s)", cluster.engine_urls or "(none)", world)
    except BaseException:
        stop_cluster(cluster)
        raise
    return cluster


def stop_cluster(cluster: Cluster) -> None:
    """Stop engines (their process groups), then the actor, then the placement group."""
    if cluster.router is not None:
        cluster.router.shutdown()
    for engine in cluster.engines:
        try:
            ray.get(engine.shutdown.remote(), timeout=60)
        except Exception as e:  # keep stopping the rest
            logger.warning("engine shutdown failed: %s", e)
    for handle in [*cluster.engines, *cluster.actors]:
        ray.kill(handle, no_restart=True)
    cluster.placement.remove()


def generate(cluster: Cluster, prompts: list[Prompt], sampling_params: dict, reward_fn) -> tuple[list, float]:
    """Prompts split across engines; samples scored, in prompt-major order; also the slowest engine's own time."""
    from tidal.rollout import score_samples

    shares = [list(range(e, len(prompts), len(cluster.engines))) for e in range(len(cluster.engines))]
    futures = [
        engine.generate_samples.remote(
            [list(prompts[g].ids) for g in share], sampling_params, [prompts[g].label for g in share]
        )
        for engine, share in zip(cluster.engines, shares, strict=True)
    ]
    results = ray.get(futures)
    samples = [
        dataclasses.replace(s, group_index=share[s.group_index])
        for share, (part, _) in zip(shares, results, strict=True)
        for s in part
    ]
    samples.sort(key=lambda s: s.group_index)  # stable: samples of a group stay together, in order
    return score_samples(samples, reward_fn), max(seconds for _, seconds in results)


def driver_target(cluster: Cluster, job: JobConfig):
    """Where the driver sends requests itself: the router, or the one engine's URL (partial rollout, DAPO)."""
    from tidal.rollout import SGLangClient

    if cluster.router is not None:
        return cluster.router
    if len(cluster.engine_urls) > 1:
        raise ValueError(
            f"--partial-rollout / --dynamic-sampling-filter-path with {len(cluster.engine_urls)} engines send every "
            "request through the router: drop --no-use-router"
        )
    if cluster.driver_client is None:  # one client for the run: its pooled connections and retry count persist
        cluster.driver_client = SGLangClient(
            cluster.engine_urls[0],
            request_timeout_s=job.rollout.rollout_request_timeout_s,
            max_retries=job.rollout.rollout_request_retries,
        )
    return cluster.driver_client


def http_retries(cluster: Cluster) -> int:
    """Requests sent again after a transient failure so far, by every client of the run (engines, router, driver)."""
    total = sum(ray.get([e.http_retries.remote() for e in cluster.engines])) if cluster.engines else 0
    return total + sum(c.http_retries for c in (cluster.router, cluster.driver_client) if c is not None)


def sync_weights(job: JobConfig, cluster: Cluster, out: Path, *, version: int, previous: Path | None) -> Path:
    """Actor writes an HF checkpoint; every engine reloads it; the previous copy is removed."""
    target = out / "weights" / f"v{version:06d}"
    shard = job.train.update_weight_buffer_size
    ray.get([a.save_hf.remote(str(target), job.actor.hf_checkpoint, shard) for a in cluster.actors])
    ray.get([e.update_weights_from_disk.remote(str(target), str(version)) for e in cluster.engines])
    if previous is not None and previous != target:
        shutil.rmtree(previous, ignore_errors=True)
    return target


def evaluate(job: JobConfig, cluster: Cluster, prompts: list[Prompt], reward_fn) -> float:
    """Greedy accuracy (mean reward) on the held-out prompts."""
    params = {**job.rollout.sampling_params(), "n": 1, "temperature": 0.0}
    samples, _ = generate(cluster, prompts, params, reward_fn)
    return sum(float(s.reward) for s in samples) / len(samples)


def timed(fn, *args, **kwargs) -> tuple[Any, float]:
    """``(fn(*args, **kwargs), seconds)``."""
    tick = time.monotonic()
    return fn(*args, **kwargs), time.monotonic() - tick
