"""Packing statistics for the trainer to log: ``dict[str, float]`` with ``batching/...`` keys."""

from __future__ import annotations

import logging

import numpy as np
from tidal.batching.partition import MicroBatchPlan, cp_padded_lengths

logger = logging.getLogger(__name__)


def token_stats(real: np.ndarray, computed: np.ndarray, *, token_budget: int | None = None) -> dict[str, float]:
    """Statistics of a ``[dp_size, num_micro_batches]`` grid of real and computed (padded) token counts.

    Args:
        real: tokens of real sequences per micro-batch.
        computed: tokens the hardware computes per micro-batch (real plus padding).
        token_budget: the per-micro-batch limit, if any (adds ``batching/budget_fill``).

    Returns:
        ``batching/efficiency`` (real / computed), ``batching/num_micro_batches`` (per rank),
        ``batching/tokens_per_micro_batch/{mean,min,max}``, ``batching/real_tokens``, ``batching/padding_tokens``,
        ``batching/rank_imbalance`` (busiest rank's computed tokens / mean - 1), ``batching/budget_fill``.
    """
    real = np.asarray(real, dtype=np.float64)
    computed = np.asarray(computed, dtype=np.float64)
    per_rank = computed.sum(axis=1)
    stats = {
        "batching/efficiency": float(real.sum() / computed.sum()),
        "batching/num_micro_batches": float(computed.shape[1]),
        "batching/tokens_per_micro_batch/mean": float(computed.mean()),
        "batching/tokens_per_micro_batch/min": float(computed.min()),
        "batching/tokens_per_micro_batch/max": float(computed.max()),
        "batching/real_tokens": float(real.sum()),
        "batching/padding_tokens": float(computed.sum() - real.sum()),
        "batching/rank_imbalance": float(per_rank.max() / per_rank.mean() - 1.0),
    }
    if token_budget:
        stats["batching/budget_fill"] = float(computed.mean() / token_budget)
    return stats


def plan_stats(
    plan: MicroBatchPlan, *, pad_to_multiple_of: int = 1, context_parallel_size: int = 1
) -> dict[str, float]:
    """Statistics of a plan, counting the padding that packing and context parallelism will add.

    Args:
        plan: the plan.
        pad_to_multiple_of: alignment multiple of each micro-batch (on each GPU).
        context_parallel_size: context-parallel size (each sequence padded to a multiple of ``2 * cp``).

    Returns:
        See :func:`token_stats`; counts are full-sequence tokens (a GPU computes ``1 / cp`` of them).
    """
    real = plan.tokens()
    planned = cp_padded_lengths(plan.lengths, context_parallel_size)
    cum = np.zeros((plan.dp_size, plan.sample_indices.shape[1] + 1), dtype=np.int64)
    np.cumsum(planned[plan.sample_indices], axis=1, out=cum[:, 1:])
    computed = np.diff(np.take_along_axis(cum, plan.boundaries, axis=1), axis=1)
    m = pad_to_multiple_of * context_parallel_size
    computed = -(-computed // m) * m
    return token_stats(real, computed, token_budget=plan.token_budget)
