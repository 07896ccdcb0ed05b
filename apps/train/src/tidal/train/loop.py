"""The training loop, in the order things happen.

Place, start engines, build the actor, then per rollout: generate, score, train (old log-probs, advantages,
steps), sync weights, evaluate, checkpoint.

Every step calls a package; this module only composes them and keeps time.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
from tidal.train.config import JobConfig
from tidal.train.data import Prompt, PromptDataset
from tidal.train.metrics import MetricsLog, rollout_line
from tidal.train.plots import write_curves
from tidal.train.workers import ActorWorker, EngineWorker, RolloutData

logger = logging.getLogger(__name__)


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


@dataclass(slots=True)
class _Cluster:
    placement: Any
    engines: list
    actors: list
    engine_pids: list[int]


def run(job: JobConfig) -> RunResult:
    """Run the whole job; every process it starts is stopped before it returns or raises."""
    from tidal.placement import ray_session
    from transformers import AutoTokenizer

    out = Path(job.train.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(job.actor.hf_checkpoint)
    keys = {"input_key": job.train.input_key, "label_key": job.train.label_key, "seed": job.train.seed}
    train_data = PromptDataset(job.train.prompt_data, tokenizer, **keys)
    eval_data = PromptDataset(job.train.eval_prompt_data, tokenizer, **keys)
    with ray_session(job.placement):
        cluster = _start(job, out)
        try:
            return _train(job, cluster, train_data, eval_data, out)
        finally:
            _stop(cluster)


def _start(job: JobConfig, out: Path) -> _Cluster:
    """Place, then start the engines and build the actor at the same time (the engine takes longest)."""
    from tidal.placement import PortAllocator, create_placement

    placement = create_placement(job.placement)
    engines, actors = [], []
    cluster = _Cluster(placement, engines, actors, [])
    try:
        starting = []
        for e in range(job.placement.num_engines):
            ports = PortAllocator(placement.engine_node_ip(e)).engine_ports()
            engine = EngineWorker.options(**placement.engine_options(e)).remote(
                job.actor.hf_checkpoint,
                host=job.rollout.sglang_host,
                port=ports.http_port,
                nccl_port=ports.nccl_port,
                log_dir=str(out / "logs"),
                rollout_cfg=job.rollout,
                env=dict(job.placement.ray_env),
            )
            engines.append(engine)
            starting.append(engine.start.remote())
        rendezvous = placement.rendezvous()
        world = job.placement.num_actor_gpus
        for rank in range(world):
            actors.append(
                ActorWorker.options(**placement.actor_options(rank)).remote(
                    job.actor,
                    job.batching,
                    rank=rank,
                    world_size=world,
                    master_addr=rendezvous.master_addr,
                    master_port=rendezvous.master_port,
                    seed=job.train.seed,
                )
            )
        ray.get([a.ready.remote() for a in actors])
        urls = ray.get(starting)
        cluster.engine_pids = ray.get([e.pid.remote() for e in engines])
        logger.info("engines ready at %s; actor ready on %d rank(s)", urls, world)
    except BaseException:
        _stop(cluster)
        raise
    return cluster


def _stop(cluster: _Cluster) -> None:
    """Stop engines (their process groups), then the actor, then the placement group."""
    for engine in cluster.engines:
        try:
            ray.get(engine.shutdown.remote(), timeout=60)
        except Exception as e:  # keep stopping the rest
            logger.warning("engine shutdown failed: %s", e)
    for handle in [*cluster.engines, *cluster.actors]:
        ray.kill(handle, no_restart=True)
    cluster.placement.remove()


def _train(job, cluster, train_data, eval_data, out: Path) -> RunResult:
    from tidal.rollout import resolve_reward_fn, save_rollout_data

    reward_fn = resolve_reward_fn(job.rollout.custom_rm_path or job.rollout.rm_type)
    metrics_log = MetricsLog(out / "metrics.jsonl")
    ckpt_dir = Path(job.train.save or out / "ckpt")
    result = RunResult(output_dir=out, checkpoint_dir=ckpt_dir, weights_dir=None, engine_pids=cluster.engine_pids)
    result.eval_before = _evaluate(job, cluster, eval_data, reward_fn)
    logger.info("held-out accuracy before RL: %.3f", result.eval_before)
    loop_start = time.monotonic()
    for rollout_id in range(job.train.num_rollout):
        times: dict[str, float] = {}
        tick = time.monotonic()
        prompts = train_data.batch(rollout_id, job.batching.rollout_batch_size)
        samples = _generate(cluster, prompts, job.rollout.sampling_params(), reward_fn)
        times["time/generate"] = time.monotonic() - tick
        if job.rollout.save_debug_rollout_data:
            save_rollout_data(job.rollout.save_debug_rollout_data, rollout_id, samples)

        rollout = _rollout_data(samples, job.rollout.n_samples_per_prompt)
        train_metrics = ray.get([a.train.remote(rollout) for a in cluster.actors])[0]

        tick = time.monotonic()
        result.weights_dir = _sync_weights(job, cluster, out, version=rollout_id + 1, previous=result.weights_dir)
        times["time/weight_sync"] = time.monotonic() - tick

        record = {"rollout": rollout_id, **_rollout_metrics(samples), **train_metrics, **times}
        last = rollout_id == job.train.num_rollout - 1
        if last or (job.train.eval_interval and (rollout_id + 1) % job.train.eval_interval == 0):
            record["eval/accuracy"] = _evaluate(job, cluster, eval_data, reward_fn)
        if last or (job.train.save_interval and (rollout_id + 1) % job.train.save_interval == 0):
            state = {"rollout_id": rollout_id, "seed": job.train.seed, "weight_version": rollout_id + 1}
            ray.get([a.save_checkpoint.remote(str(ckpt_dir), rollout_id + 1, state) for a in cluster.actors])
        metrics_log.write(record)
        result.history.append(record)
        write_curves(out / "curves.png", result.history, eval_before=result.eval_before)
        elapsed = time.monotonic() - loop_start
        eta = elapsed / (rollout_id + 1) * (job.train.num_rollout - rollout_id - 1)
        logger.info("%s | ETA %.0f s", rollout_line(record, job.train.num_rollout), eta)
    result.eval_after = result.history[-1].get("eval/accuracy")
    _write_summary(result)
    return result


def _write_summary(result: RunResult) -> None:
    """``summary.json`` in the run folder: accuracy before and after, where the outputs are, what ran."""
    summary = {
        "eval_before": result.eval_before,
        "eval_after": result.eval_after,
        "num_rollouts": len(result.history),
        "metrics": str(result.output_dir / "metrics.jsonl"),
        "curves": str(result.output_dir / "curves.png"),
        "checkpoint_dir": str(result.checkpoint_dir),
        "weights_dir": str(result.weights_dir),
        "engine_pids": result.engine_pids,
    }
    (result.output_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")


def _generate(cluster, prompts: list[Prompt], sampling_params: dict, reward_fn) -> list:
    """Prompts split across engines, one batched request each; samples scored; prompt-major order kept."""
    from tidal.rollout import score_samples

    shares = [list(range(e, len(prompts), len(cluster.engines))) for e in range(len(cluster.engines))]
    futures = [
        engine.generate_samples.remote(
            [list(prompts[g].ids) for g in share], sampling_params, [prompts[g].label for g in share]
        )
        for engine, share in zip(cluster.engines, shares, strict=True)
    ]
    samples = [
        dataclasses.replace(s, group_index=share[s.group_index])
        for share, part in zip(shares, ray.get(futures), strict=True)
        for s in part
    ]
    samples.sort(key=lambda s: s.group_index)  # stable: samples of a group stay together, in order
    return score_samples(samples, reward_fn)


def _rollout_data(samples: list, group_size: int) -> RolloutData:
    return RolloutData(
        tokens=[s.tokens for s in samples],
        loss_masks=[s.loss_mask for s in samples],
        rollout_log_probs=[[0.0] * len(s.prompt_ids) + list(s.response_log_probs) for s in samples],
        rewards=[float(s.reward) for s in samples],
        group_size=group_size,
    )


def _rollout_metrics(samples: list) -> dict[str, float]:
    """tidal.rollout's per-rollout metrics plus the oldest engine weight version among the samples."""
    from tidal.rollout import rollout_metrics

    return rollout_metrics(samples) | {"rollout/weight_version": min(_version(s.weight_version) for s in samples)}


def _version(value: str | None) -> float:
    """The engine's weight version as a number (0 for the initial weights)."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return 0.0


def _sync_weights(job, cluster, out: Path, *, version: int, previous: Path | None) -> Path:
    """Actor writes an HF checkpoint; every engine reloads it; the previous copy is removed."""
    target = out / "weights" / f"v{version:06d}"
    ray.get([a.save_hf.remote(str(target), job.actor.hf_checkpoint) for a in cluster.actors])
    ray.get([e.update_weights_from_disk.remote(str(target), str(version)) for e in cluster.engines])
    if previous is not None:
        shutil.rmtree(previous, ignore_errors=True)
    return target


def _evaluate(job, cluster, eval_data: PromptDataset, reward_fn) -> float:
    """Greedy accuracy (mean reward) on the first ``num_eval_prompts`` held-out prompts."""
    params = {**job.rollout.sampling_params(), "n": 1, "temperature": 0.0}
    samples = _generate(cluster, eval_data.head(job.train.num_eval_prompts), params, reward_fn)
    return sum(float(s.reward) for s in samples) / len(samples)
