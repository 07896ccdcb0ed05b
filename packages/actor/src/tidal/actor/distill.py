"""On-policy distillation's per-token term: the teacher's log-probs in the advantage, and the KL metrics.

Each response token's advantage gains ``--teacher-kl-coef`` x (teacher log-prob - old log-prob) of its sampled
token: minus the single-sample estimate of the reverse KL, KL(student || teacher), at that position (slime's OPD
coefficient term, added to whichever per-sample estimator gave the advantage). Prompt, template and tool
tokens (loss mask 0) get nothing.
"""

from __future__ import annotations

import dataclasses

import torch
from tidal.batching import PackedBatch


def teacher_shaped(mb: PackedBatch, coef: float) -> PackedBatch:
    """The advantage plus ``coef`` x (teacher - old log-prob) on each loss token: the negative reverse KL."""
    fields = mb.token_fields
    gap = (fields["teacher_log_probs"] - fields["old_log_probs"]) * mb.loss_mask
    return dataclasses.replace(mb, token_fields={**fields, "advantages": fields["advantages"] + coef * gap})


TEACHER_KL_QUANTILES = (0.1, 0.5, 0.9)


def teacher_kl_metrics(packed: list[list[PackedBatch]]) -> dict[str, float]:
    """The per-token reverse KL to the teacher (old minus teacher log-prob) over every DP rank's loss tokens.

    Its mean, its ``TEACHER_KL_QUANTILES`` and its max; {} when the rollout has no loss token.
    """
    parts = [
        (mb.token_fields["old_log_probs"] - mb.token_fields["teacher_log_probs"])[mb.loss_mask.bool()]
        for step in packed
        for mb in step
    ]
    kl = _dp_gather(torch.cat(parts).double() if parts else torch.zeros(0, dtype=torch.float64))
    if not kl.numel():
        return {}
    quantiles = torch.quantile(kl, torch.tensor(TEACHER_KL_QUANTILES, dtype=torch.float64)).tolist()
    out = {"distill/teacher_kl/mean": float(kl.mean()), "distill/teacher_kl/max": float(kl.max())}
    out |= {f"distill/teacher_kl/p{round(q * 100)}": v for q, v in zip(TEACHER_KL_QUANTILES, quantiles, strict=True)}
    return out


def _dp_gather(values: torch.Tensor) -> torch.Tensor:
    """``values`` of every data-parallel rank, concatenated (any length per rank)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    if not dist.is_initialized() or parallel_state.get_data_parallel_world_size() == 1:
        return values
    gathered: list = [None] * parallel_state.get_data_parallel_world_size()
    dist.all_gather_object(gathered, values.cpu(), group=parallel_state.get_data_parallel_group())
    return torch.cat(gathered)
