"""The driver's side of a weight sync: hand the actor's current weights to the engines, checked and bounded.

:class:`WeightSync` owns the protocol of every transport (disk: export a version folder and have the engines load
it; tensor and nccl: each pipeline stage's sender pushes its buckets, one stage after another), the version check,
the --check-weight-update-equal probe and the sync's metrics. It drives the actor's ranks through the actor group's
fan-out and the engines through two narrow protocols: :class:`EngineWeights` (what any engine set offers: load,
targets, version, probe) and :class:`ServingEngines` (the whole rollout side, which also releases memory, holds
requests during an update and restarts dead servers).
"""

from __future__ import annotations

import logging
import shutil
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from tidal.train.weight_sync.adapter import AdapterSync

if TYPE_CHECKING:
    from tidal.train.actor_group import ActorGroup
    from tidal.train.handoff import HandOffLog
    from tidal.train.weight_sync.plan import SyncPlan

logger = logging.getLogger(__name__)


class EngineWeights(Protocol):
    """Engines that take the actor's weights (every engine of the job, or only those restarted)."""

    def load_weights(self, path: str | Path, version: int) -> None:
        """Serve the HF checkpoint at ``path`` as weight version ``version``."""

    def weight_targets(self, timeout_s: float) -> list[dict[str, Any]]:
        """Per engine: URL, API key, TP size (what the actor's rank 0 sends tensors or broadcasts to)."""

    def check_weight_version(self, version: int) -> None:
        """Raise unless every engine reports ``version``."""

    def probe(self) -> list[list[tuple[list[int], list[float]]]]:
        """Per engine, ``(tokens, response log-probs)`` of the fixed probe prompts."""

    def serve_adapter(self, name: str, version: int, path: str | None = None) -> None:
        """--lora-rank: serve LoRA adapter ``name`` as ``version`` (``path``: load it from that PEFT folder first)."""


class ServingEngines(EngineWeights, Protocol):
    """The rollout side as a whole: its engines also release memory, hold requests and restart."""

    def resume_memory(self, tags: list[str]) -> None:
        """Re-allocate the engines' released ``tags`` (nothing when none is released)."""

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
    """Where and how the actor writes the weights it hands to the engines over the disk transport."""

    root: Path
    """Folder of the versions (``RUN/weights``); only the newest one is kept."""
    max_shard_bytes: int
    """Bytes per safetensors shard (--update-weight-buffer-size)."""


class WeightSync:
    """Weight syncs of one job from its actor group to its engines, following one :class:`SyncPlan`."""

    def __init__(
        self, plan: SyncPlan, export: WeightExport, actors: ActorGroup, handoff: HandOffLog, *, pipeline_stages: int
    ) -> None:
        """Sync ``actors``' weights as ``plan`` says; disk versions go under ``export.root``."""
        self.plan, self.export, self.actors, self.handoff = plan, export, actors, handoff
        self.pipeline_stages = pipeline_stages
        self.served_dir: Path | None = None
        """The version folder the engines serve now (None until the first disk export, and on in-memory transports)."""
        self.last: dict[str, Any] = {}
        """Metrics of the latest sync: ``weight_sync/transport``, ``weight_sync/mb_per_s``, ... (the loop records
        them)."""
        self._group: tuple[str, list] | None = None  # --update-weight-transport nccl: (group name, its engines)
        self.adapters = AdapterSync(plan, export, actors) if plan.adapter is not None else None
        """--lora-rank: the adapter-only sync (``.adapter``), which every sync and resync goes through."""
        self._delta = None
        if plan.delta:
            from tidal.train.weight_sync.delta import DeltaSync

            self._delta = DeltaSync(self)

    def sync(self, engines: ServingEngines, version: int) -> Path | None:
        """Hand the current weights to ``engines`` as ``version`` over --update-weight-transport; checked, bounded.

        With --offload-rollout the engines get their weights' memory back first and their KV cache after; with
        --offload-train the actor leaves the GPU at the end. Every engine must then report ``version``. The
        sync's metrics are in :attr:`last`. Returns the folder the engines loaded (disk) or None.

        Raises:
            RolloutError: An engine refused, timed out (--update-weight-timeout) or reports another version.
        """
        with self.actors.lock:
            try:
                return self._sync(engines, version)
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
                self.close()  # the group counts the dead server's ranks
                target = self._sync(engines, version, retry=True)
                engines.weights_restored(restarted)
                return target

    def _sync(self, engines: ServingEngines, version: int, *, retry: bool = False) -> Path | None:
        plan, tick = self.plan, time.monotonic()
        engines.resume_memory(["weights"])
        metrics: dict[str, Any] = {}
        target = None
        engines.begin_update()  # generation does not hold the update up: its requests resume after it
        try:
            if self.adapters is not None:
                metrics, target = self.adapters.sync(engines, version)
            elif self._delta is not None:
                metrics = self._delta.send(engines, version)
            elif plan.transport == "disk":
                target = self._sync_disk(engines, version)
            else:
                metrics = self._sync_in_memory(engines, version)
        finally:
            engines.end_update()
        self.handoff.add(f"sync.{plan.transport}", version=version, **({"retry": 1} if retry else {}))
        engines.check_weight_version(version)
        engines.resume_memory(["kv_cache"])
        seconds = time.monotonic() - tick
        mb = metrics.get("weight_sync/mb") or _exported_mb(target)
        metrics |= {"weight_sync/transport": plan.transport, "weight_sync/mb": mb, "weight_sync/mb_per_s": mb / seconds}
        if plan.check_equal:
            metrics |= self._check_equal(engines, version)
        if plan.offload_train:
            metrics |= self.actors.offload()
        self.last = metrics
        self.actors.version = version
        return target

    def resync(self, engines: EngineWeights) -> dict[str, Any]:
        """Give restarted ``engines`` the ranks' current weights as the actor group's version (fault tolerance).

        A restarted SGLang server serves the weights it loads from disk (the initial checkpoint); the weights the
        others got as tensors or by broadcast exist only in the actor. Same transport as every sync (nccl: a fresh
        group with the restarted engines, torn down after, so that the next sync builds one with every engine), same
        version check and --check-weight-update-equal probe; an offloaded actor comes onto the GPU for it and
        leaves again. Returns the sync's metrics.

        Raises:
            RolloutError: An engine refused, timed out or reports another version, or the probe differs.
        """
        actors = self.actors
        with actors.lock:
            version, plan, offloaded = actors.version, self.plan, actors.offloaded
            if offloaded:
                actors.onload()
            self.close()  # nccl: the group still counts the dead server's ranks
            if self._delta is not None:
                self._delta.forget()  # the restarted engines get the actor's current weights, not the snapshot's
            if self.adapters is not None:
                metrics = self.adapters.resync(engines, version)
            elif plan.transport == "disk":
                kept = self.served_dir is not None and self.served_dir.name == f"v{version:06d}"
                target = self.served_dir if kept else self._export(version)  # the others may serve the old one
                engines.load_weights(target, version)
                metrics: dict[str, Any] = {}
            else:
                metrics = self._sync_in_memory(engines, version)
                self.close()
            self.handoff.add(f"resync.{plan.transport}", version=version)
            engines.check_weight_version(version)
            if plan.check_equal:
                metrics |= self._check_equal(engines, version)
            if offloaded:
                actors.offload()
            return metrics

    def close(self) -> None:
        """Tear down the nccl transport's groups (one per pipeline stage) on the engines; errors are only logged.

        Every sender tears its own group down at once (local on every side: nothing waits on a peer); the engines
        keep serving.
        """
        if self._group is None:
            return
        name, targets = self._group
        self._group = None
        try:
            self.actors.call_all("close_weight_group", targets, name, timeout=60)
        except Exception as e:  # the engines may be gone already: nothing left to tear down
            logger.warning("could not close the weight-update group(s) %s: %s", name, e)

    def _export(self, version: int) -> Path:
        """Write the current weights for the engines as ``RUN/weights/vVERSION`` (an HF checkpoint)."""
        target = self.export.root / f"v{version:06d}"
        self.actors.call_all("save_hf", str(target), self.export.max_shard_bytes)
        return target

    def _sync_disk(self, engines: EngineWeights, version: int) -> Path:
        """Export the weights, have ``engines`` serve them, then delete the version served before."""
        previous, target = self.served_dir, self._export(version)
        engines.load_weights(target, version)
        self.served_dir = target
        if previous is not None and previous != target:
            shutil.rmtree(previous, ignore_errors=True)
        return target

    def _sync_in_memory(self, engines: EngineWeights, version: int) -> dict[str, float]:
        plan, call = self.plan, self.actors.call_all
        targets = engines.weight_targets(plan.timeout_s)
        if plan.transport == "tensor":
            tp = max(t["tp_size"] for t in targets)
            # A CUDA IPC handle opens only on a GPU the engine sees, and Ray gives each engine its own GPUs alone: on
            # GPU every stage's tensors go to rank 0 first (the PP broadcast of the export), which sends them all.
            stages = [None] if self.actors.on_gpu else self._stages()
            return self._stages_in_turn(
                stages, lambda stage, left: call("sync_tensor", targets, str(version), plan.bucket_bytes, tp, stage,
                                                 timeout=left),
            )  # fmt: skip
        name = self._weight_group(targets)
        return self._stages_in_turn(
            self._stages(), lambda stage, left: call("sync_broadcast", targets, str(version), plan.bucket_bytes, name,
                                                     left, stage, timeout=left),
        )  # fmt: skip

    def _weight_group(self, targets: list[dict[str, Any]]) -> str:
        """The nccl transport's groups (one per pipeline stage) with ``targets``, formed unless they are; the name."""
        if self._group is None:
            name = f"tidal_weights_{uuid.uuid4().hex[:8]}"  # a server another run used may still hold its group
            self._group = (name, targets)
            try:
                for stage in self._stages():
                    self.actors.call_all("init_weight_group", targets, name, self.plan.timeout_s, stage,
                                         timeout=self.plan.timeout_s)  # fmt: skip
            except Exception:
                self.close()  # the groups of the stages formed before the failure
                raise
        return self._group[0]

    def _stages(self) -> list[int | None]:
        """The pipeline stages that send their own tensors, in order ([None]: rank 0 sends the whole model)."""
        return [None] if self.pipeline_stages == 1 else list(range(self.pipeline_stages))

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

    def _check_equal(self, engines: EngineWeights, version: int) -> dict[str, float]:
        """--check-weight-update-equal: the engines' and the actor's log-probs of the same probe tokens."""
        from tidal.rollout import RolloutError
        from tidal.train.weight_sync.probe import probe_gap

        samples = engines.probe()
        actor_lps = self.actors.call_all("probe_log_probs", [tokens for per in samples for tokens, _ in per])[0]
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


def _exported_mb(target: Path | None) -> float:
    return sum(f.stat().st_size for f in target.glob("*.safetensors")) / 2**20 if target else 0.0
