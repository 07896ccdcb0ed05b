"""Context-parallel core attention: all-gather K/V over the CP group, attend local queries to the full keys.

Each context-parallel rank holds the zigzag shard of every packed sequence (``tidal.batching``'s
``split_for_context_parallel``): a segment padded to ``L = 2 * cp * c`` tokens is cut into ``2 * cp``
chunks of ``c`` tokens and rank ``r`` keeps chunks ``r`` and ``2 * cp - 1 - r``. Megatron's THD
convention for context parallelism is followed: ``PackedSeqParams.cu_seqlens_q`` holds the *global*
padded boundaries, so each rank's local segment ``i`` has ``(cu[i + 1] - cu[i]) / cp`` tokens, and
Megatron's THD RoPE picks the zigzag positions itself.

This module all-gathers keys and values (what slime's ``--allgather-cp`` does), puts them back into
each segment's full order, and computes the local queries against the full keys with a causal mask
on the queries' true positions. The all-gather's backward sums the key/value gradients of every
rank's queries and hands each rank its own slice (reduce-scatter on NCCL; all-reduce + slice on gloo,
which has no reduce-scatter).

Memory: every rank holds the full ``K`` and ``V`` of the micro-batch for one layer at a time,
``2 * T * (groups / tp) * head_dim * bytes`` (plus the ``[heads, 2c, L]`` scores of one segment on the
SDPA path), versus ``2 * (T / cp) * ...`` blocks in flight for ring attention. With GQA the K/V are
small next to the activations (Qwen2-7B: 4 of 28 heads), so all-gather is the simple choice.
"""

from __future__ import annotations

import itertools
import logging

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig
from tidal.actor.attention import CausalCoreAttentionBase

logger = logging.getLogger(__name__)


class _AllGatherCP(torch.autograd.Function):
    """``[N, ...]`` per rank -> ``[cp, N, ...]``; backward sums the gradient over ranks, keeps this rank's slice."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        local = local.contiguous()
        parts = [torch.empty_like(local) for _ in range(group.size())]
        dist.all_gather(parts, local, group=group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        group = ctx.group
        grad = grad.contiguous()
        if dist.get_backend(group) == "nccl":
            out = torch.empty_like(grad[0])
            dist.reduce_scatter_tensor(out, grad, group=group)
            return out, None
        dist.all_reduce(grad, group=group)  # gloo has no reduce-scatter
        return grad[group.rank()].clone(), None


def all_gather_cp(local: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Differentiable all-gather of ``local [N, ...]`` over ``group``: ``[group.size(), N, ...]`` in rank order."""
    return _AllGatherCP.apply(local, group)


def zigzag_segments(cu_global: torch.Tensor, cp_size: int) -> list[tuple[int, int]]:
    """``(local_start, chunk)`` of every local segment, from the global padded boundaries.

    Raises:
        ValueError: a padded segment length is not a multiple of ``2 * cp_size``.
    """
    bounds = cu_global.tolist()
    out, local_start = [], 0
    for start, end in itertools.pairwise(bounds):
        length = end - start
        if length % (2 * cp_size):
            raise ValueError(
                f"context-parallel segment of {length} tokens is not a multiple of 2 x --context-parallel-size "
                f"{cp_size}; split the batch with tidal.batching.split_for_context_parallel"
            )
        chunk = length // (2 * cp_size)
        out.append((local_start, chunk))
        local_start += 2 * chunk
    return out


def context_parallel_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens_global: torch.Tensor,
    *,
    scale: float,
    group: dist.ProcessGroup,
) -> torch.Tensor:
    """Causal attention of this rank's zigzag queries against every rank's keys, segment by segment.

    Args:
        query: ``[T_local, heads, dim]`` this rank's tokens (its two chunks of every segment).
        key: ``[T_local, groups, dim]``.
        value: ``[T_local, groups, dim]``.
        cu_seqlens_global: int ``[segments + 1]`` padded boundaries of the full packed batch
            (``T_local * cp == cu_seqlens_global[-1]``).
        scale: softmax scale.
        group: the context-parallel process group.

    Returns:
        ``[T_local, heads, dim]``.
    """
    gathered_k = all_gather_cp(key, group)  # [cp, T_local, g, d]
    gathered_v = all_gather_cp(value, group)
    return zigzag_attention(query, gathered_k, gathered_v, cu_seqlens_global, cp_rank=group.rank(), scale=scale)


def zigzag_attention(
    query: torch.Tensor,
    gathered_key: torch.Tensor,
    gathered_value: torch.Tensor,
    cu_seqlens_global: torch.Tensor,
    *,
    cp_rank: int,
    scale: float,
) -> torch.Tensor:
    """The local part of ``context_parallel_attention``, given every rank's keys and values.

    Args:
        query: ``[T_local, heads, dim]`` rank ``cp_rank``'s tokens.
        gathered_key: ``[cp, T_local, groups, dim]`` every rank's keys, in rank order.
        gathered_value: ``[cp, T_local, groups, dim]``.
        cu_seqlens_global: padded boundaries of the full packed batch.
        cp_rank: the rank whose queries these are.
        scale: softmax scale.

    Returns:
        ``[T_local, heads, dim]``.
    """
    cp, rank = gathered_key.size(0), cp_rank
    gathered_k, gathered_v = gathered_key, gathered_value
    num_heads, num_groups = query.size(1), gathered_key.size(2)
    outputs = []
    for start, chunk in zigzag_segments(cu_seqlens_global, cp):
        if chunk == 0:
            continue
        # the full segment in position order: chunk j lives on rank j (first half) or 2cp-1-j (second half)
        pieces = []
        for j in range(2 * cp):
            owner, half = (j, 0) if j < cp else (2 * cp - 1 - j, 1)
            lo = start + half * chunk
            pieces.append((owner, lo))
        k_full = torch.cat([gathered_k[o, lo : lo + chunk] for o, lo in pieces])  # [L, g, d]
        v_full = torch.cat([gathered_v[o, lo : lo + chunk] for o, lo in pieces])
        q_pos = torch.cat(
            [
                torch.arange(rank * chunk, (rank + 1) * chunk, device=query.device),
                torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk, device=query.device),
            ]
        )
        # keys after the last query are never attended: drop them
        keep = int(q_pos[-1]) + 1
        mask = q_pos[:, None] >= torch.arange(keep, device=query.device)[None, :]
        q = query[start : start + 2 * chunk].transpose(0, 1)  # [h, 2c, d]
        k = k_full[:keep].transpose(0, 1)
        v = v_full[:keep].transpose(0, 1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=num_heads != num_groups)
        outputs.append(out.transpose(0, 1))
    return torch.cat(outputs, dim=0)


class ContextParallelCoreAttention(CausalCoreAttentionBase):
    """Megatron core-attention submodule for context parallelism over packed (THD) zigzag shards.

    Used in place of ``PackedCoreAttention`` when ``config.context_parallel_size > 1``; same
    constructor arguments and restrictions (``attention.CausalCoreAttentionBase``). Expects
    ``PackedSeqParams`` whose ``cu_seqlens_q`` are the global padded boundaries.
    """

    _name = "context-parallel attention"
    _required_pgs = ("tp", "cp")

    def __init__(self, config: TransformerConfig, *args, **kwargs) -> None:
        super().__init__(config, *args, **kwargs)
        self.cp_group = getattr(self.pg_collection, "cp", None) or parallel_state.get_context_parallel_group()
        if self.cp_group.size() != config.context_parallel_size:
            raise ValueError(
                f"context-parallel group has {self.cp_group.size()} ranks, config says "
                f"--context-parallel-size {config.context_parallel_size}"
            )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> torch.Tensor:
        """Attend this rank's queries to all ranks' keys; returns ``[T_local, heads * dim]``."""
        del attention_mask, attn_mask_type
        self._check_bias(attention_bias)
        if packed_seq_params is None or packed_seq_params.qkv_format != "thd":
            raise ValueError("context-parallel attention needs packed (THD) inputs with PackedSeqParams")
        cu = packed_seq_params.cu_seqlens_q_padded
        cu = packed_seq_params.cu_seqlens_q if cu is None else cu
        out = context_parallel_attention(query, key, value, cu, scale=self.softmax_scale, group=self.cp_group)
        return out.reshape(out.size(0), -1)
