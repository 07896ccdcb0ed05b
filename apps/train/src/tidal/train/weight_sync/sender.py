"""The trainer rank's side of a weight sync: export its tensors in buckets and send them to the engines.

``ActorWorker`` (the Ray actor of one rank) inherits these methods; the driver's ``WeightSync`` calls them on every
rank. Rank 0 (or each pipeline stage's first rank) sends; the other ranks take part in the export (TP gathers, PP
broadcasts) and send nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import ray


class WeightSender:
    """Weight-sync methods of a trainer rank; needs ``self.rank``, ``self.actor`` and ``self.batching_cfg``."""

    rank: int
    actor: Any
    batching_cfg: Any
    weight_group: tuple[Any, str] | None = None

    def sync_tensor(
        self, targets: list[dict[str, Any]], version: str, bucket_bytes: int, tp_size: int, stage: int | None = None
    ) -> dict:
        """Hand the weights to each engine as tensors (handles, no weight bytes over HTTP); the sender's metrics.

        ``stage`` None: every rank exports the whole model (TP gather, PP broadcast) and rank 0 sends it: on GPU the
        payload is CUDA IPC handles, which open only on a GPU the engine sees. Pipeline stage ``stage`` (CPU, whose
        shared-memory handles any process on the host may send): its first rank sends its stage's tensors alone, as
        :meth:`sync_broadcast` does. Only the last part's last bucket sets ``version`` and flushes the engines' caches.
        """
        from tidal.rollout import update_weights_from_tensor

        sender = self._sender(targets, bucket_bytes, stage)
        if sender is None:
            return {}
        named, engines, last = sender
        metrics = update_weights_from_tensor(
            engines, named, bucket_bytes=bucket_bytes, weight_version=version if last else None, tp_size=tp_size,
            flush_cache=last,
        )  # fmt: skip
        return metrics | _stage_metrics(metrics, stage)

    def init_weight_group(
        self, targets: list[dict[str, Any]], group_name: str, timeout_s: float, stage: int | None = None
    ) -> None:
        """One process group with every engine rank (NCCL on GPU, gloo on CPU) for the broadcasts.

        ``stage`` None: rank 0 forms it. Pipeline stage ``stage``: that stage's first rank forms
        ``{group_name}_pp{stage}`` (the driver calls the stages one after another: each engine joins each group in
        the same order, so no two engines can wait on each other's rendezvous).
        """
        name = self._sender_group(group_name, stage)
        if name is None:
            return
        from tidal.placement import PortAllocator
        from tidal.rollout import init_weights_update_group

        address = ray.util.get_node_ip_address()
        port = PortAllocator(address).allocate(1)[0]
        engines = [_client(t) for t in targets]
        group = init_weights_update_group(
            engines, master_address=address, master_port=port, group_name=name,
            engine_tp_sizes=[t["tp_size"] for t in targets], timeout_s=timeout_s,
        )  # fmt: skip
        self.weight_group = (group, name)

    def sync_broadcast(self, targets: list[dict[str, Any]], version: str, bucket_bytes: int, group_name: str,
                       timeout_s: float, stage: int | None = None) -> dict:  # fmt: skip
        """Broadcast the weights into the weight group (bounded by ``timeout_s``); the sender's metrics, else {}.

        ``stage`` None: every rank exports the whole model (TP gather, PP broadcast) and rank 0 sends it. Pipeline
        stage ``stage``: its first rank's TP group exports that stage's tensors alone (no PP hop) and the first rank
        sends them through the stage's group. Only the last stage's last bucket sets ``version`` and flushes the
        engines' cache: an engine never reports the version with part of the weights.
        """
        from tidal.rollout import update_weights_from_distributed

        sender = self._sender(targets, bucket_bytes, stage)
        if sender is None:
            return {}
        named, engines, last = sender
        group, name = self.weight_group
        metrics = update_weights_from_distributed(
            engines, group, named, group_name=name, bucket_bytes=bucket_bytes, weight_version=version if last else None,
            timeout_s=timeout_s, flush_cache=last,
        )  # fmt: skip
        return metrics | _stage_metrics(metrics, stage)

    def close_weight_group(self, targets: list[dict[str, Any]], group_name: str) -> None:
        """Tear this rank's weight group (rank 0's, or its stage's) down on the engines and here; local, no peers."""
        if self.weight_group is None:
            return
        from tidal.rollout import destroy_weights_update_group

        (group, name), self.weight_group = self.weight_group, None
        destroy_weights_update_group([_client(t) for t in targets], group, group_name=name)

    def _sender_group(self, group_name: str, stage: int | None) -> str | None:
        """The name of the weight group this rank forms for ``stage`` (None: rank 0, the plain name); else None."""
        if stage is None:
            return group_name if self.rank == 0 else None
        from tidal.actor import stage_export_role

        own, _, sends = stage_export_role()
        return f"{group_name}_pp{stage}" if own == stage and sends else None

    def _sender(
        self, targets: list[dict[str, Any]], bucket_bytes: int, stage: int | None
    ) -> tuple[Iterator, list, bool] | None:
        """The sender's part of a sync: its buckets (a generator), a client per engine, and whether its part is last.

        ``stage`` None: rank 0 sends the whole model (the last part). Pipeline stage ``stage``: the stage's first rank
        sends the stage's own tensors. The ranks that take part in the export (TP gathers, PP broadcasts) but send
        nothing drain the generator here; they and the ranks outside the export get None.
        """
        if stage is None:
            named, sends, last = self._exported(bucket_bytes), self.rank == 0, True
        else:
            from tidal.actor import stage_export_role

            own, exports, sends = stage_export_role()
            if own != stage or not exports:
                return None
            named, last = self._exported(bucket_bytes, stage_only=True), stage == self.actor.stage.size - 1
        if not sends:
            for _ in named:
                pass
            return None
        return named, [_client(t) for t in targets], last

    def _exported(self, bucket_bytes: int, *, stage_only: bool = False):
        """``(hf_name, tensor)`` of every bucket (``stage_only``: this stage's), in the model's dtype, on its device."""
        dtype = next(iter(self.actor.params)).dtype
        for bucket in self.actor.hf_tensor_buckets(dtype=dtype, bucket_bytes=bucket_bytes, stage_only=stage_only):
            yield from bucket

    def probe_log_probs(self, tokens: list[list[int]]) -> list[list[float]]:
        """The actor's log-probs of each token list (tidal's convention: position t scores token t)."""
        from tidal.batching import pack, unpack

        batch = pack(tokens, pad_to_multiple_of=self.batching_cfg.pad_to_multiple_of)
        return [lp.tolist() for lp in unpack(self.actor.compute_log_probs(batch), batch)]


def _client(target: dict[str, Any]):
    """A client of one engine for the actor's rank 0 (weight updates go to each engine directly, never a router)."""
    from tidal.rollout import SGLangClient

    return SGLangClient(target["url"], api_key=target.get("api_key"), request_timeout_s=target["timeout_s"])


def _stage_metrics(metrics: dict[str, float], stage: int | None) -> dict[str, float]:
    """A pipeline stage's sender's metrics again under ``weight_sync/pp{stage}/`` (the driver sums the plain keys)."""
    if stage is None:
        return {}
    return {f"weight_sync/pp{stage}/{k.rsplit('/', 1)[1]}": v for k, v in metrics.items()}
