"""The actor's ranks behind one handle: train on a rollout, hand the weights to the engines, save and load.

Every rank is an ``ActorWorker`` Ray actor on its placement bundle, and every call here fans out to all of them and
waits (the ranks run one collective program: a call that reached only some would hang). It lives in the app, not
in tidal-actor, because it is the seam between two packages and Ray: tidal-actor knows one rank and no Ray,
tidal-placement knows bundles and no model, and only the app may join them.
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import ray
from tidal.train.logs import LogPlan
from tidal.train.workers import ActorWorker, RolloutData

if TYPE_CHECKING:
    from tidal.ckpt import TrainerState
    from tidal.train.config import JobConfig
    from tidal.train.handoff import HandOffLog, SyncPlan

logger = logging.getLogger(__name__)


class WeightsConsumer(Protocol):
    """What serves the weights the actor exports (the rollout manager)."""

    def load_weights(self, path: str | Path, version: int) -> None:
        """Serve the HF checkpoint at ``path`` as weight version ``version``."""

    def weight_targets(self, timeout_s: float) -> list[dict[str, Any]]:
        """Per engine: URL, API key, TP size (what the actor's rank 0 sends tensors or broadcasts to)."""

    def check_weight_version(self, version: int) -> None:
        """Raise unless every engine reports ``version``."""

    def resume_memory(self, tags: list[str]) -> None:
        """Re-allocate the engines' released ``tags`` (nothing when none is released)."""

    def probe(self) -> list[list[tuple[list[int], list[float]]]]:
        """Per engine, ``(tokens, response log-probs)`` of the fixed probe prompts."""

    def restart_dead(self) -> list[int]:
        """Under --use-fault-tolerance, restart the engines whose server died; their indices (none: nothing died)."""

    def weights_restored(self, indices: list[int]) -> None:
        """The restarted engines ``indices`` serve the actor's weights again: they may generate."""

    def begin_update(self) -> None:
        """A sync starts: under --max-staleness the engines abort their requests in flight (they resume after)."""

    def end_update(self) -> None:
        """The sync is in: the requests :meth:`begin_update` cut resume under the new weights."""


@dataclass(frozen=True, kw_only=True, slots=True)
class WeightExport:
    """Where and how the actor writes the weights it hands to the engines."""

    root: Path
    """Folder of the versions (``RUN/weights``); only the newest one is kept."""
    max_shard_bytes: int
    """Bytes per safetensors shard (--update-weight-buffer-size)."""


class ActorGroup:
    """All ranks of the actor; built by :meth:`start`, ready after :meth:`wait_ready`, stopped by :meth:`kill`."""

    def __init__(self, job: JobConfig, weights: WeightExport, *, plan: SyncPlan, handoff: HandOffLog) -> None:
        """Describe the group; no rank starts until :meth:`start`."""
        self.job = job
        self.weights = weights
        self.plan = plan
        self.handoff = handoff
        self.workers: list = []
        self.weights_dir: Path | None = None
        """The version the engines serve now (None until the first export, and on the in-memory transports)."""
        self.last_sync: dict[str, Any] = {}
        """Metrics of the latest sync: ``weight_sync/transport``, ``weight_sync/mb_per_s``, ... (the loop records
        them)."""
        self._offloaded = False
        self._on_gpu = False  # the ranks compute on GPUs (set by wait_ready): the tensor transport sends from rank 0
        self._group: tuple[str, list] | None = None  # --update-weight-transport nccl: (group name, its engines)
        self.version = 0
        """Weight version of the parameters the ranks hold now, as the loop numbers them (the last sync's, plus one
        per rollout trained since): what a restarted engine is given by :meth:`resync`."""
        # One collective program at a time, in the same order on every rank: under --max-staleness a restarted
        # engine's resync comes from the rollout producer's thread while the loop's thread trains or saves.
        self._lock = threading.RLock()

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
                    expert_model_parallel_size=job.train.expert_model_parallel_size,
                    log=LogPlan.of_run(job.train.output_dir, job.train.verbose),
                )
            )
        if self.plan.offload_train:  # runs after each constructor, while the engines start (no-op without CUDA)
            for worker in self.workers:
                worker.reserve_offload_memory.remote()

    def wait_ready(self) -> None:
        """Wait until every rank built (and loaded) its model."""
        self._all("ready")
        self._on_gpu = any(self._all("on_gpu"))

    def __len__(self) -> int:
        """Number of ranks (a group without ranks is falsy: nothing trains)."""
        return len(self.workers)

    def train(self, samples: Sequence, rollout_id: int = 0) -> dict[str, float]:
        """Old log-probs, advantages and the optimizer steps of rollout ``rollout_id``; its train metrics.

        With --offload-train the ranks first bring their parameters, gradients and optimizer state back.
        """
        with self._lock:
            moved = self._onload()
            metrics = self._all("train", rollout_data(samples, self.job.rollout.n_samples_per_prompt, rollout_id))[0]
            self.version += 1
            self.handoff.add("actor.train")
        return metrics | moved

    def load(self) -> TrainerState | None:
        """Load --load into every rank; the trainer state saved with it (None without --load).

        The driver's own RNG states come back too, unless --no-load-rng.
        """
        if not self.job.ckpt.load:
            return None
        from tidal.ckpt import TrainerState

        state = TrainerState.from_dict(self._all("load_checkpoint")[0])
        self.version = state.weight_version
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

    def sync_weights(self, engines: WeightsConsumer, version: int) -> Path | None:
        """Hand the current weights to ``engines`` as ``version`` over --update-weight-transport; checked, bounded.

        With --offload-rollout the engines get their weights' memory back first and their KV cache after; with
        --offload-train the actor leaves the GPU at the end. Every engine must then report ``version``. The
        sync's metrics are in :attr:`last_sync`. Returns the folder the engines loaded (disk) or None.

        Raises:
            RolloutError: An engine refused, timed out (--update-weight-timeout) or reports another version.
        """
        with self._lock:
            try:
                return self._sync_weights(engines, version)
            except Exception as e:
                # A server that died during the sync (the broadcast, the version check, the probe) is restarted and
                # the sync runs again, to every engine: a death is recovered wherever it lands (--use-fault-tolerance).
                restarted = engines.restart_dead()
                if not restarted:
                    raise
                logger.warning(
                    "the weight sync of version %d failed (%s): engine(s) %s died and restarted; syncing again",
                    version, e, restarted,
                )  # fmt: skip
                self.close_weight_sync()  # the group counts the dead server's ranks
                target = self._sync_weights(engines, version, retry=True)
                engines.weights_restored(restarted)
                return target

    def _sync_weights(self, engines: WeightsConsumer, version: int, *, retry: bool = False) -> Path | None:
        plan, tick = self.plan, time.monotonic()
        engines.resume_memory(["weights"])
        metrics: dict[str, Any] = {}
        target = None
        engines.begin_update()  # generation does not hold the update up: its requests resume after it
        try:
            if plan.transport == "disk":
                target = self._sync_disk(engines, version)
            else:
                metrics = self._sync_in_memory(engines, version)
        finally:
            engines.end_update()
        self.handoff.add(f"sync.{plan.transport}", version=version, **({"retry": 1} if retry else {}))
        engines.check_weight_version(version)
        engines.resume_memory(["kv_cache"])
        seconds = time.monotonic() - tick
        mb = metrics.get("weight_sync/mb") or self._exported_mb(target)
        metrics |= {"weight_sync/transport": plan.transport, "weight_sync/mb": mb, "weight_sync/mb_per_s": mb / seconds}
        if plan.check_equal:
            metrics |= self._check_equal(engines, version)
        if plan.offload_train:
            metrics |= self._offload()
        self.last_sync = metrics
        self.version = version
        return target

    def resync(self, engines: WeightsConsumer) -> dict[str, Any]:
        """Give restarted ``engines`` the ranks' current weights as :attr:`version` (--use-fault-tolerance).

        A restarted SGLang server serves the weights it loads from disk (the initial checkpoint); the weights the
        others got as tensors or by broadcast exist only here. Same transport as every sync (nccl: a fresh group
        with the restarted engines, torn down after, so that the next sync builds one with every engine), same
        version check and --check-weight-update-equal probe; an offloaded actor comes onto the GPU for it and
        leaves again. Returns the sync's metrics.

        Raises:
            RolloutError: An engine refused, timed out or reports another version, or the probe differs.
        """
        with self._lock:
            version, plan, offloaded = self.version, self.plan, self._offloaded
            if offloaded:
                self._all("onload")
                self._offloaded = False
                self.handoff.add("actor.onload")
            self.close_weight_sync()  # nccl: the group still counts the dead server's ranks
            if plan.transport == "disk":
                kept = self.weights_dir is not None and self.weights_dir.name == f"v{version:06d}"
                target = self.weights_dir if kept else self.export_weights(version)  # the others may serve the old
                engines.load_weights(target, version)
                metrics: dict[str, Any] = {}
            else:
                metrics = self._sync_in_memory(engines, version)
                self.close_weight_sync()
            self.handoff.add(f"resync.{plan.transport}", version=version)
            engines.check_weight_version(version)
            if plan.check_equal:
                metrics |= self._check_equal(engines, version)
            if offloaded:
                self._offload()
            return metrics

    def _offload(self) -> dict[str, float]:
        moved = self._all("offload")[0]
        self._offloaded = True
        self.handoff.add("actor.offload")
        return moved

    def _sync_disk(self, engines: WeightsConsumer, version: int) -> Path:
        """Export the weights, have ``engines`` serve them, then delete the version served before."""
        previous, target = self.weights_dir, self.export_weights(version)
        engines.load_weights(target, version)
        self.weights_dir = target
        if previous is not None and previous != target:
            shutil.rmtree(previous, ignore_errors=True)
        return target

    def _sync_in_memory(self, engines: WeightsConsumer, version: int) -> dict[str, float]:
        plan = self.plan
        targets = engines.weight_targets(plan.timeout_s)
        if plan.transport == "tensor":
            tp = max(t["tp_size"] for t in targets)
            # A CUDA IPC handle opens only on a GPU the engine sees, and Ray gives each engine its own GPUs alone: on
            # GPU every stage's tensors go to rank 0 first (the PP broadcast of the export), which sends them all.
            stages = [None] if self._on_gpu else self._stages()
            return self._stages_in_turn(
                stages, lambda stage, left: self._all("sync_tensor", targets, str(version), plan.bucket_bytes, tp,
                                                      stage, timeout=left),
            )  # fmt: skip
        if self._group is None:
            name = f"tidal_weights_{uuid.uuid4().hex[:8]}"  # a server another run used may still hold its group
            self._group = (name, targets)
            try:
                for stage in self._stages():
                    self._all("init_weight_group", targets, name, plan.timeout_s, stage, timeout=plan.timeout_s)
            except Exception:
                self.close_weight_sync()  # the groups of the stages formed before the failure
                raise
        name = self._group[0]
        return self._stages_in_turn(
            self._stages(), lambda stage, left: self._all("sync_broadcast", targets, str(version), plan.bucket_bytes,
                                                          name, left, stage, timeout=left),
        )  # fmt: skip

    def _stages(self) -> list[int | None]:
        """The pipeline stages that send their own tensors, in order ([None]: rank 0 sends the whole model)."""
        size = self.job.train.pipeline_model_parallel_size
        return [None] if size == 1 else list(range(size))

    def _stages_in_turn(self, stages: list[int | None], send: Callable[[int | None, float], list]) -> dict[str, float]:
        """``send(stage, seconds left)`` for each stage, one after another, within one --update-weight-timeout.

        Each stage's first rank sends its stage's tensors (``[None]``: rank 0 sends the whole model, the other ranks
        take part in its export). One after another, never at once: an engine serves one update request at a time,
        so two stages' broadcasts at once could leave engine A inside stage 0's broadcast while engine B sits in
        stage 1's, each waiting on the other. The last stage sets the version, so an engine never reports it with
        part of the weights. Returns the senders' metrics, the plain keys summed over the stages.
        """
        from tidal.rollout import RolloutError

        plan = self.plan
        deadline, metrics = time.monotonic() + plan.timeout_s, {}
        for stage in stages:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RolloutError(
                    f"the {plan.transport} weight sync ran past --update-weight-timeout {plan.timeout_s:.0f} s before "
                    f"pipeline stage {stage} of {len(stages)} sent its tensors; raise --update-weight-timeout"
                )
            for key, value in (kv for r in send(stage, left) for kv in r.items()):
                metrics[key] = metrics.get(key, 0.0) + value  # the totals add up over the stages' senders
        return metrics

    def _check_equal(self, engines: WeightsConsumer, version: int) -> dict[str, float]:
        """--check-weight-update-equal: the engines' and the actor's log-probs of the same probe tokens."""
        from tidal.rollout import RolloutError
        from tidal.train.handoff import probe_gap

        samples = engines.probe()
        actor_lps = self._all("probe_log_probs", [tokens for per in samples for tokens, _ in per])[0]
        gap = probe_gap(samples, actor_lps)
        mean = gap["weight_sync/probe_logprob_abs_diff/mean"]
        self.handoff.add("sync.check", version=version, mean=mean)
        if not mean <= self.plan.tolerance:
            raise RolloutError(
                f"--check-weight-update-equal: after the {self.plan.transport} sync of version {version} the engines' "
                f"log-probs differ from the actor's by {mean:.4g} nats on average (max "
                f"{gap['weight_sync/probe_logprob_abs_diff/max']:.4g}), above --check-weight-update-tolerance "
                f"{self.plan.tolerance}: the engines do not serve the actor's weights"
            )
        return gap

    def _exported_mb(self, target: Path | None) -> float:
        return sum(f.stat().st_size for f in target.glob("*.safetensors")) / 2**20 if target else 0.0

    def _onload(self) -> dict[str, float]:
        if not self.plan.offload_train:
            return {}
        moved = self._all("onload")[0] if self._offloaded else {}
        self._offloaded = False
        self.handoff.add("actor.onload")
        return moved

    def close_weight_sync(self) -> None:
        """Tear down the nccl transport's groups (one per pipeline stage) on the engines; errors are only logged.

        Every sender tears its own group down at once (local on every side: nothing waits on a peer); the engines
        keep serving.
        """
        if self._group is None:
            return
        name, targets = self._group
        self._group = None
        try:
            self._all("close_weight_group", targets, name, timeout=60)
        except Exception as e:  # the engines may be gone already: nothing left to tear down
            logger.warning("could not close the weight-update group(s) %s: %s", name, e)

    def kill(self) -> None:
        """Stop every rank's process."""
        for worker in self.workers:
            ray.kill(worker, no_restart=True)

    def _all(self, method: str, *args: Any, timeout: float | None = None) -> list:
        """Call ``method`` on every rank and wait (at most ``timeout`` seconds plus a minute for the Ray calls)."""
        with self._lock:  # every rank gets the calls of both threads in the same order
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
                f"{method} on the actor's {len(futures)} rank(s) did not finish within --update-weight-timeout "
                f"{timeout:.0f} s (+60 s): an engine or a rank hangs; see the engines' logs"
            ) from e


def rollout_data(samples: Sequence, group_size: int, rollout_id: int = 0) -> RolloutData:
    """What the ranks train on, from scored samples: tidal's log-prob convention puts 0 on the prompt tokens."""
    return RolloutData(
        tokens=[s.tokens for s in samples],
        loss_masks=[s.loss_mask for s in samples],
        rollout_log_probs=[[0.0] * len(s.prompt_ids) + list(s.response_log_probs) for s in samples],
        rewards=[float(s.reward) for s in samples],
        group_size=group_size,
        rollout_id=rollout_id,
    )
