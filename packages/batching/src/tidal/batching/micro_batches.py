"""Build a rank's packed micro-batches from a plan, and put per-token outputs back in sample order."""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence

import numpy as np
import torch
from tidal.batching.config import BatchingConfig
from tidal.batching.errors import BatchingError
from tidal.batching.packing import pack, unpack
from tidal.batching.partition import MicroBatchPlan, plan_micro_batches
from tidal.batching.types import PackedBatch

logger = logging.getLogger(__name__)


def alignment_multiple(
    pad_to_multiple_of: int = 1, *, tensor_model_parallel_size: int = 1, sequence_parallel: bool = False
) -> int:
    """Token-count multiple a micro-batch must be padded to.

    Args:
        pad_to_multiple_of: kernel alignment asked for (e.g. 8 or 128).
        tensor_model_parallel_size: tensor-parallel size.
        sequence_parallel: sequence parallelism splits the token dimension over the tensor-parallel ranks, so the
            length must also divide by ``tensor_model_parallel_size``.

    Returns:
        The least common multiple of the requirements.
    """
    if pad_to_multiple_of < 1 or tensor_model_parallel_size < 1:
        raise ValueError(
            f"pad_to_multiple_of ({pad_to_multiple_of}) and --tensor-model-parallel-size "
            f"({tensor_model_parallel_size}) must be >= 1"
        )
    return math.lcm(pad_to_multiple_of, tensor_model_parallel_size if sequence_parallel else 1)


def plan_from_config(
    cfg: BatchingConfig,
    lengths: Sequence[int] | np.ndarray,
    *,
    dp_size: int,
    context_parallel_size: int | None = None,
    tensor_model_parallel_size: int = 1,
    sequence_parallel: bool = False,
    forward_only: bool = False,
) -> MicroBatchPlan:
    """Plan one global batch the way ``cfg`` asks (dynamic batch size or fixed micro-batch size).

    Args:
        cfg: the batching config.
        lengths: token count of each sample of the global batch (one optimizer step's samples).
        dp_size: data-parallel size.
        context_parallel_size: context-parallel size; None: ``cfg.context_parallel_size``. The token budget of a
            micro-batch is ``cfg.max_tokens_per_gpu`` times it (each GPU holds 1/CP of every sequence).
        tensor_model_parallel_size: tensor-parallel size (matters for alignment with sequence parallelism).
        sequence_parallel: whether sequence parallelism is on.
        forward_only: plan a pass that keeps no activations for backward (old or reference log-probs, critic
            values): its budget is ``cfg.log_probs_max_tokens_per_gpu`` when given (with dynamic batch size).

    Returns:
        The plan; pack each rank's part with :func:`pack_micro_batches` and the same alignment
        (:func:`alignment_multiple`).
    """
    if context_parallel_size is None:
        context_parallel_size = cfg.context_parallel_size
    multiple = alignment_multiple(
        cfg.pad_to_multiple_of,
        tensor_model_parallel_size=tensor_model_parallel_size,
        sequence_parallel=sequence_parallel,
    )
    if cfg.use_dynamic_batch_size:
        flag, budget = "--max-tokens-per-gpu", cfg.max_tokens_per_gpu
        if forward_only and cfg.log_probs_max_tokens_per_gpu is not None:
            flag, budget = "--log-probs-max-tokens-per-gpu", cfg.log_probs_max_tokens_per_gpu
        return plan_micro_batches(
            lengths,
            dp_size=dp_size,
            max_tokens_per_gpu=budget,
            context_parallel_size=context_parallel_size,
            pad_to_multiple_of=multiple,
            flag=flag,
        )
    return plan_micro_batches(
        lengths,
        dp_size=dp_size,
        micro_batch_size=cfg.micro_batch_size or 1,
        context_parallel_size=context_parallel_size,
    )


def _take(values: Sequence | torch.Tensor | np.ndarray, indices: np.ndarray) -> Sequence:
    if isinstance(values, torch.Tensor):
        return values[torch.from_numpy(indices)]
    if isinstance(values, np.ndarray):
        return values[indices]
    return [values[i] for i in indices.tolist()]


def pack_micro_batches(
    plan: MicroBatchPlan,
    rank: int,
    sequences: Sequence[Sequence[int]],
    *,
    loss_masks: Sequence[Sequence[int]] | None = None,
    token_fields: Mapping[str, Sequence[Sequence[float]]] | None = None,
    sample_fields: Mapping[str, Sequence[float]] | None = None,
    pad_to_multiple_of: int = 1,
) -> list[PackedBatch]:
    """Pack one data-parallel rank's micro-batches of a plan.

    Args:
        plan: the global batch's plan (from ``plan_micro_batches``).
        rank: data-parallel rank.
        sequences: token ids of every sample of the global batch (indexed like the planned lengths).
        loss_masks: per-token loss masks of every sample (see :func:`pack` for the default).
        token_fields: per-token fields of every sample, by name.
        sample_fields: per-sample fields of every sample, by name.
        pad_to_multiple_of: alignment multiple (see :func:`alignment_multiple`); with context parallelism give 1
            here and the alignment to ``split_for_context_parallel``.

    Returns:
        ``plan.num_micro_batches`` packed batches whose ``sample_indices`` index ``sequences``.
    """
    if not 0 <= rank < plan.dp_size:
        raise ValueError(f"rank must be in [0, {plan.dp_size}), got {rank}")
    if len(sequences) != plan.lengths.size:
        raise ValueError(f"the plan covers {plan.lengths.size} samples but {len(sequences)} sequences were given")
    out = []
    for idx in plan.micro_batches(rank):
        out.append(
            pack(
                _take(sequences, idx),
                loss_masks=None if loss_masks is None else _take(loss_masks, idx),
                token_fields={k: _take(v, idx) for k, v in (token_fields or {}).items()},
                sample_fields={k: _take(v, idx) for k, v in (sample_fields or {}).items()},
                sample_indices=idx,
                pad_to_multiple_of=pad_to_multiple_of,
            )
        )
    return out


def unpack_micro_batches(
    values: Sequence[torch.Tensor], batches: Sequence[PackedBatch], *, num_samples: int
) -> list[torch.Tensor]:
    """Per-token outputs of many packed micro-batches (any ranks, any order) back to per-sample tensors.

    Args:
        values: ``[T, ...]`` outputs of each batch (e.g. log-probs, entropy), aligned with ``batches``.
        batches: the micro-batches they were computed on, e.g. all micro-batches of all data-parallel ranks.
        num_samples: number of samples in the caller's list.

    Returns:
        One tensor per sample, in the caller's original sample order.

    Raises:
        BatchingError: if a sample is missing or appears twice.
    """
    if len(values) != len(batches):
        raise ValueError(f"got {len(values)} value tensors for {len(batches)} batches; pass one per batch")
    out: list[torch.Tensor | None] = [None] * num_samples
    for batch_values, batch in zip(values, batches, strict=True):
        for index, seq_values in zip(batch.sample_indices.tolist(), unpack(batch_values, batch), strict=True):
            if not 0 <= index < num_samples:
                raise BatchingError(f"sample index {index} is outside the {num_samples} samples")
            if out[index] is not None:
                raise BatchingError(f"sample {index} appears in more than one packed sequence")
            out[index] = seq_values
    missing = [i for i, v in enumerate(out) if v is None]
    if missing:
        raise BatchingError(f"{len(missing)} of {num_samples} samples have no outputs (first: {missing[:8]})")
    return out  # type: ignore[return-value]
