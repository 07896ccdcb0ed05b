"""Pack variable-length sequences into one flat (THD / varlen) batch, and split per-token outputs back.

No padding goes between sequences: attention kernels see the boundaries through ``cu_seqlens``. Padding is only
appended at the end, when the caller asks for a total length that is a multiple of some number (hardware
alignment, sequence parallelism); that tail is its own segment, so no real token ever attends to it.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Mapping, Sequence

import numpy as np
import torch
from tidal.batching.types import PackedBatch

logger = logging.getLogger(__name__)


def _concat(seqs: Sequence, total: int, dtype: torch.dtype) -> torch.Tensor:
    """Concatenate a list of lists / tensors / arrays into one 1-D tensor of ``dtype``."""
    if total == 0:
        return torch.zeros(0, dtype=dtype)
    if all(isinstance(s, torch.Tensor) for s in seqs):
        return torch.cat([s.reshape(-1).to(dtype) for s in seqs])
    if all(isinstance(s, np.ndarray) for s in seqs):
        return torch.from_numpy(np.concatenate([np.asarray(s).reshape(-1) for s in seqs])).to(dtype)
    np_dtype = torch.empty(0, dtype=dtype).numpy().dtype
    flat = np.fromiter(
        itertools.chain.from_iterable(s.tolist() if hasattr(s, "tolist") else s for s in seqs),
        dtype=np_dtype,
        count=total,
    )
    return torch.from_numpy(flat)


def _pack_field(name: str, values: Sequence, real: int, total: int) -> torch.Tensor:
    """One token field, 0 on the padding tail: float32 ``[total]``, or ``[total, *shape]``.

    The latter when each sequence's values are ``[n, *shape]`` arrays or tensors (e.g. per-token expert ids).
    """
    first = next((v for v in values if hasattr(v, "ndim")), None)
    if first is None or first.ndim <= 1:
        field = torch.zeros(total, dtype=torch.float32)
        field[:real] = _concat(values, real, torch.float32)
        return field
    shape = tuple(first.shape[1:])
    rows = [torch.as_tensor(np.asarray(v)).to(torch.float32) for v in values]
    if any(tuple(r.shape[1:]) != shape for r in rows):
        raise ValueError(f"token_fields[{name!r}]: every sequence's values must be [tokens, *{shape}]")
    field = torch.zeros(total, *shape, dtype=torch.float32)
    field[:real] = torch.cat(rows)
    return field


def _check_lengths(name: str, values: Sequence, lengths: list[int]) -> None:
    if len(values) != len(lengths):
        raise ValueError(
            f"{name} has {len(values)} entries but there are {len(lengths)} sequences; pass one per sequence"
        )
    for i, (v, n) in enumerate(zip(values, lengths, strict=True)):
        if len(v) != n:
            raise ValueError(f"{name}[{i}] has {len(v)} values but sequence {i} has {n} tokens; they must match")


def _default_loss_mask(lengths: torch.Tensor, starts: torch.Tensor, total: int) -> torch.Tensor:
    # Every token counts except each sequence's first, which has no prediction (see the log-prob convention).
    mask = torch.ones(total, dtype=torch.float32)
    mask[starts[lengths > 0]] = 0.0
    return mask


def _sample_tensor(name: str, values: Sequence[float] | torch.Tensor, n: int) -> torch.Tensor:
    t = torch.as_tensor(values)
    if t.dim() != 1 or t.shape[0] != n:
        raise ValueError(f"sample_fields[{name!r}] must have one value per sequence ({n}), got shape {tuple(t.shape)}")
    if t.is_floating_point():
        return t.to(torch.float32)
    return t.to(torch.int64) if t.dtype != torch.bool else t


def pack(
    sequences: Sequence[Sequence[int]],
    *,
    loss_masks: Sequence[Sequence[int]] | None = None,
    token_fields: Mapping[str, Sequence[Sequence[float]]] | None = None,
    sample_fields: Mapping[str, Sequence[float]] | None = None,
    sample_indices: Sequence[int] | None = None,
    pad_to_multiple_of: int = 1,
) -> PackedBatch:
    """Concatenate sequences into one :class:`PackedBatch` (no padding between them).

    Args:
        sequences: token ids of each sequence (lists, 1-D tensors or arrays), each non-empty.
        loss_masks: per-token 0/1 of each sequence; default 1 everywhere except each sequence's first token
            (which has no prediction under the log-prob convention).
        token_fields: per-token float values of each sequence, by name (e.g. ``"old_log_probs"``); a sequence's
            values may also be an ``[n, *shape]`` array or tensor (the field is then ``[T, *shape]``).
        sample_fields: one value per sequence, by name (e.g. ``"rewards"``).
        sample_indices: index of each sequence in the caller's sample list; default ``0..n-1``.
        pad_to_multiple_of: pad the total length up to a multiple of this (a padding tail segment).

    Returns:
        The packed batch; padding tokens have id 0, loss mask 0 and token fields 0.

    Raises:
        ValueError: on empty input, an empty sequence, or a field whose lengths do not match the sequences.
    """
    if pad_to_multiple_of < 1:
        raise ValueError(f"pad_to_multiple_of must be >= 1, got {pad_to_multiple_of}")
    n = len(sequences)
    if n == 0:
        raise ValueError("pack() needs at least one sequence, got none")
    lengths_list = [len(s) for s in sequences]
    if min(lengths_list) == 0:
        raise ValueError(f"sequence {lengths_list.index(0)} is empty; every packed sequence needs at least one token")
    lengths = torch.tensor(lengths_list, dtype=torch.int64)
    real = int(lengths.sum())
    pad = (-real) % pad_to_multiple_of
    total = real + pad

    seg_lengths = torch.cat([lengths, torch.tensor([pad])]) if pad else lengths
    cu_seqlens = torch.zeros(seg_lengths.numel() + 1, dtype=torch.int64)
    torch.cumsum(seg_lengths, 0, out=cu_seqlens[1:])
    starts = cu_seqlens[:-1]
    position_ids = torch.arange(total, dtype=torch.int64) - torch.repeat_interleave(starts, seg_lengths)

    tokens = torch.zeros(total, dtype=torch.int64)
    tokens[:real] = _concat(sequences, real, torch.int64)
    if loss_masks is None:
        loss_mask = _default_loss_mask(lengths, starts[:n], total)
        loss_mask[real:] = 0.0
    else:
        _check_lengths("loss_masks", loss_masks, lengths_list)
        loss_mask = torch.zeros(total, dtype=torch.float32)
        loss_mask[:real] = _concat(loss_masks, real, torch.float32)

    packed_fields: dict[str, torch.Tensor] = {}
    for name, values in (token_fields or {}).items():
        _check_lengths(f"token_fields[{name!r}]", values, lengths_list)
        packed_fields[name] = _pack_field(name, values, real, total)

    per_sample = {name: _sample_tensor(name, v, n) for name, v in (sample_fields or {}).items()}
    if sample_indices is None:
        indices = torch.arange(n, dtype=torch.int64)
    else:
        indices = torch.tensor(np.asarray(sample_indices, dtype=np.int64).reshape(-1))  # a copy, never a view
        if indices.numel() != n:
            raise ValueError(f"sample_indices has {indices.numel()} entries but there are {n} sequences")

    return PackedBatch(
        tokens=tokens,
        position_ids=position_ids,
        cu_seqlens=cu_seqlens.to(torch.int32),
        max_seqlen=int(seg_lengths.max()),
        loss_mask=loss_mask,
        token_fields=packed_fields,
        sample_fields=per_sample,
        sample_indices=indices,
        num_padding_tokens=pad,
    )


def unpack(values: torch.Tensor, batch: PackedBatch) -> list[torch.Tensor]:
    """Split per-token outputs of a packed batch back into one tensor per real sequence.

    Args:
        values: ``[T, ...]`` per-token values computed on ``batch`` (e.g. log-probs, entropy).
        batch: the batch they were computed on.

    Returns:
        ``batch.num_sequences`` views of ``values``, in packed order (``batch.sample_indices`` gives their
        positions in the caller's sample list); the padding tail is dropped.

    Raises:
        ValueError: if ``values`` is not ``T`` long.
    """
    if values.dim() == 0 or values.shape[0] != batch.num_tokens:
        raise ValueError(
            f"unpack() got values of shape {tuple(values.shape)} for a batch of {batch.num_tokens} tokens; "
            "pass the per-token outputs computed on this very batch (first dim T)"
        )
    lengths = batch.seq_lengths.tolist()
    return list(torch.split(values[: batch.num_real_tokens], lengths))
