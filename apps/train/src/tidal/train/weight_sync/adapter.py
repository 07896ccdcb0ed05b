"""Adapter-only weight sync (--lora-rank): the engines serve the frozen base and take only the LoRA adapter.

The engines start on the base model with LoRA serving on (``tidal.rollout.lora_server_args``). Each sync loads the
actor's current adapter under a new versioned name and makes every engine serve it (its weight version, the name
every ``/generate`` gives as ``lora_path``, the unload of older adapters: ``tidal.rollout.ServedAdapters``):

* tensor transport (co-located): the actor's rank 0 gathers the adapter and hands it to each engine as tensor
  handles (``/load_lora_adapter_from_tensors``), in the model's dtype: ``weight_sync/mb`` is the adapter's size;
* disk: the actor writes a PEFT folder (``RUN/weights/lora_vVERSION``) and each engine loads it; only the newest
  folder is kept.

SGLang takes adapters by no broadcast, so the nccl transport cannot carry them: a decoupled job (the engines on
other GPUs) syncs its adapter over disk, and an explicit ``--update-weight-transport nccl`` is refused.
"""

from __future__ import annotations

import logging
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tidal.train.actor_group import ActorGroup
    from tidal.train.weight_sync.plan import SyncPlan
    from tidal.train.weight_sync.sync import EngineWeights, WeightExport

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class AdapterPlan:
    """What the engines must be able to serve: adapters of ``rank`` on ``target_modules``."""

    rank: int
    """--lora-rank (the servers' --max-lora-rank)."""
    target_modules: tuple[str, ...]
    """HF names of the adapted modules (--lora-target-modules, resolved; the servers' --lora-target-modules)."""

    def server_args(self, given: tuple[str, ...] = ()) -> tuple[str, ...]:
        """The ``sglang.launch_server`` flags of LoRA serving that ``given`` (the user's --sglang-*) does not set."""
        from tidal.rollout import lora_server_args

        return lora_server_args(self.rank, self.target_modules, given=given)


def resolve_adapter_transport(actor, given: str | None, transport: str) -> tuple[AdapterPlan | None, str]:
    """``(adapter plan or None, transport)`` of a job: with --lora-rank the adapter moves by tensors or disk.

    ``given``: --update-weight-transport as passed (None: resolved from the placement to ``transport``).

    Raises:
        ValueError: --update-weight-transport nccl with --lora-rank (SGLang loads adapters by no broadcast).
    """
    if actor is None or not actor.lora_rank:
        return None, transport
    if given == "nccl":
        raise ValueError(
            f"--update-weight-transport nccl with --lora-rank {actor.lora_rank}: SGLang loads LoRA adapters from "
            "tensors or from disk, not by broadcast; use --update-weight-transport disk (or tensor when co-located)"
        )
    from tidal.actor import resolve_target_modules

    plan = AdapterPlan(rank=actor.lora_rank, target_modules=resolve_target_modules(actor.lora_target_modules))
    return plan, "disk" if transport == "nccl" else transport


class AdapterSync:
    """The adapter half of :class:`~tidal.train.weight_sync.WeightSync`: one job's adapter loads, named per load."""

    def __init__(self, plan: SyncPlan, export: WeightExport, actors: ActorGroup) -> None:
        """Sync ``actors``' adapters as ``plan`` says; disk folders go under ``export.root``."""
        self.plan, self.export, self.actors = plan, export, actors
        self.name: str | None = None
        """The adapter the engines serve now (None: the base, before the first sync)."""
        self.folder: Path | None = None
        """The PEFT folder of the served adapter (disk transport)."""

    def sync(self, engines: EngineWeights, version: int) -> tuple[dict[str, float], Path | None]:
        """Load the actor's adapter into ``engines`` under a new name and serve it as ``version``.

        Returns the sender's metrics (tensor transport) and the PEFT folder the engines loaded (disk).
        """
        from tidal.rollout import adapter_name

        name = adapter_name(version, uuid.uuid4().hex[:8])  # a sync that runs again must not reuse a loaded name
        metrics, folder = self._load(engines, name, version, reuse_folder=False)
        previous, self.name, self.folder = self.folder, name, folder
        if previous is not None and previous != folder:
            shutil.rmtree(previous, ignore_errors=True)
        return metrics, folder

    def resync(self, engines: EngineWeights, version: int) -> dict[str, float]:
        """Give restarted ``engines`` (they hold no adapter) the one the others serve, under the same name."""
        if self.name is None:  # no sync yet: every engine serves the base
            return {}
        metrics, _ = self._load(engines, self.name, version, reuse_folder=True)
        return metrics

    def _load(
        self, engines: EngineWeights, name: str, version: int, *, reuse_folder: bool
    ) -> tuple[dict[str, float], Path | None]:
        plan, call = self.plan, self.actors.call_all
        if plan.transport == "tensor":
            targets = engines.weight_targets(plan.timeout_s)
            tp = max(t["tp_size"] for t in targets)
            sent = call("sync_adapter_tensor", targets, name, tp, timeout=plan.timeout_s)
            engines.serve_adapter(name, version)
            return next((m for m in sent if m), {}), None
        folder = self.folder if reuse_folder and self.folder is not None else self.export.root / f"lora_v{version:06d}"
        if not (reuse_folder and folder.exists()):
            call("save_hf", str(folder), timeout=plan.timeout_s)  # with LoRA: the adapter as a PEFT folder
        engines.serve_adapter(name, version, str(folder))
        return {}, folder


class AdapterSender:
    """The adapter-sync method of a trainer rank (mixed into ``ActorWorker``, beside ``WeightSender``)."""

    rank: int
    actor: Any
    hf_checkpoint: str

    def sync_adapter_tensor(self, targets: list[dict[str, Any]], name: str, tp_size: int) -> dict:
        """Gather the adapter (every rank takes part) and hand it to each engine from rank 0; rank 0's metrics.

        The tensors go in the model's dtype (the adapters' own), as PEFT's ``lora_A`` / ``lora_B`` names.
        """
        from tidal.actor import gather_adapter_tensors, peft_adapter_config
        from tidal.rollout import load_adapter_from_tensors
        from tidal.train.weight_sync.sender import _client

        tensors = gather_adapter_tensors(self.actor.lora)
        if self.rank != 0:
            return {}
        dtype = next(iter(self.actor.lora.parameters())).dtype
        named = [(n, t.to(dtype)) for n, t in sorted(tensors.items())]
        config = peft_adapter_config(self.actor.lora.settings, base_model=self.hf_checkpoint)
        engines = [_client(t) for t in targets]
        return load_adapter_from_tensors(engines, named, name=name, config=config, tp_size=tp_size)
