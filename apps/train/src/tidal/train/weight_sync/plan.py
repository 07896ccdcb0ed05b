"""The weight sync and memory hand-off a job runs, resolved once from its flags before any process starts.

Both handles follow the one :class:`SyncPlan`: the actor group (transport, buckets, bound, probe, whether the actor
leaves the GPU) and the rollout manager (whether the engines release their memory while the actor trains).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from tidal.train.weight_sync.adapter import AdapterPlan, resolve_adapter_transport

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class SyncPlan:
    """The weight sync and memory hand-off a job runs, resolved from its flags."""

    transport: str
    """"tensor", "nccl" or "disk" (--update-weight-transport, resolved)."""
    bucket_bytes: int
    """Bytes per bucket or shard (--update-weight-buffer-size)."""
    timeout_s: float
    """Bound of one sync (--update-weight-timeout)."""
    delta: bool = False
    """Send only the changed elements, against a host snapshot of what the engines hold (--update-weight-delta)."""
    check_equal: bool = False
    """Compare engine and actor log-probs on a probe after each sync (--check-weight-update-equal)."""
    tolerance: float = 0.05
    """Largest mean probe gap accepted (--check-weight-update-tolerance)."""
    offload_train: bool = False
    """The actor leaves the GPU while the engines generate."""
    offload_rollout: bool = False
    """The engines release their memory while the actor trains."""
    adapter: AdapterPlan | None = None
    """--lora-rank: each sync sends the LoRA adapter alone, which the engines serve on the base (``.adapter``)."""


def resolve_sync_plan(sync, offloading, placement, rollout, actor=None) -> SyncPlan:
    """The plan of a job's weight-sync, offload, placement and rollout sections and (--lora-rank) its actor's.

    Raises:
        ValueError: --update-weight-transport tensor without co-located engines, --offload-rollout with
            external engines (tidal does not manage the memory of a server it did not start), nccl with LoRA, or
            engines that would free their weights between syncs, or --check-weight-update-equal with
            --use-rollout-routing-replay (the actor would score the probe with no engine routing to replay).
    """
    external = bool(rollout.rollout_external_engine_addrs)
    colocated = placement.colocate and not external
    transport = sync.update_weight_transport or ("tensor" if colocated else "nccl")
    if transport == "tensor" and not colocated:
        where = "--rollout-external-engine-addrs" if external else "--no-colocate"
        raise ValueError(
            f"--update-weight-transport tensor hands the engines handles to the actor's own memory, so the engines "
            f"must share its GPUs; with {where} use --update-weight-transport nccl (or disk)"
        )
    adapter, transport = resolve_adapter_transport(actor, sync.update_weight_transport, transport)
    if sync.check_weight_update_equal and actor is not None and actor.use_rollout_routing_replay:
        raise ValueError(
            "--check-weight-update-equal with --use-rollout-routing-replay is not supported: the actor scores the "
            "check's probe with no engine routing to replay, so the run would stop after its first weight sync; drop "
            "--check-weight-update-equal (rollout/logprob_abs_diff still compares engine and actor every rollout)"
        )
    if sync.update_weight_delta and external:
        logger.warning("--update-weight-delta: the --rollout-external-engine-addrs servers must be started with "
                       "--custom-weight-loader tidal.rollout.engine_delta.load_delta")  # fmt: skip
    offload = colocated if offloading.offload is None else offloading.offload
    offload_train = offload if offloading.offload_train is None else offloading.offload_train
    offload_rollout = offload if offloading.offload_rollout is None else offloading.offload_rollout
    if offload_rollout and external:
        raise ValueError(
            "--offload-rollout (or --offload) releases the engines' memory, but --rollout-external-engine-addrs "
            "servers are run elsewhere: drop --offload-rollout"
        )
    _check_weights_kept_between_syncs(sync.update_weights_interval, offload_rollout, rollout, adapter)
    if (offload_train or offload_rollout) and not placement.colocate:
        logger.warning("--offload frees GPU memory for the other side of a co-located job; with --no-colocate it "
                       "only costs time")  # fmt: skip
    return SyncPlan(
        transport=transport,
        bucket_bytes=sync.update_weight_buffer_size,
        timeout_s=sync.update_weight_timeout,
        delta=sync.update_weight_delta,
        check_equal=sync.check_weight_update_equal,
        tolerance=sync.check_weight_update_tolerance,
        offload_train=offload_train,
        offload_rollout=offload_rollout,
        adapter=adapter,
    )


def _check_weights_kept_between_syncs(interval: int, offload_rollout: bool, rollout, adapter) -> None:
    """Engines that release their weights (memory saver) get them back from a sync, or from SGLang's host copy.

    Under --update-weights-interval N > 1 a rollout can follow one without a sync: its engines resume weights they
    freed. LoRA's engines keep a host copy of the base already (``lora_server_args``).
    """
    args = rollout.sglang_server_args
    if interval == 1 or not offload_rollout or adapter is not None or "--enable-memory-saver" not in args:
        return
    if "--enable-weights-cpu-backup" not in args:
        raise ValueError(
            f"--update-weights-interval {interval} with --offload-rollout and --sglang-enable-memory-saver: the "
            "engines free their weights while the actor trains and only a sync writes them back, so a rollout after "
            "one without a sync would sample from freed memory; add --sglang-enable-weights-cpu-backup (SGLang "
            "restores them from a host copy), pass --no-offload-rollout, or sync every rollout"
        )
