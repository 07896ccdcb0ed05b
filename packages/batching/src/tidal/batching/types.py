"""Frozen data types that cross package boundaries: the packed (THD / varlen) micro-batch."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PackedBatch:
    """Variable-length sequences concatenated into one flat token stream (no padding between them).

    Attributes:
        tokens: int64 ``[T]``: sequences concatenated, plus alignment padding at the end, if any.
        position_ids: int64 ``[T]``: restart at 0 at each segment start (the padding tail too).
        cu_seqlens: int32 ``[num_segments + 1]``: segment boundaries; a padding tail is its own last segment.
        max_seqlen: longest segment (padding tail included, as varlen attention kernels need).
        loss_mask: float32 ``[T]``: 1 on tokens that count in the loss (response tokens), 0 elsewhere and on padding.
        token_fields: float32 ``[T]`` (or ``[T, *shape]``) each, aligned with ``tokens`` (e.g. ``"old_log_probs"``).
        sample_fields: ``[num_sequences]`` each (e.g. ``"rewards"``); float32 for floats, int64 for ints.
        sample_indices: int64 ``[num_sequences]``: index of each packed sequence in the caller's sample list.
        num_padding_tokens: alignment padding tokens at the end of ``tokens``.
    """

    tokens: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int
    loss_mask: torch.Tensor
    token_fields: dict[str, torch.Tensor]
    sample_fields: dict[str, torch.Tensor]
    sample_indices: torch.Tensor
    num_padding_tokens: int

    @property
    def num_sequences(self) -> int:
        """Number of real sequences (the padding tail is not one)."""
        return int(self.sample_indices.numel())

    @property
    def num_tokens(self) -> int:
        """Total tokens computed, padding included (``T``)."""
        return int(self.tokens.numel())

    @property
    def num_real_tokens(self) -> int:
        """Tokens that belong to real sequences (``T - num_padding_tokens``)."""
        return self.num_tokens - self.num_padding_tokens

    @property
    def seq_lengths(self) -> torch.Tensor:
        """int64 ``[num_sequences]``: length of each real sequence."""
        return torch.diff(self.cu_seqlens[: self.num_sequences + 1]).to(torch.int64)
