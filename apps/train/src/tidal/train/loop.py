"""The training loop, in the order things happen.

Place and start the engines and the actor, resume from ``--load`` if given, then per rollout: generate (or
replay saved samples; under ``--max-staleness`` K >= 1 the rollout buffer generated it ahead, while the actor
trained), train (old log-probs, advantages, steps), sync weights, evaluate, log, checkpoint.

Two handles do the work: the rollout manager (engines) and the actor group (trainer ranks). This module only
composes them and keeps time; ``recorder.RolloutRecorder`` writes, plots and shows each rollout's record.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from tidal.train.actor_group import ActorGroup
from tidal.train.cluster import Cluster, start_cluster
from tidal.train.config import JobConfig, held_out_sets
from tidal.train.data import PromptDataset
from tidal.train.interrupted import Progress, save_on_interrupt
from tidal.train.logs import TERMINAL
from tidal.train.metrics import MetricsLog
from tidal.train.monitors import check_prompt_chat_template
from tidal.train.recorder import RolloutRecorder
from tidal.train.rollout_buffer import RolloutBuffer
from tidal.train.rollout_manager import RolloutManager
from tidal.train.summary import RunResult, floor_key, write_summary
from tidal.train.terminal import RolloutBar
from tidal.train.wandb_run import wandb_options
from tidal.train.weight_sync import WeightSync

logger = logging.getLogger(__name__)


def run(job: JobConfig) -> RunResult:
    """Run the whole job; every process it starts is stopped before it returns or raises."""
    out = Path(job.train.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    train_data, eval_data = _datasets(job)
    held_out = {name: data.head(job.eval.num_eval_prompts) for name, data in eval_data.items()}
    tensorboard, wandb = job.logging.use_tensorboard, wandb_options(job, out)
    with (
        MetricsLog(out / "metrics.jsonl", tensorboard=tensorboard, wandb=wandb) as metrics_log,  # W&B: before Ray
        start_cluster(job, out, train_data) as cluster,
        RolloutBuffer(
            cluster.rollouts, max_staleness=cluster.async_plan.max_staleness, num_rollout=job.train.num_rollout
        ) as buffer,
        RolloutBar(job.train.num_rollout) as bar,
    ):
        return _train(job, cluster, buffer, held_out, metrics_log, bar)


def _train(
    job: JobConfig, cluster: Cluster, buffer: RolloutBuffer, held_out: dict, metrics_log: MetricsLog, bar: RolloutBar
) -> RunResult:
    rollouts, actors, weights = cluster.rollouts, cluster.actors, cluster.weights
    out = metrics_log.path.parent
    result = RunResult(output_dir=out, checkpoint_dir=Path(job.ckpt.save), weights_dir=None, job_key=floor_key(job))
    result.wandb = metrics_log.wandb_run
    result.engine_pids = rollouts.engine_pids
    start, version = _resume(job, rollouts, buffer, actors, metrics_log)
    result.start_rollout_id, result.history = start, metrics_log.read()
    result.weights_dir = _serve_first_weights(job, rollouts, weights, version)
    if rollouts.has_engines:
        bar.phase(start, "evaluate before RL")
        result.eval_before = rollouts.evaluate(held_out)["eval/accuracy"]
        logger.info("held-out accuracy before RL: %.3f", result.eval_before, extra=TERMINAL)
    recorder = RolloutRecorder(job, out, metrics_log, result, rollouts, start)
    progress = Progress(finished=start - 1, saved=start - 1 if actors and job.ckpt.load else -1, version=version)
    try:
        _rollouts(job, cluster, buffer, held_out, recorder, progress, bar)
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: the newest finished rollout is checkpointed on the way out
        save_on_interrupt(job, buffer, actors, progress)
        raise
    if actors and job.ckpt.async_save:
        actors.finalize_saves()
    recorder.finish()
    write_summary(result)
    return result


def _rollouts(
    job: JobConfig,
    cluster: Cluster,
    buffer: RolloutBuffer,
    held_out: dict,
    recorder: RolloutRecorder,
    progress: Progress,
    bar: RolloutBar,
) -> None:
    """Rollouts from ``progress.finished + 1`` on: generate, train, sync, evaluate, record, checkpoint."""
    rollouts, actors, weights = cluster.rollouts, cluster.actors, cluster.weights
    num_rollout, version = job.train.num_rollout, progress.version
    best = _best_so_far(job, recorder.result.history)
    recorder.begin()
    for rollout_id in range(progress.finished + 1, num_rollout):
        started, last = time.monotonic(), rollout_id == num_rollout - 1
        bar.phase(rollout_id, "generate")
        samples, times = buffer.take(rollout_id, version)  # generated now, or ahead under --max-staleness
        recorder.samples(samples)
        metrics: dict[str, Any] = {}
        if actors:
            bar.phase(rollout_id, "train")
            progress.training()
            metrics, times["time/actor_call"] = timed(actors.train, samples, rollout_id)
            if rollouts.has_engines and _due(rollout_id, job.sync.update_weights_interval):
                version = rollout_id + 1
                bar.phase(rollout_id, "sync weights")
                recorder.result.weights_dir, times["time/weight_sync"] = timed(weights.sync, rollouts, version)
                metrics |= weights.last  # weight_sync/transport, weight_sync/mb_per_s, ...
        if rollouts.has_engines and (last or _due(rollout_id, job.eval.eval_interval)):
            bar.phase(rollout_id, "evaluate")
            evals, times["time/eval"] = timed(rollouts.evaluate, held_out)
            metrics |= evals
        record = recorder.record(rollout_id, samples, metrics, times, started)  # before the checkpoint
        progress.finish(rollout_id, version, buffer if actors else None)
        if actors and (last or _due(rollout_id, job.ckpt.save_interval)):
            best = _mark_best(job, record, best)
            bar.phase(rollout_id, "checkpoint")
            _save(job, buffer, actors, rollout_id, version)
            progress.saved = rollout_id
        recorder.shown(record)


def _datasets(job: JobConfig) -> tuple[PromptDataset, dict[str, PromptDataset]]:
    """Training prompts and each held-out set by name, tokenized.

    The model's stop tokens are checked first (a response must be able to end before --rollout-max-response-len),
    and the chat template when it is applied.
    """
    from tidal.rollout import check_stop_tokens
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(job.actor.hf_checkpoint)
    check_stop_tokens(  # no EOS the tokenizer can produce and no stop: an error here, before any process starts
        job.actor.hf_checkpoint,
        job.rollout.rollout_stop_token_ids,
        stop_strings=job.rollout.rollout_stop,
        vocab_size=len(tokenizer),
    )
    train = job.train
    keys = {"input_key": train.input_key, "label_key": train.label_key, "seed": train.seed, "tool_key": train.tool_key}
    if job.rollout.agent_function_path and not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "--agent-function-path (and --environment) needs a chat template (the gateway renders the agent's "
            f"messages with it), and the tokenizer of {job.actor.hf_checkpoint} has none: use a checkpoint whose "
            "tokenizer ships one"
        )
    if job.rollout.apply_chat_template:
        from tidal.rollout import check_chat_template

        check_chat_template(tokenizer)  # a missing or broken template stops here, before any process starts
        keys["apply_chat_template"] = True
    train_data = PromptDataset(train.prompt_data, tokenizer, **keys, metadata_key=train.metadata_key)
    check_prompt_chat_template(train_data.raw_texts, tokenizer, apply_chat_template=job.rollout.apply_chat_template)
    sets = held_out_sets(job.eval.eval_prompt_data, train.prompt_data)
    return train_data, {
        name: PromptDataset(path, tokenizer, **keys, metadata_key=train.metadata_key, flag="--eval-prompt-data")
        for name, path in sets
    }


def _resume(job: JobConfig, rollouts: RolloutManager, buffer: RolloutBuffer, actors: ActorGroup | None, metrics_log):
    """Load ``--load`` into the actor, the carry-over into the manager and the buffer; ``(first rollout, version)``."""
    start, version = job.train.start_rollout_id or 0, 0
    state = actors.load() if actors else None
    if state is not None:
        start = state.rollout_id + 1 if job.train.start_rollout_id is None else job.train.start_rollout_id
        version = state.weight_version
        rollouts.restore_carry(state.rollout_carry)  # partial rollout's unfinished groups: nothing is dropped
        buffer.restore(state.rollout_buffer, start)  # rollouts generated ahead and not trained on yet
        if state.rollout_id < 0:  # an SFT stage's checkpoint: its weights and optimizer, no rollout yet
            logger.info("starting from %s (no rollout done: an SFT checkpoint)", job.ckpt.load, extra=TERMINAL)
        else:
            resumed = "resumed from %s: rollout %d done; going on at rollout %d"
            logger.info(resumed, job.ckpt.load, state.rollout_id, start, extra=TERMINAL)
    dropped = metrics_log.truncate(start)
    if dropped:
        logger.info("metrics.jsonl: dropped %d record(s) of rollouts >= %d (they run again)", dropped, start)
    return start, version


def _serve_first_weights(job: JobConfig, rollouts: RolloutManager, weights: WeightSync | None, version: int):
    """Before the first rollout the engines serve --load's weights, or an external server the initial ones.

    --load's are a resumed run's, or an SFT stage's (version 0: no rollout trained them).
    """
    if rollouts.has_engines and weights is not None and (version > 0 or job.ckpt.load):
        return weights.sync(rollouts, version)
    if rollouts.external:  # a server run elsewhere may hold any weights
        logger.info("loading %s into the external SGLang server(s)", job.actor.hf_checkpoint)
        rollouts.load_weights(job.actor.hf_checkpoint, 0)
    return None


def _save(job: JobConfig, buffer: RolloutBuffer, actors: ActorGroup, rollout_id: int, version: int) -> None:
    """Megatron checkpoint (trainer state, rollout carry-over and buffer) and, with --save-hf, an HF copy."""
    carry, buffered = buffer.checkpoint_state()
    actors.save(rollout_id, weight_version=version, carry=carry, buffer=buffered)
    if job.train.save_hf:
        actors.save_hf(job.train.save_hf.replace("{rollout_id}", str(rollout_id)))


def _best_so_far(job: JobConfig, history: list[dict]) -> float | None:
    """--keep-best-by's value at the iteration a resumed run's best_checkpointed_iteration.txt names (None: none)."""
    if job.ckpt.keep_best_by is None or not job.ckpt.save:
        return None
    from tidal.ckpt import best_iteration

    iteration = best_iteration(job.ckpt.save)
    return next((r.get(job.ckpt.keep_best_by) for r in history if r["rollout"] + 1 == iteration), None)


def _mark_best(job: JobConfig, record: dict, best: float | None) -> float | None:
    """Name the checkpoint about to be saved the best when --keep-best-by's metric beats ``best``; the new best."""
    value = record.get(job.ckpt.keep_best_by) if job.ckpt.keep_best_by else None
    if value is None or (best is not None and value <= best):
        return best
    from tidal.ckpt import mark_best_iteration

    mark_best_iteration(job.ckpt.save, record["rollout"] + 1)  # the iteration rollout r is saved as
    logger.info("best %s so far: %.4f (checkpoint iteration %d)", job.ckpt.keep_best_by, value, record["rollout"] + 1)
    return value


def _due(rollout_id: int, interval: int | None) -> bool:
    """Whether rollout ``rollout_id`` ends an interval of ``interval`` rollouts (never when it is 0 or None)."""
    return bool(interval) and (rollout_id + 1) % interval == 0


def timed(fn, *args, **kwargs) -> tuple[Any, float]:
    """``(fn(*args, **kwargs), seconds)``."""
    tick = time.monotonic()
    return fn(*args, **kwargs), time.monotonic() - tick
