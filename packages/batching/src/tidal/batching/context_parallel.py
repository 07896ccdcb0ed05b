"""Context-parallel split of a packed batch (Megatron's load-balanced "zigzag" layout) and its inverse.

With causal attention the end of a sequence costs more than its start, so each segment is padded to a multiple of
``2 * cp``, cut into ``2 * cp`` equal chunks, and rank ``r`` keeps chunks ``r`` and ``2 * cp - 1 - r``: every rank
gets one cheap and one expensive chunk. Each rank's shard is itself a packed layout (segments in the same order,
each ``2 / (2 * cp)`` of its padded length); ``position_ids`` are the tokens' positions in the full sequence, as
rotary embeddings need. :func:`gather_from_context_parallel` puts per-token outputs of all ranks back into the
packed batch's ``[T]`` order.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from tidal.batching.types import PackedBatch

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ContextParallelShard:
    """One context-parallel rank's part of a :class:`PackedBatch`.

    Attributes:
        tokens: int64 ``[T_local]``; 0 on context-parallel padding.
        position_ids: int64 ``[T_local]``: position of each token in its full (padded) segment.
        loss_mask: float32 ``[T_local]``; 0 on padding.
        token_fields: float32 ``[T_local]`` each, the batch's token fields; 0 on padding.
        cu_seqlens: int32 ``[S + 1]``: local segment boundaries (each local segment is two chunks).
        cu_seqlens_padded: int32 ``[S + 1]``: global segment boundaries after padding to a multiple of ``2 * cp``.
        max_seqlen: longest padded global segment.
        source_index: int64 ``[T_local]``: index of each local token in the batch's ``[T]``; -1 on padding.
        cp_size: context-parallel size.
        cp_rank: this shard's rank in the context-parallel group.
    """

    tokens: torch.Tensor
    position_ids: torch.Tensor
    loss_mask: torch.Tensor
    token_fields: dict[str, torch.Tensor]
    cu_seqlens: torch.Tensor
    cu_seqlens_padded: torch.Tensor
    max_seqlen: int
    source_index: torch.Tensor
    cp_size: int
    cp_rank: int

    @property
    def num_tokens(self) -> int:
        """Local tokens computed on this rank (``T_local``)."""
        return int(self.tokens.numel())


def _check(cp_size: int, cp_rank: int, pad_to_multiple_of: int) -> None:
    if cp_size < 1:
        raise ValueError(f"--context-parallel-size must be >= 1, got {cp_size}")
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank must be in [0, {cp_size}), got {cp_rank}")
    if pad_to_multiple_of < 1:
        raise ValueError(f"pad_to_multiple_of must be >= 1, got {pad_to_multiple_of}")


def _shard_layout(
    cu_seqlens: torch.Tensor, cp_size: int, cp_rank: int, pad_to_multiple_of: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (source index or -1, position in segment, local cu_seqlens, padded global cu_seqlens), int64."""
    seg_len = torch.diff(cu_seqlens.to(torch.int64))
    starts = cu_seqlens[:-1].to(torch.int64)
    chunk = -(-seg_len // (2 * cp_size))
    local_total = int(2 * chunk.sum())
    if local_total % pad_to_multiple_of:
        # An all-padding segment of 2 * cp * k tokens adds 2k local tokens on every rank; pick the smallest k.
        k = next(k for k in range(1, pad_to_multiple_of + 1) if (local_total + 2 * k) % pad_to_multiple_of == 0)
        chunk = torch.cat([chunk, torch.tensor([k])])
        seg_len = torch.cat([seg_len, torch.tensor([0])])
        starts = torch.cat([starts, torch.tensor([0])])
    local_len = 2 * chunk
    cu_local = torch.zeros(local_len.numel() + 1, dtype=torch.int64)
    torch.cumsum(local_len, 0, out=cu_local[1:])
    seg_id = torch.repeat_interleave(torch.arange(local_len.numel()), local_len)
    j = torch.arange(int(cu_local[-1])) - cu_local[:-1][seg_id]
    ch = chunk[seg_id]
    second = j >= ch
    offset = torch.where(second, (2 * cp_size - 1 - cp_rank) * ch + (j - ch), cp_rank * ch + j)
    source = torch.where(offset < seg_len[seg_id], starts[seg_id] + offset, torch.full_like(offset, -1))
    cu_padded = torch.zeros_like(cu_local)
    torch.cumsum(2 * cp_size * chunk, 0, out=cu_padded[1:])
    return source, offset, cu_local, cu_padded


def split_for_context_parallel(
    batch: PackedBatch, *, cp_size: int, cp_rank: int, pad_to_multiple_of: int = 1
) -> ContextParallelShard:
    """Take context-parallel rank ``cp_rank``'s zigzag shard of a packed batch.

    Args:
        batch: the packed micro-batch (pack it with ``pad_to_multiple_of=1``; alignment is applied here).
        cp_size: context-parallel size ``c``; each segment is padded to a multiple of ``2c``.
        cp_rank: rank in the context-parallel group; it keeps chunks ``cp_rank`` and ``2c - 1 - cp_rank``.
        pad_to_multiple_of: make the local token count a multiple of this (an extra all-padding segment).

    Returns:
        The shard.
    """
    _check(cp_size, cp_rank, pad_to_multiple_of)
    source, offset, cu_local, cu_padded = _shard_layout(batch.cu_seqlens, cp_size, cp_rank, pad_to_multiple_of)
    real = source >= 0
    src = source.clamp(min=0)

    def take(values: torch.Tensor) -> torch.Tensor:
        keep = real.view(-1, *[1] * (values.dim() - 1))  # a field of [T, *shape] keeps its trailing dims
        return torch.where(keep, values[src], torch.zeros((), dtype=values.dtype))

    return ContextParallelShard(
        tokens=take(batch.tokens),
        position_ids=offset,
        loss_mask=take(batch.loss_mask),
        token_fields={name: take(v) for name, v in batch.token_fields.items()},
        cu_seqlens=cu_local.to(torch.int32),
        cu_seqlens_padded=cu_padded.to(torch.int32),
        max_seqlen=int(torch.diff(cu_padded).max()),
        source_index=source,
        cp_size=cp_size,
        cp_rank=cp_rank,
    )


def gather_from_context_parallel(
    shard_values: Sequence[torch.Tensor], batch: PackedBatch, *, pad_to_multiple_of: int = 1
) -> torch.Tensor:
    """Inverse of :func:`split_for_context_parallel` for per-token outputs.

    Args:
        shard_values: ``[T_local, ...]`` values of every context-parallel rank, in rank order (e.g. from an
            all-gather over the context-parallel group).
        batch: the packed batch that was split.
        pad_to_multiple_of: the value given to :func:`split_for_context_parallel`.

    Returns:
        ``[T, ...]`` values in the batch's packed order (context-parallel padding dropped).
    """
    cp_size = len(shard_values)
    _check(cp_size, 0, pad_to_multiple_of)
    first = shard_values[0]
    out = torch.empty((batch.num_tokens, *first.shape[1:]), dtype=first.dtype, device=first.device)
    for rank, values in enumerate(shard_values):
        source = _shard_layout(batch.cu_seqlens, cp_size, rank, pad_to_multiple_of)[0].to(values.device)
        if values.shape[0] != source.numel():
            raise ValueError(
                f"context-parallel rank {rank} gave {values.shape[0]} values, its shard has {source.numel()} tokens"
            )
        real = source >= 0
        out[source[real]] = values[real]
    return out
