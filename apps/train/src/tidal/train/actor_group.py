"""The actor's ranks behind one handle: train on a rollout, hand the weights to the engines, save and load.

Every rank is an ``ActorWorker`` Ray actor on its placement bundle, and every call here fans out to all of them and
waits (the ranks run one collective program: a call that reached only some would hang). It lives in the app, not
in tidal-actor, because it is the seam between two packages and Ray: tidal-actor knows one rank and no Ray,
tidal-placement knows bundles and no model, and only the app may join them.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import ray
from tidal.train.workers import ActorWorker, RolloutData

if TYPE_CHECKING:
    from tidal.ckpt import TrainerState
    from tidal.train.config import JobConfig

logger = logging.getLogger(__name__)


class WeightsConsumer(Protocol):
    """What serves the weights the actor exports (the rollout manager)."""

    def load_weights(self, path: str | Path, version: int) -> None:
        """Serve the HF checkpoint at ``path`` as weight version ``version``."""


@dataclass(frozen=True, kw_only=True, slots=True)
class WeightExport:
    """Where and how the actor writes the weights it hands to the engines."""

    root: Path
    """Folder of the versions (``RUN/weights``); only the newest one is kept."""
    max_shard_bytes: int
    """Bytes per safetensors shard (--update-weight-buffer-size)."""


class ActorGroup:
    """All ranks of the actor; built by :meth:`start`, ready after :meth:`wait_ready`, stopped by :meth:`kill`."""

    def __init__(self, job: JobConfig, weights: WeightExport) -> None:
        """Describe the group; no rank starts until :meth:`start`."""
        self.job = job
        self.weights = weights
        self.workers: list = []
        self.weights_dir: Path | None = None
        """The version the engines serve now (None until the first export)."""

    def start(self, placement) -> None:
        """Create one ``ActorWorker`` per actor GPU in its bundle; returns before the models are built."""
        job = self.job
        world = job.placement.num_actor_gpus
        if world == 0:
            return
        rendezvous = placement.rendezvous()
        for rank in range(world):
            self.workers.append(
                ActorWorker.options(**placement.actor_options(rank)).remote(
                    job.actor,
                    job.batching,
                    job.ckpt,
                    rank=rank,
                    world_size=world,
                    master_addr=rendezvous.master_addr,
                    master_port=rendezvous.master_port,
                    seed=job.train.seed,
                    tensor_model_parallel_size=job.train.tensor_model_parallel_size,
                    context_parallel_size=job.train.context_parallel_size,
                    pipeline_model_parallel_size=job.train.pipeline_model_parallel_size,
                )
            )

    def wait_ready(self) -> None:
        """Wait until every rank built (and loaded) its model."""
        self._all("ready")

    def __len__(self) -> int:
        """Number of ranks (a group without ranks is falsy: nothing trains)."""
        return len(self.workers)

    def train(self, samples: Sequence) -> dict[str, float]:
        """Old log-probs, advantages and the optimizer steps of one rollout; the rollout's train metrics."""
        return self._all("train", rollout_data(samples, self.job.rollout.n_samples_per_prompt))[0]

    def load(self) -> TrainerState | None:
        """Load --load into every rank; the trainer state saved with it (None without --load).

        The driver's own RNG states come back too, unless --no-load-rng.
        """
        if not self.job.ckpt.load:
            return None
        from tidal.ckpt import TrainerState

        state = TrainerState.from_dict(self._all("load_checkpoint")[0])
        if state.rng_state is not None and not self.job.ckpt.no_load_rng:
            state.restore_rng()
        return state

    def save(
        self, rollout_id: int, *, weight_version: int, carry: list | None = None, buffer: list | None = None
    ) -> None:
        """Checkpoint model, optimizer, RNG and the trainer state (rollout carry-over and buffer) into --save."""
        from tidal.ckpt import TrainerState

        state = TrainerState.capture(
            rollout_id=rollout_id,
            weight_version=weight_version,
            data_seed=self.job.train.seed,
            rollout_carry=carry,
            rollout_buffer=buffer,
        )
        self._all("save_checkpoint", rollout_id + 1, state.to_dict())

    def save_hf(self, out_dir: str | Path) -> None:
        """Write the current weights as an HF checkpoint (--save-hf)."""
        self._all("save_hf", str(out_dir))

    def finalize_saves(self) -> None:
        """Wait until a pending --async-save is durable and published."""
        self._all("finalize_saves")

    def export_weights(self, version: int) -> Path:
        """Write the current weights for the engines as ``RUN/weights/vVERSION`` (an HF checkpoint)."""
        target = self.weights.root / f"v{version:06d}"
        self._all("save_hf", str(target), self.weights.max_shard_bytes)
        return target

    def sync_weights(self, engines: WeightsConsumer, version: int) -> Path:
        """Export the weights, have ``engines`` serve them as ``version``, then delete the version served before."""
        previous, target = self.weights_dir, self.export_weights(version)
        engines.load_weights(target, version)
        self.weights_dir = target
        if previous is not None and previous != target:
            shutil.rmtree(previous, ignore_errors=True)
        return target

    def kill(self) -> None:
        """Stop every rank's process."""
        for worker in self.workers:
            ray.kill(worker, no_restart=True)

    def _all(self, method: str, *args: Any) -> list:
        return ray.get([getattr(worker, method).remote(*args) for worker in self.workers])


def rollout_data(samples: Sequence, group_size: int) -> RolloutData:
    """What the ranks train on, from scored samples: tidal's log-prob convention puts 0 on the prompt tokens."""
    return RolloutData(
        tokens=[s.tokens for s in samples],
        loss_masks=[s.loss_mask for s in samples],
        rollout_log_probs=[[0.0] * len(s.prompt_ids) + list(s.response_log_probs) for s in samples],
        rewards=[float(s.reward) for s in samples],
        group_size=group_size,
    )
