"""The SFT stage's loop: place the actor alone, then per optimizer step: rows, train, evaluate, record, checkpoint.

The actor is the RL run's (``ActorGroup`` on Ray, Megatron-core, packed varlen micro-batches), trained on
``sft_loss``: the mean negative log-likelihood over every loss token of the step. No SGLang engine starts. A
checkpoint's trainer state says no rollout finished, so an RL run that ``--load``s it starts at rollout 0.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tidal.train.actor_group import ActorGroup
from tidal.train.config import JobConfig
from tidal.train.logs import TERMINAL
from tidal.train.metrics import MetricsLog
from tidal.train.sft_data import SftDataset, SftSample

logger = logging.getLogger(__name__)

PROGRESS_EVERY_S = 10.0
"""Seconds between two progress lines (and the first and last step always log one)."""


@dataclass(slots=True)
class SftResult:
    """What an SFT run did and where its outputs are (also written as ``summary.json``)."""

    output_dir: Path
    """The run folder."""
    checkpoint_dir: Path
    """--save."""
    num_steps: int = 0
    """Optimizer steps taken."""
    eval_before: float | None = None
    """Held-out NLL per loss token before the first step; None without --sft-eval-data."""
    eval_after: float | None = None
    """The same after the last step."""
    hf_dirs: list[str] = field(default_factory=list)
    """Each --save-hf folder written."""

    def describe(self) -> str:
        """One line for the terminal."""
        nll = "" if self.eval_before is None else f"held-out NLL {self.eval_before:.3f} -> {self.eval_after:.3f}; "
        hf = f"; HF {self.hf_dirs[-1]}" if self.hf_dirs else ""
        return f"SFT {self.num_steps} steps: {nll}checkpoint {self.checkpoint_dir}{hf}; curves {self.output_dir}"


def run_sft(job: JobConfig) -> SftResult:
    """Run the SFT stage of ``job``; every process it starts is stopped before it returns or raises."""
    from tidal.train.wandb_run import wandb_options
    from transformers import AutoTokenizer

    out = Path(job.train.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(job.actor.hf_checkpoint)
    train, sft = job.train, job.sft
    keys = {"input_key": train.input_key, "label_key": train.label_key, "tool_key": train.tool_key, "seed": train.seed}
    keys["apply_chat_template"] = job.rollout.apply_chat_template
    data = SftDataset(sft.sft_data, tokenizer, **keys)
    held_out = None
    if sft.sft_eval_data:
        held_out = SftDataset(sft.sft_eval_data, tokenizer, **keys, flag="--sft-eval-data").head(
            job.eval.num_eval_prompts
        )
    size = job.batching.rollout_batch_size
    steps_per_epoch = len(data) // size
    if steps_per_epoch == 0:
        raise ValueError(f"--sft-data holds {len(data)} rows, fewer than --global-batch-size {size}: lower it")
    result = SftResult(output_dir=out, checkpoint_dir=Path(job.ckpt.save))
    wandb = wandb_options(job, out)
    with (
        MetricsLog(out / "metrics.jsonl", tensorboard=job.logging.use_tensorboard, wandb=wandb) as log,
        _actor_alone(job, out) as actors,
    ):
        result.eval_before = _evaluate(actors, held_out)
        if held_out is not None:
            logger.info("held-out NLL before SFT: %.4f", result.eval_before, extra=TERMINAL)
        _steps(job, actors, data, held_out, log, result, steps_per_epoch=steps_per_epoch)
        if job.ckpt.async_save:
            actors.finalize_saves()
        history = log.read()
    _write_outputs(result, history)
    return result


def _steps(job, actors, data, held_out, log, result: SftResult, *, steps_per_epoch: int) -> None:
    size, total = job.batching.rollout_batch_size, steps_per_epoch * job.sft.num_epoch
    started = last_shown = time.monotonic()
    for step in range(total):
        epoch, k = divmod(step, steps_per_epoch)
        tick = time.monotonic()
        rows = [data.sample(int(i)) for i in data.order(epoch)[k * size : (k + 1) * size]]
        metrics = actors.train_sft([r.tokens for r in rows], [r.loss_mask for r in rows])
        record: dict[str, Any] = {"rollout": step, "sft/epoch": epoch, **metrics, "time/step": time.monotonic() - tick}
        last = step == total - 1
        if held_out is not None and (last or _due(step, job.eval.eval_interval)):
            record["eval/nll"] = result.eval_after = _evaluate(actors, held_out)
        log.write(record)
        result.num_steps = step + 1
        if last or _due(step, job.ckpt.save_interval):
            # no rollout finished: an RL run given this checkpoint as --load starts at rollout 0
            actors.save(-1, weight_version=0, iteration=step + 1)
            if job.train.save_hf:
                hf = job.train.save_hf.replace("{rollout_id}", str(step))
                actors.save_hf(hf)
                result.hf_dirs = [*(d for d in result.hf_dirs if d != hf), hf]
        now = time.monotonic()
        if last or step == 0 or now - last_shown >= PROGRESS_EVERY_S:
            last_shown, rate = now, (step + 1) / max(now - started, 1e-9)
            shown = f", held-out NLL {record['eval/nll']:.4f}" if "eval/nll" in record else ""
            logger.info(
                "SFT step %d/%d (epoch %d/%d): loss %.4f%s (%.2f steps/s, ETA %.0f s)",
                step + 1, total, epoch + 1, job.sft.num_epoch, metrics.get("train/sft_loss", float("nan")), shown,
                rate, (total - step - 1) / rate, extra=TERMINAL,
            )  # fmt: skip


def _evaluate(actors: ActorGroup, held_out: list[SftSample] | None) -> float | None:
    """Mean NLL per loss token of the held-out rows (None without them)."""
    if not held_out:
        return None
    total, count = actors.nll([s.tokens for s in held_out], [s.loss_mask for s in held_out])
    return total / max(count, 1.0)


def _due(step: int, interval: int | None) -> bool:
    return bool(interval) and (step + 1) % interval == 0


def _write_outputs(result: SftResult, history: list[dict[str, Any]]) -> None:
    """``summary.json`` and ``curves.png`` (train loss and held-out NLL per step)."""
    losses = [r["train/sft_loss"] for r in history if "train/sft_loss" in r]
    summary = {
        "stage": "sft",
        "num_steps": result.num_steps,
        "eval_nll_before": result.eval_before,
        "eval_nll_after": result.eval_after,
        "train_loss_first": losses[0] if losses else None,
        "train_loss_last": losses[-1] if losses else None,
        "checkpoint_dir": str(result.checkpoint_dir),
        "hf_dirs": result.hf_dirs,
    }
    (result.output_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=120)
    ax.plot([r["rollout"] + 1 for r in history if "train/sft_loss" in r], losses, label="train loss (NLL)")
    evals = [(r["rollout"] + 1, r["eval/nll"]) for r in history if "eval/nll" in r]
    if result.eval_before is not None:
        evals.insert(0, (0, result.eval_before))
        ax.plot(*zip(*evals, strict=True), marker="o", label="held-out NLL")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("NLL per loss token")
    ax.legend()
    fig.tight_layout()
    fig.savefig(result.output_dir / "curves.png")
    plt.close(fig)


@contextmanager
def _actor_alone(job: JobConfig, out: Path) -> Iterator[ActorGroup]:
    """Ray, the placement and the actor's ranks, without any engine; all stopped when the block ends."""
    from tidal.placement import create_placement, ray_session
    from tidal.train.async_plan import resolve_async_plan
    from tidal.train.cluster import actor_group_of
    from tidal.train.handoff import HandOffLog
    from tidal.train.logs import adopt_ray_logger
    from tidal.train.terminal import waiting
    from tidal.train.watchdog import stop_on_sigterm
    from tidal.train.weight_sync import resolve_sync_plan

    plan = resolve_sync_plan(job.sync, job.offload, job.placement, job.rollout, job.actor)
    async_plan = resolve_async_plan(job.train, job.rollout, job.actor)
    actors = actor_group_of(job, plan=plan, async_plan=async_plan, handoff=HandOffLog(out / "handoff.jsonl"))
    logger.info("SFT stage: actor on %d GPU(s); no engine", job.placement.num_actor_gpus, extra=TERMINAL)
    adopt_ray_logger()
    with ray_session(job.placement):
        stop_on_sigterm()  # ray.init installed its own handler
        placement = create_placement(job.placement)
        try:
            with waiting("starting the actor"):
                actors.start(placement)
                actors.wait_ready()
            yield actors
        finally:
            actors.kill()
            placement.remove()
