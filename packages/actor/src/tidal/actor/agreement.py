"""Engine-actor agreement: how far the engine's log-probs of the sampled tokens are from the actor's old ones.

The rollout engine (SGLang) and the actor compute the same policy with two implementations, often in two
precisions (bf16 serving, fp32 training). Their gap on the tokens the engine sampled is the off-policy error the
PPO ratio silently carries; a wrong weight mapping or a missed weight sync shows up here first. slime reports the
same figures under ``--get-mismatch-metrics``.

Per rollout, over every response token with loss (``loss_mask`` 1), with ``d = logp_actor - logp_engine``:

- ``rollout/logprob_abs_diff/mean`` and ``/max``: mean and max of ``|d|`` (nats).
- ``rollout/engine_actor_kl``: KL(engine || actor) estimated on the engine's samples with the k3 estimator,
  the mean of ``exp(d) - 1 - d`` (Schulman's, unbiased since the tokens were sampled by the engine; never
  negative, unlike the mean of ``-d``). ``d`` is clamped to [-20, 20] there, so one token cannot make it inf.
"""

from __future__ import annotations

import torch

AGREEMENT_KEYS = ("rollout/logprob_abs_diff/mean", "rollout/logprob_abs_diff/max", "rollout/engine_actor_kl")

_MAX_LOG_RATIO = 20.0


def agreement_sums(
    actor_log_probs: torch.Tensor, engine_log_probs: torch.Tensor, loss_mask: torch.Tensor
) -> torch.Tensor:
    """Partial sums of one micro-batch, to be added across micro-batches and ranks (see :func:`agreement_metrics`).

    Args:
        actor_log_probs: ``[T]`` the actor's log-prob of each token (tidal's convention).
        engine_log_probs: ``[T]`` the engine's log-prob of the same tokens (0 where it sampled none).
        loss_mask: ``[T]`` 1 on the tokens to compare (response tokens with loss), 0 elsewhere.

    Returns:
        float64 ``[4]``: sum of ``|d|``, max of ``|d|`` (0 without any token), sum of k3, number of tokens.
    """
    mask = loss_mask.to(torch.float64) > 0
    d = actor_log_probs.to(torch.float64)[mask] - engine_log_probs.to(torch.float64)[mask]
    abs_d = d.abs()
    log_ratio = d.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    k3 = torch.expm1(log_ratio) - log_ratio
    top = abs_d.max() if abs_d.numel() else torch.zeros((), dtype=torch.float64)
    return torch.stack([abs_d.sum(), top, k3.sum(), torch.tensor(float(abs_d.numel()), dtype=torch.float64)])


def combine_sums(parts: list[torch.Tensor]) -> torch.Tensor:
    """Add micro-batches' :func:`agreement_sums` (the max is taken, not added); zeros for none."""
    if not parts:  # a DP rank without a micro-batch still joins the all-reduce
        return torch.zeros(4, dtype=torch.float64)
    stacked = torch.stack(parts)
    total = stacked.sum(dim=0)
    total[1] = stacked[:, 1].max()
    return total


def all_reduce_sums(sums: torch.Tensor, *, device: torch.device | str = "cpu") -> torch.Tensor:
    """Combine :func:`agreement_sums` over the data-parallel group (each DP rank compared its own micro-batches).

    Tensor-, context- and pipeline-parallel ranks of one DP rank hold the same log-probs, so only DP adds up.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state

    if not dist.is_initialized() or parallel_state.get_data_parallel_world_size() == 1:
        return sums
    group = parallel_state.get_data_parallel_group()
    total = sums.to(device, copy=True)
    top = total[1:2].clone()
    dist.all_reduce(total, group=group)
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    total[1] = top[0]
    return total.cpu()


def agreement_metrics(sums: torch.Tensor) -> dict[str, float]:
    """The rollout's metrics (:data:`AGREEMENT_KEYS`) from its combined sums; all 0 when no token had loss."""
    abs_sum, abs_max, k3_sum, count = (float(x) for x in sums)
    n = max(count, 1.0)
    return dict(zip(AGREEMENT_KEYS, (abs_sum / n, abs_max, k3_sum / n), strict=True))
