"""Context parallelism on the actor's side: shard a packed micro-batch's inputs, gather per-row outputs back.

Every context-parallel rank receives the *whole* packed micro-batch (as with CP = 1) and keeps its
zigzag shard of every sequence, via ``tidal.batching.split_for_context_parallel``. The model runs on
the shard (RoPE at the tokens' original positions, attention in ``cp_attention``), the LM head
produces one log-prob per local row, and ``gather_rows`` puts the rows of all CP ranks back into the
batch's ``[T]`` order. Every CP rank then computes the same loss from the same gathered tensor, so
the backward of the gather is just this rank's slice of the gradient (no reduction: reducing would
count it ``cp`` times); the parameter gradients of the CP ranks are then summed together with the DP
ranks' (``distributed.all_reduce_gradients`` reduces over DP x CP). Loss normalisation needs no
change: the loss-token count is that of the full micro-batches, identical on every CP rank.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.packed_seq_params import PackedSeqParams
from tidal.actor.transfer import to_device
from tidal.batching import ContextParallelShard, PackedBatch, gather_from_context_parallel, split_for_context_parallel

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ShardedInputs:
    """The model inputs of this CP rank's shard of a packed micro-batch."""

    tokens: torch.Tensor
    """int64 ``[T_local]``."""
    position_ids: torch.Tensor
    """int64 ``[T_local]``: each token's position in its full sequence."""
    packed_seq_params: PackedSeqParams
    """THD params with the *global* padded ``cu_seqlens`` (Megatron's context-parallel convention)."""
    targets: torch.Tensor
    """int64 ``[T_local]``: the token each local row predicts (the next token of the full batch)."""
    shard: ContextParallelShard
    """The shard itself (its ``source_index`` maps local rows back to the batch)."""


def context_parallel_size() -> int:
    """Size of Megatron's context-parallel group (1 when model parallel is not initialised)."""
    if not parallel_state.model_parallel_is_initialized():
        return 1
    return parallel_state.get_context_parallel_world_size()


def shard_inputs(batch: PackedBatch, device: torch.device) -> ShardedInputs:
    """This CP rank's zigzag shard of ``batch`` as model inputs, on ``device``."""
    group = parallel_state.get_context_parallel_group()
    shard = split_for_context_parallel(batch, cp_size=group.size(), cp_rank=group.rank())
    # the target of a row is the next token of the *full* sequence, which may live on another rank
    full_targets = torch.roll(batch.tokens, -1)
    real = shard.source_index >= 0
    targets = torch.where(real, full_targets[shard.source_index.clamp(min=0)], torch.zeros((), dtype=torch.int64))
    cu = to_device(shard.cu_seqlens_padded, device, torch.int32)
    params = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        cu_seqlens_q_padded=cu,
        cu_seqlens_kv_padded=cu,
        max_seqlen_q=shard.max_seqlen,
        max_seqlen_kv=shard.max_seqlen,
    )
    return ShardedInputs(
        tokens=to_device(shard.tokens, device),
        position_ids=to_device(shard.position_ids, device),
        packed_seq_params=params,
        targets=to_device(targets, device),
        shard=shard,
    )


class _GatherRows(torch.autograd.Function):
    """Per-row values of all CP ranks -> the batch's ``[T]`` order; backward keeps this rank's rows."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, batch: PackedBatch, source: torch.Tensor) -> torch.Tensor:
        group = parallel_state.get_context_parallel_group()
        local = local.contiguous()
        parts = [torch.empty_like(local) for _ in range(group.size())]
        dist.all_gather(parts, local, group=group)
        ctx.save_for_backward(source)
        return gather_from_context_parallel(parts, batch)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (source,) = ctx.saved_tensors
        real = source >= 0
        local = grad[source.clamp(min=0)]
        return torch.where(real, local, torch.zeros_like(local)), None, None


def gather_rows(local: torch.Tensor, batch: PackedBatch, shard: ContextParallelShard) -> torch.Tensor:
    """All CP ranks' per-row values ``[T_local]`` in ``batch``'s packed order ``[T]`` (differentiable).

    Every CP rank must call it (all-gather), and every CP rank must then compute the *same* loss from
    the result: the backward hands each rank its own rows' gradient without reduction.
    """
    return _GatherRows.apply(local, batch, to_device(shard.source_index, local.device))
