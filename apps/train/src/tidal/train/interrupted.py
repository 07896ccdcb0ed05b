"""What a Ctrl-C (or SIGTERM) in the middle of a run keeps, and the command that goes on from it.

The loop reports each rollout's end to :class:`Progress`. When the run is interrupted, :func:`save_on_interrupt`
checkpoints the newest finished rollout unless a checkpoint of it exists already: the actor's weights and optimizer
as they were when that rollout ended, the partial-rollout carry-over and the buffered rollouts. It does so only while
the actor still holds that rollout's state (an interrupt during a training step or a weight sync leaves the actor
past it: the last checkpoint stands). The save is bounded in time, a second Ctrl-C skips it, and a checkpoint cut
short is never published (tidal.ckpt writes it aside and renames it). :func:`resume_command` then prints the exact
command that resumes from the newest checkpoint in ``--save``.
"""

from __future__ import annotations

import logging
import shlex
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

SAVE_ON_INTERRUPT_S = 300.0
"""How long the save on the way out may take (waiting for a rollout being generated ahead included)."""

PER_RUN_FLAGS = ("--load", "--output-dir", "--start-rollout-id", "--overwrite-output-dir")
"""Flags the resume command sets itself (their values in the interrupted command are dropped)."""
_WITHOUT_VALUE = {"--overwrite-output-dir"}


@dataclass
class Progress:
    """Where the loop is: the newest finished rollout, the newest checkpointed one, and whether the actor holds it."""

    finished: int
    """The newest rollout whose training, weight sync, evaluation and record are done (-1: none yet)."""
    saved: int
    """The newest rollout a checkpoint in --save holds (-1: none)."""
    version: int
    """The weight version the engines served when ``finished`` ended."""
    actor_at_finished: bool = True
    """False from the start of a training step until its rollout is finished."""
    state: tuple[list | None, list | None] | None = None
    """``(carry-over, buffered rollouts)`` as they were when ``finished`` ended (the synchronous loop only)."""

    def training(self) -> None:
        """The actor starts to train on the next rollout: its state moves past ``finished``."""
        self.actor_at_finished = False

    def finish(self, rollout_id: int, version: int, buffer) -> None:
        """Rollout ``rollout_id`` is done; a synchronous loop's carry-over is taken now (nothing generates)."""
        self.finished, self.version, self.actor_at_finished = rollout_id, version, True
        self.state = buffer.checkpoint_state() if buffer is not None and buffer.max_staleness == 0 else None


def save_on_interrupt(job, buffer, actors, progress: Progress) -> None:
    """Checkpoint ``progress.finished`` on the way out when no checkpoint holds it and the actor still does."""
    if actors is None or progress.finished < 0 or progress.saved >= progress.finished:
        if actors is not None and progress.saved >= 0 and job.ckpt.async_save:
            _finalize(actors)
        return
    if not progress.actor_at_finished:
        logger.warning(
            "interrupted while the actor trained on or synced rollout %d: its weights are past rollout %d, so no "
            "checkpoint is written on the way out",
            progress.finished + 1,
            progress.finished,
        )
        return
    rollout_id = progress.finished
    logger.warning(
        "interrupted: saving rollout %d's checkpoint into %s before stopping (at most %.0f s; Ctrl-C again skips it)",
        rollout_id,
        job.ckpt.save,
        SAVE_ON_INTERRUPT_S,
    )
    try:
        state = progress.state or buffer.checkpoint_state(timeout=SAVE_ON_INTERRUPT_S)
        if state is None:
            logger.warning("no checkpoint on the way out: a rollout was generated for over %.0f s", SAVE_ON_INTERRUPT_S)
            return
        carry, buffered = state
        actors.save(
            rollout_id, weight_version=progress.version, carry=carry, buffer=buffered, timeout=SAVE_ON_INTERRUPT_S
        )
        if job.ckpt.async_save:
            _finalize(actors)
        progress.saved = rollout_id
    except KeyboardInterrupt:
        logger.warning("Ctrl-C again: rollout %d's checkpoint was skipped (nothing half-written is kept)", rollout_id)
    except Exception as e:  # the ranks died with the interrupt, or the save timed out: the last checkpoint stands
        logger.warning("rollout %d's checkpoint could not be written on the way out: %s", rollout_id, e)


def _finalize(actors) -> None:
    """A pending --async-save is published before the processes stop."""
    try:
        actors.finalize_saves()
    except (KeyboardInterrupt, Exception) as e:
        logger.warning("the pending --async-save could not be finished on the way out: %r", e)


def resume_command(argv: list[str], job) -> str:
    """One line: the command that resumes from the newest complete checkpoint in --save, or that none exists."""
    from tidal.ckpt import resolve_checkpoint

    save = Path(job.ckpt.save)
    try:
        iteration, _ = resolve_checkpoint(save, flag="--save")
    except Exception:  # no checkpoint (or none complete) in --save
        if job.ckpt.load:
            return f"no new checkpoint was written: the same command goes on from --load {job.ckpt.load}"
        return "no checkpoint was written: the same command starts the run over"
    kept = _without(argv, PER_RUN_FLAGS)
    command = shlex.join(["uv", "run", "train", *kept, "--load", str(save), "--output-dir", job.train.output_dir])
    done = "rollout 0 is" if iteration == 1 else f"rollouts 0-{iteration - 1} are"
    return f"{done} checkpointed in {save}; go on at rollout {iteration} with: {command}"


def _without(argv: list[str], flags: tuple[str, ...]) -> list[str]:
    """``argv`` less each of ``flags`` (each as a separate value or joined by "=")."""
    out, skip = [], False
    for token in argv:
        if skip:
            skip = False
            continue
        name = token.split("=", 1)[0]
        if name in flags:
            skip = "=" not in token and name not in _WITHOUT_VALUE
            continue
        out.append(token)
    return out
