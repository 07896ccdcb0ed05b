"""The training loop, in the order things happen.

Start the cluster, resume from ``--load`` if given, then per rollout: generate (or replay saved samples), score,
train (old log-probs, advantages, steps), sync weights, evaluate, log, checkpoint.

Every step calls a package; this module only composes them and keeps time.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
from tidal.train.cluster import (
    Cluster,
    evaluate,
    generate,
    http_retries,
    start_cluster,
    stop_cluster,
    sync_weights,
    timed,
)
from tidal.train.config import JobConfig
from tidal.train.data import PromptDataset
from tidal.train.driver_rollouts import DriverRollouts
from tidal.train.metrics import MetricsLog, rollout_line
from tidal.train.monitors import RewardSanity, check_engine_agreement, check_prompt_chat_template
from tidal.train.plots import write_curves
from tidal.train.workers import RolloutData

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
    start_rollout_id: int = 0
    wall_s: float = 0.0


def run(job: JobConfig) -> RunResult:
    """Run the whole job; every process it starts is stopped before it returns or raises."""
    from tidal.placement import ray_session
    from transformers import AutoTokenizer

    out = Path(job.train.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(job.actor.hf_checkpoint)
    keys = {"input_key": job.train.input_key, "label_key": job.train.label_key, "seed": job.train.seed}
    if job.rollout.apply_chat_template:
        from tidal.rollout import check_chat_template

        check_chat_template(tokenizer)  # a missing or broken template stops here, before any process starts
        keys["apply_chat_template"] = True
    train_data = PromptDataset(job.train.prompt_data, tokenizer, **keys)
    check_prompt_chat_template(train_data.raw_texts, tokenizer, apply_chat_template=job.rollout.apply_chat_template)
    eval_data = PromptDataset(job.train.eval_prompt_data, tokenizer, **keys)
    replay = job.rollout.load_debug_rollout_data is not None
    with ray_session(job.placement):
        engines = not (job.train.debug_train_only or replay)
        cluster = start_cluster(job, out, with_engines=engines, with_actor=not job.train.debug_rollout_only)
        try:
            return _train(job, cluster, train_data, eval_data, out)
        finally:
            stop_cluster(cluster)


def _resume(job: JobConfig, cluster: Cluster, metrics_log: MetricsLog) -> tuple[int, int, list | None]:
    """Load ``--load`` into every actor rank; returns ``(first rollout id, weight version, rollout carry-over)``."""
    start, version, carry = job.train.start_rollout_id or 0, 0, None
    if job.ckpt.load and cluster.actors:
        from tidal.ckpt import TrainerState

        common = ray.get([a.load_checkpoint.remote(job.ckpt) for a in cluster.actors])[0]
        state = TrainerState.from_dict(common)
        start = state.rollout_id + 1 if job.train.start_rollout_id is None else job.train.start_rollout_id
        version, carry = state.weight_version, state.rollout_carry
        if state.rng_state is not None and not job.ckpt.no_load_rng:
            state.restore_rng()
        logger.info("resumed from %s: rollout %d done; going on at rollout %d", job.ckpt.load, state.rollout_id, start)
    dropped = metrics_log.truncate(start)
    if dropped:
        logger.info("metrics.jsonl: dropped %d record(s) of rollouts >= %d (they run again)", dropped, start)
    return start, version, carry


def _train(job: JobConfig, cluster: Cluster, train_data, eval_data, out: Path) -> RunResult:
    from tidal.rollout import load_rollout_data, resolve_reward_fn, rollout_metrics, save_rollout_data

    reward_fn = resolve_reward_fn(job.rollout.custom_rm_path or job.rollout.rm_type)
    metrics_log = MetricsLog(out / "metrics.jsonl", tensorboard=job.train.use_tensorboard, wandb=_wandb_args(job, out))
    result = RunResult(output_dir=out, checkpoint_dir=Path(job.ckpt.save), weights_dir=None)
    result.engine_pids = cluster.engine_pids
    start, version, carry = _resume(job, cluster, metrics_log)
    result.start_rollout_id = start
    result.history = metrics_log.read()
    held_out = eval_data.head(job.train.num_eval_prompts)
    can_eval = bool(cluster.engines)
    if cluster.engines and cluster.actors and version > 0:  # the engines must serve the resumed weights
        result.weights_dir = sync_weights(job, cluster, out, version=version, previous=None)
    elif cluster.engines and job.rollout.rollout_external_engine_addrs:  # a server run elsewhere may hold any weights
        logger.info("loading %s into the external SGLang server(s)", job.actor.hf_checkpoint)
        ray.get([e.update_weights_from_disk.remote(job.actor.hf_checkpoint, "0") for e in cluster.engines])
    if can_eval:
        result.eval_before = evaluate(job, cluster, held_out, reward_fn)
        logger.info("held-out accuracy before RL: %.3f", result.eval_before)
    sanity = RewardSanity(job.train.reward_sanity_rollouts)
    rollouts = DriverRollouts(job, cluster, train_data, reward_fn, tokenizer=eval_data.tokenizer)
    rollouts.restore_carry(carry)  # partial rollout's unfinished groups at the checkpoint: nothing is dropped
    loop_start = time.monotonic()
    retries_seen = 0  # the first rollout's count includes the start-up's (evaluation, weight loading)
    for rollout_id in range(start, job.train.num_rollout):
        tick = time.monotonic()
        times: dict[str, float] = {}
        if job.rollout.load_debug_rollout_data:
            samples, times["time/generate"] = timed(load_rollout_data, job.rollout.load_debug_rollout_data, rollout_id)
        elif rollouts.driver_side:
            (samples, extra), times["time/generate"] = timed(rollouts.generate, rollout_id)
            times["time/generate_engine"] = times["time/generate"]
            times.update(extra)
        else:
            prompts = train_data.batch(rollout_id, job.batching.rollout_batch_size)
            (samples, engine_s), times["time/generate"] = timed(
                generate, cluster, prompts, job.rollout.sampling_params(), reward_fn
            )
            times["time/generate_engine"] = engine_s
        if job.rollout.save_debug_rollout_data:
            save_rollout_data(job.rollout.save_debug_rollout_data, rollout_id, samples)
        sanity.observe(samples)

        train_metrics: dict[str, float] = {}
        if cluster.actors:
            rollout = _rollout_data(samples, job.rollout.n_samples_per_prompt)
            train_metrics, times["time/actor_call"] = timed(
                lambda r=rollout: ray.get([a.train.remote(r) for a in cluster.actors])[0]
            )
            if cluster.engines and (rollout_id + 1) % job.train.update_weights_interval == 0:
                version = rollout_id + 1
                result.weights_dir, times["time/weight_sync"] = timed(
                    sync_weights, job, cluster, out, version=version, previous=result.weights_dir
                )
        record: dict[str, Any] = {"rollout": rollout_id, **rollout_metrics(samples), **train_metrics, **times}
        record["rollout/weight_version"] = min(_version(s.weight_version) for s in samples)
        last = rollout_id == job.train.num_rollout - 1
        if can_eval and (last or (job.train.eval_interval and (rollout_id + 1) % job.train.eval_interval == 0)):
            record["eval/accuracy"], times["time/eval"] = timed(evaluate, job, cluster, held_out, reward_fn)
        retries = http_retries(cluster)  # resets, refusals, timeouts, 5xx survived (generation, sync, eval)
        record["rollout/http_retries"], retries_seen = float(retries - retries_seen), retries
        record["time/rollout"] = time.monotonic() - tick - times.get("time/eval", 0.0)
        record["time/overhead_share"] = _overhead_share(record)
        check_engine_agreement(record, job.train.mismatch_warn_threshold)
        metrics_log.write(record)  # before the checkpoint: a checkpoint's rollout always has its record
        result.history.append(record)
        if cluster.actors and (last or (job.ckpt.save_interval and (rollout_id + 1) % job.ckpt.save_interval == 0)):
            _save(job, cluster, rollout_id, version, carry=rollouts.carry_state())
        write_curves(
            out / "curves.png",
            result.history,
            eval_before=result.eval_before,
            mismatch_threshold=job.train.mismatch_warn_threshold,
        )
        done = rollout_id + 1 - start
        eta = (time.monotonic() - loop_start) / done * (job.train.num_rollout - rollout_id - 1)
        logger.info("%s | ETA %.0f s", rollout_line(record, job.train.num_rollout), eta)
    if cluster.actors and job.ckpt.async_save:
        ray.get([a.finalize_saves.remote() for a in cluster.actors])
    result.wall_s = time.monotonic() - loop_start
    result.eval_after = next((r["eval/accuracy"] for r in reversed(result.history) if "eval/accuracy" in r), None)
    metrics_log.close()
    _write_summary(result)
    return result


def _save(job: JobConfig, cluster: Cluster, rollout_id: int, version: int, *, carry: list | None = None) -> None:
    """Megatron checkpoint (with the trainer's state and the rollout carry-over) and, with --save-hf, an HF copy."""
    from tidal.ckpt import TrainerState

    state = TrainerState.capture(
        rollout_id=rollout_id, weight_version=version, data_seed=job.train.seed, rollout_carry=carry
    )
    ray.get([a.save_checkpoint.remote(job.ckpt, rollout_id + 1, state.to_dict()) for a in cluster.actors])
    if job.train.save_hf:
        target = job.train.save_hf.replace("{rollout_id}", str(rollout_id))
        ray.get([a.save_hf.remote(target, job.actor.hf_checkpoint) for a in cluster.actors])


def _wandb_args(job: JobConfig, out: Path) -> dict[str, Any] | None:
    if not job.train.use_wandb:
        return None
    return {"project": job.train.wandb_project, "dir": str(out), "mode": "offline", "config": _job_dict(job)}


def _job_dict(job: JobConfig) -> dict[str, Any]:
    import dataclasses

    return {f.name: dataclasses.asdict(getattr(job, f.name)) for f in dataclasses.fields(job)}


def _overhead_share(record: dict[str, Any]) -> float:
    """Share of the rollout's wall time spent outside the engines' generation and the actor's compute."""
    compute = sum(record.get(k, 0.0) for k in ("time/generate_engine", "time/log_probs", "time/train"))
    total = record["time/rollout"]
    return max(0.0, total - compute) / total if total > 0 else 0.0


def _write_summary(result: RunResult) -> None:
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
        "metrics": str(result.output_dir / "metrics.jsonl"),
        "curves": str(result.output_dir / "curves.png"),
        "checkpoint_dir": str(result.checkpoint_dir),
        "weights_dir": str(result.weights_dir),
        "engine_pids": result.engine_pids,
    }
    (result.output_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")


def _rollout_data(samples: list, group_size: int) -> RolloutData:
    return RolloutData(
        tokens=[s.tokens for s in samples],
        loss_masks=[s.loss_mask for s in samples],
        rollout_log_probs=[[0.0] * len(s.prompt_ids) + list(s.response_log_probs) for s in samples],
        rewards=[float(s.reward) for s in samples],
        group_size=group_size,
    )


def _version(value: str | None) -> float:
    """The engine's weight version as a number (0 for the initial weights)."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return 0.0
