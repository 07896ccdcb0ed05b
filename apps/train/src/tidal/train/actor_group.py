"""The actor's ranks behind one handle: train on a rollout, save and load; the fan-out the weight sync drives.

Every rank is an ``ActorWorker`` Ray actor on its placement bundle, and every call here fans out to all of them and
waits (the ranks run one collective program: a call that reached only some would hang). It lives in the app, not
in tidal-actor, because it is the seam between two packages and Ray: tidal-actor knows one rank and no Ray,
tidal-placement knows bundles and no model, and only the app may join them. Handing the weights to the engines is
``tidal.train.weight_sync``'s, through :meth:`ActorGroup.call_all`.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ray
from tidal.train.logs import LogPlan
from tidal.train.workers import ActorWorker, RolloutData

if TYPE_CHECKING:
    from tidal.actor import ActorConfig
    from tidal.batching import BatchingConfig
    from tidal.ckpt import CkptConfig, TrainerState
    from tidal.train.config import ParallelConfig
    from tidal.train.handoff import HandOffLog
    from tidal.train.weight_sync import SyncPlan

logger = logging.getLogger(__name__)


class ActorGroup:
    """All ranks of the actor; built by :meth:`start`, ready after :meth:`wait_ready`, stopped by :meth:`kill`."""

    def __init__(
        self,
        actor: ActorConfig,
        batching: BatchingConfig,
        ckpt: CkptConfig,
        parallel: ParallelConfig,
        *,
        num_ranks: int,
        seed: int,
        n_samples_per_prompt: int,
        log: LogPlan,
        plan: SyncPlan,
        off_policy_correction: bool,
        handoff: HandOffLog,
    ) -> None:
        """Describe the group of ``num_ranks`` ranks (the actor GPUs); no rank starts until :meth:`start`.

        ``off_policy_correction`` is the job's ``AsyncPlan``'s: the ranks' loss uses it for --use-tis left unset.
        ``seed`` seeds initialisation and the data order; ``log`` is where the ranks' log lines go.
        """
        self.actor_cfg = dataclasses.replace(actor, use_tis=off_policy_correction)
        self.batching, self.ckpt, self.parallel = batching, ckpt, parallel
        self.num_ranks, self.seed, self.n_samples_per_prompt, self.log = num_ranks, seed, n_samples_per_prompt, log
        self.plan = plan
        self.handoff = handoff
        self.workers: list = []
        self.offloaded = False
        """Whether the ranks' parameters, gradients and optimizer state are off the GPU now (--offload-train)."""
        self.on_gpu = False
        """Whether the ranks compute on GPUs (set by :meth:`wait_ready`)."""
        self.version = 0
        """Weight version of the parameters the ranks hold now, as the loop numbers them (the last sync's, plus one
        per rollout trained since): what a restarted engine is given by :meth:`resync`."""
        # One collective program at a time, in the same order on every rank: under --max-staleness a restarted
        # engine's resync comes from the rollout producer's thread while the loop's thread trains or saves.
        self.lock = threading.RLock()
        """Held around each fan-out and by the weight sync around a whole sync."""

    def start(self, placement) -> None:
        """Create one ``ActorWorker`` per actor GPU in its bundle; returns before the models are built."""
        world, parallel = self.num_ranks, self.parallel
        if world == 0:
            return
        rendezvous = placement.rendezvous()
        for rank in range(world):
            self.workers.append(
                ActorWorker.options(**placement.actor_options(rank)).remote(
                    self.actor_cfg,
                    self.batching,
                    self.ckpt,
                    rank=rank,
                    world_size=world,
                    master_addr=rendezvous.master_addr,
                    master_port=rendezvous.master_port,
                    seed=self.seed,
                    tensor_model_parallel_size=parallel.tensor_model_parallel_size,
                    context_parallel_size=parallel.context_parallel_size,
                    pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
                    expert_model_parallel_size=parallel.expert_model_parallel_size,
                    log=self.log,
                )
            )
        if self.plan.offload_train:  # runs after each constructor, while the engines start (no-op without CUDA)
            for worker in self.workers:
                worker.reserve_offload_memory.remote()

    def wait_ready(self) -> None:
        """Wait until every rank built (and loaded) its model."""
        self.call_all("ready")
        self.on_gpu = any(self.call_all("on_gpu"))

    def __len__(self) -> int:
        """Number of ranks (a group without ranks is falsy: nothing trains)."""
        return len(self.workers)

    def train(self, samples: Sequence, rollout_id: int = 0) -> dict[str, float]:
        """Old log-probs, advantages and the optimizer steps of rollout ``rollout_id``; its train metrics.

        With --offload-train the ranks first bring their parameters, gradients and optimizer state back.
        """
        with self.lock:
            moved = self.onload() if self.plan.offload_train else {}
            data = rollout_data(
                samples,
                self.n_samples_per_prompt,
                rollout_id,
                routing_replay=self.actor_cfg.use_rollout_routing_replay,
            )
            metrics = self.call_all("train", data)[0]
            self.version += 1
            self.handoff.add("actor.train")
        return metrics | moved

    def train_sft(self, tokens: list[list[int]], loss_masks: list[list[int]]) -> dict[str, float]:
        """One SFT optimizer step on these sequences (the actor's --loss-type sft_loss); its train metrics."""
        data = RolloutData(
            tokens=tokens, loss_masks=loss_masks, rollout_log_probs=[], rewards=[0.0] * len(tokens), group_size=1
        )
        with self.lock:
            metrics = self.call_all("train", data)[0]
            self.version += 1
        return metrics

    def nll(self, tokens: list[list[int]], loss_masks: list[list[int]]) -> tuple[float, float]:
        """``(sum of -log p over the loss tokens, their count)`` of these sequences under the current weights."""
        return self.call_all("nll", tokens, loss_masks)[0]

    def load(self) -> TrainerState | None:
        """Load --load into every rank; the trainer state saved with it (None without --load).

        The driver's own RNG states come back too, unless --no-load-rng.
        """
        if not self.ckpt.load:
            return None
        from tidal.ckpt import TrainerState

        state = TrainerState.from_dict(self.call_all("load_checkpoint")[0])
        self.version = state.weight_version
        if state.rng_state is not None and not self.ckpt.no_load_rng:
            state.restore_rng()
        return state

    def save(
        self,
        rollout_id: int,
        *,
        weight_version: int,
        carry: list | None = None,
        buffer: list | None = None,
        timeout: float | None = None,
        iteration: int | None = None,
    ) -> None:
        """Checkpoint model, optimizer, RNG and the trainer state (rollout carry-over and buffer) into --save.

        ``timeout``: at most that many seconds (plus a minute for the Ray calls), else an error. ``iteration``: the
        checkpoint's number; None: ``rollout_id + 1``.
        """
        from tidal.ckpt import TrainerState

        state = TrainerState.capture(
            rollout_id=rollout_id,
            weight_version=weight_version,
            data_seed=self.seed,
            rollout_carry=carry,
            rollout_buffer=buffer,
        )
        number = rollout_id + 1 if iteration is None else iteration
        self.call_all("save_checkpoint", number, state.to_dict(), timeout=timeout)

    def save_hf(self, out_dir: str | Path) -> None:
        """Write the current weights as an HF checkpoint (--save-hf)."""
        self.call_all("save_hf", str(out_dir))

    def finalize_saves(self) -> None:
        """Wait until a pending --async-save is durable and published."""
        self.call_all("finalize_saves")

    def offload(self) -> dict[str, float]:
        """Move every rank's parameters, gradients and optimizer state off the GPU; what moved."""
        moved = self.call_all("offload")[0]
        self.offloaded = True
        self.handoff.add("actor.offload")
        return moved

    def onload(self) -> dict[str, float]:
        """Bring them back when they are off the GPU; what moved."""
        moved = self.call_all("onload")[0] if self.offloaded else {}
        self.offloaded = False
        self.handoff.add("actor.onload")
        return moved

    def kill(self) -> None:
        """Stop every rank's process."""
        for worker in self.workers:
            ray.kill(worker, no_restart=True)

    def call_all(self, method: str, *args: Any, timeout: float | None = None) -> list:
        """Call ``method`` on every rank and wait (at most ``timeout`` seconds plus a minute for the Ray calls)."""
        with self.lock:  # every rank gets the calls of both threads in the same order
            futures = [getattr(worker, method).remote(*args) for worker in self.workers]
            if timeout is None:
                return ray.get(futures)
            return self._get(method, futures, timeout)

    def _get(self, method: str, futures: list, timeout: float) -> list:
        try:
            return ray.get(futures, timeout=timeout + 60)
        except ray.exceptions.GetTimeoutError as e:
            from tidal.rollout import RolloutError

            raise RolloutError(
                f"{method} on the actor's {len(futures)} rank(s) did not finish within {timeout:.0f} s (+60 s): an "
                "engine or a rank hangs; see the engines' and workers' logs"
            ) from e


def rollout_data(
    samples: Sequence, group_size: int, rollout_id: int = 0, *, routing_replay: bool = False
) -> RolloutData:
    """What the ranks train on, from scored samples: tidal's log-prob convention puts 0 on the prompt tokens.

    Raises:
        ValueError: ``routing_replay`` (--use-rollout-routing-replay) and a sample without routed experts.
    """
    from tidal.rollout import episode_ids

    routed = [s.rollout_routed_experts for s in samples]
    missing = [i for i, r in enumerate(routed) if r is None]
    if routing_replay and missing:
        raise ValueError(
            f"--use-rollout-routing-replay: {len(missing)} of {len(samples)} samples of rollout {rollout_id} carry no "
            f"routed experts (e.g. sample {missing[0]}); generate with engines that return them (tidal launches its "
            "own with --enable-return-routed-experts, and --load-debug-rollout-data must hold them), or drop the flag"
        )
    return RolloutData(
        tokens=[s.tokens for s in samples],
        loss_masks=[s.loss_mask for s in samples],
        rollout_log_probs=[[0.0] * len(s.prompt_ids) + list(s.response_log_probs) for s in samples],
        rewards=[float(s.reward) for s in samples],
        group_size=group_size,
        rollout_id=rollout_id,
        routed_experts=None if missing else routed,
        episode_ids=episode_ids(samples),
    )
