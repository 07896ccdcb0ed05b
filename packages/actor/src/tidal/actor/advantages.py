"""Advantage estimators (``--advantage-estimator``): per-sample, per-token (REINFORCE++) and GAE (PPO's critic).

Samples of one prompt are consecutive (a *group*); every group has ``group_size`` samples unless ``group_ids``
gives each sample's group (groups of different sizes). The token-level estimators work on packed micro-batches
(:class:`tidal.batching.PackedBatch`): sample boundaries come from ``cu_seqlens`` and only loss-mask tokens count.
"""

from __future__ import annotations

import itertools

import torch
from tidal.actor.transfer import to_device

ADVANTAGE_ESTIMATORS = (
    "grpo", "gspo", "cispo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "ppo",
    "on_policy_distillation",
)  # fmt: skip
TOKEN_LEVEL_ESTIMATORS = ("reinforce_plus_plus", "reinforce_plus_plus_baseline")
"""Estimators whose advantages are per token (KL in the reward, whitened over the rollout's tokens)."""
WHITEN_EPS = 1e-8


def _group_ids(rewards: torch.Tensor, group_size: int, group_ids: torch.Tensor | None) -> torch.Tensor:
    if group_ids is not None:
        if group_ids.shape != rewards.shape:
            raise ValueError(f"group_ids must have rewards' shape {tuple(rewards.shape)}, got {tuple(group_ids.shape)}")
        return torch.unique(group_ids, return_inverse=True)[1]
    if group_size < 1:
        raise ValueError(f"--n-samples-per-prompt must be >= 1, got {group_size}")
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(
            f"advantages need a 1-D rewards tensor whose length is a multiple of group_size={group_size}, "
            f"got shape {tuple(rewards.shape)}"
        )
    return torch.arange(rewards.numel()) // group_size


def _group_stats(rewards: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each sample's group size, group mean and group (unbiased) std, as ``[N]`` tensors."""
    num = int(ids.max()) + 1 if ids.numel() else 0
    count = torch.zeros(num).index_add_(0, ids, torch.ones_like(rewards))
    mean = torch.zeros(num).index_add_(0, ids, rewards) / count
    sq = torch.zeros(num).index_add_(0, ids, (rewards - mean[ids]).square())
    std = (sq / (count - 1).clamp(min=1)).sqrt()
    return count[ids], mean[ids], std[ids]


def grpo_advantages(
    rewards: torch.Tensor, group_size: int, *, normalize_std: bool = True, group_ids: torch.Tensor | None = None
) -> torch.Tensor:
    """Group-relative advantages: each reward minus its group's mean (optionally over the group's std).

    Args:
        rewards: ``[N]`` one scalar reward per sample.
        group_size: samples per prompt (``--n-samples-per-prompt``); ``N`` must be a multiple of it.
        normalize_std: divide by the group's (unbiased) std plus 1e-6, as GRPO does; False is Dr.GRPO.
        group_ids: ``[N]`` each sample's group (any labels); replaces ``group_size`` (groups of any size).

    Returns:
        float32 ``[N]`` advantages (0 for a group whose rewards are all equal, or of one sample).

    Raises:
        ValueError: ``group_size < 1`` or ``N`` not a multiple of it.
    """
    rewards = rewards.float()
    count, mean, std = _group_stats(rewards, _group_ids(rewards, group_size, group_ids))
    centered = rewards - mean
    if normalize_std:
        centered = torch.where(count > 1, centered / (std + 1e-6), centered)
    return centered


def compute_advantages(
    rewards: torch.Tensor,
    group_size: int,
    *,
    estimator: str = "grpo",
    normalize_std: bool = True,
    group_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-sample advantages of one rollout by ``--advantage-estimator`` (the token-level ones: their reward term).

    - ``grpo``, ``gspo``, ``cispo``: reward minus the group mean, over the group std unless ``normalize_std``
      is False (``--disable-grpo-std-normalization``, Dr.GRPO); gspo and cispo differ in the loss only.
    - ``rloo``: reward minus the mean of the *other* samples of its group (leave-one-out baseline; 0 alone).
    - ``reinforce_plus_plus``: the reward itself (the KL penalty, discounting and whitening are per token:
      :func:`token_advantages`).
    - ``reinforce_plus_plus_baseline``: reward minus the group mean (then per token, :func:`token_advantages`).
    - ``ppo``: the reward itself (GAE with the critic's values is per token: :func:`gae_advantages`).
    - ``on_policy_distillation``: 0 (the teacher's per-token term is the whole advantage; the trainer adds it).

    Raises:
        ValueError: an unknown estimator (naming the flag), or rewards that do not form whole groups.
    """
    if estimator not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"--advantage-estimator must be one of {ADVANTAGE_ESTIMATORS}, got {estimator!r}")
    rewards = rewards.float()
    ids = _group_ids(rewards, group_size, group_ids)
    if estimator in ("reinforce_plus_plus", "ppo"):
        return rewards
    if estimator == "on_policy_distillation":
        return torch.zeros_like(rewards)
    if estimator in ("grpo", "gspo", "cispo"):
        return grpo_advantages(rewards, group_size, normalize_std=normalize_std, group_ids=ids)
    count, mean, _ = _group_stats(rewards, ids)
    centered = rewards - mean
    if estimator == "rloo":  # r - (sum - r) / (n - 1) == (r - mean) * n / (n - 1)
        return torch.where(count > 1, centered * count / (count - 1).clamp(min=1), torch.zeros_like(centered))
    return centered


def overlong_penalty(
    response_lengths: torch.Tensor, *, max_response_len: int, buffer_len: int, penalty_factor: float
) -> torch.Tensor:
    """DAPO's soft overlong punishment: ``min(-(len - (L_max - L_buffer)) / L_buffer * factor, 0)`` per sample.

    0 up to ``L_max - L_buffer`` tokens, falling linearly to ``-factor`` at ``L_max`` (verl's formula). Added to
    the reward before the advantages.
    """
    if buffer_len <= 0:
        return torch.zeros(response_lengths.shape)
    exceed = response_lengths.float() - (max_response_len - buffer_len)
    return (-exceed / buffer_len * penalty_factor).clamp(max=0.0)


def _segments(cu_seqlens: torch.Tensor, num_tokens: int) -> torch.Tensor:
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    ids = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
    if ids.numel() != num_tokens:
        raise ValueError(f"cu_seqlens covers {ids.numel()} tokens, the batch has {num_tokens}")
    return ids


def sequence_mean(values: torch.Tensor, loss_mask: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Each token gets the mean of ``values`` over its sequence's loss tokens (differentiable; 0 without any).

    The sequence ids are built on the host from ``cu_seqlens`` and sent without a host wait (``to_device``).
    """
    ids = to_device(_segments(cu_seqlens.cpu(), values.numel()), values.device)
    num = cu_seqlens.numel() - 1
    mask = loss_mask.to(values.dtype)
    sums = torch.zeros(num, dtype=values.dtype, device=values.device).index_add(0, ids, values * mask)
    counts = torch.zeros(num, dtype=values.dtype, device=values.device).index_add(0, ids, mask)
    return (sums / counts.clamp(min=1))[ids]


def token_advantages(
    sample_term: torch.Tensor,
    kl: torch.Tensor | None,
    loss_mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    estimator: str,
    kl_coef: float,
    gamma: float = 1.0,
) -> torch.Tensor:
    """Un-whitened REINFORCE++ advantages of one packed micro-batch (``[T]``; 0 off the loss mask).

    - ``reinforce_plus_plus``: token rewards ``r_t = -kl_coef * kl_t``, plus the sample's reward on its last
      loss token; the advantage is the discounted return ``G_t = sum_{s >= t} gamma^(s - t) r_s`` over the
      sample's loss tokens.
    - ``reinforce_plus_plus_baseline``: ``A_t = (reward - group mean) - kl_coef * kl_t`` (no discounting).

    Args:
        sample_term: ``[T]`` :func:`compute_advantages`' value of each token's sample, broadcast to its tokens.
        kl: ``[T]`` per-token KL to the reference (``old - ref`` log-probs), or None (no penalty).
        loss_mask: ``[T]`` 0/1.
        cu_seqlens: sequence boundaries of the packed batch.
        estimator: one of :data:`TOKEN_LEVEL_ESTIMATORS`.
        kl_coef: ``--kl-coef``.
        gamma: ``--gamma`` discount.
    """
    mask = loss_mask.float()
    penalty = _kl_penalty(kl, mask, kl_coef)
    if estimator == "reinforce_plus_plus_baseline":
        return (sample_term.float() + penalty) * mask
    if estimator != "reinforce_plus_plus":
        raise ValueError(f"token_advantages handles {TOKEN_LEVEL_ESTIMATORS}, got {estimator!r}")
    returns = torch.zeros_like(mask)
    bounds = cu_seqlens.tolist()
    for start, end in itertools.pairwise(bounds):
        positions = torch.nonzero(mask[start:end]).flatten() + start
        if positions.numel() == 0:
            continue
        rewards = penalty[positions].tolist()
        rewards[-1] += float(sample_term[positions[-1]])
        if gamma == 1.0:  # reverse cumulative sum
            values = torch.tensor(rewards).flip(0).cumsum(0).flip(0)
        else:  # G_t = r_t + gamma * G_{t+1}, in Python floats (no tensor op per token)
            running, out = 0.0, [0.0] * len(rewards)
            for k in range(len(rewards) - 1, -1, -1):
                running = rewards[k] + gamma * running
                out[k] = running
            values = torch.tensor(out)
        returns[positions] = values.float()
    return returns


def _kl_penalty(kl: torch.Tensor | None, mask: torch.Tensor, kl_coef: float) -> torch.Tensor:
    return -kl_coef * kl.float() * mask if kl is not None else torch.zeros_like(mask)


def gae_advantages(
    sample_term: torch.Tensor,
    kl: torch.Tensor | None,
    values: torch.Tensor,
    loss_mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    kl_coef: float,
    gamma: float,
    lambd: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016) of one packed micro-batch: ``(advantages, returns)``.

    Each sample's loss tokens are its time steps ``t = 0 .. n-1`` (tokens off the loss mask, e.g. a tool's
    answer inside a multi-turn response, are skipped). Token rewards are ``r_t = -kl_coef * kl_t``, plus the
    sample's reward on its last loss token; ``V_t`` is the critic's value of the state before token ``t``
    (``values[t]`` in tidal's token convention) and ``V_n = 0`` (the episode ends). Then
    ``delta_t = r_t + gamma * V_{t+1} - V_t``, ``A_t = delta_t + gamma * lambd * A_{t+1}`` and the critic's
    target ``returns_t = A_t + V_t``. Both are ``[T]`` float32, 0 off the loss mask; the advantages are not yet
    whitened (:func:`whiten`, over the whole rollout).

    Args:
        sample_term: ``[T]`` each token's sample reward (:func:`compute_advantages` with ``ppo``).
        kl: ``[T]`` per-token KL to the reference (``old - ref`` log-probs), or None (no penalty).
        values: ``[T]`` the critic's values before the update (``old_values``).
        loss_mask: ``[T]`` 0/1.
        cu_seqlens: sequence boundaries of the packed batch.
        kl_coef: ``--kl-coef``.
        gamma: ``--gamma`` discount.
        lambd: ``--lambd``, GAE's lambda (1: Monte-Carlo returns minus the value; 0: one-step TD error).
    """
    mask = loss_mask.float()
    penalty = _kl_penalty(kl, mask, kl_coef)
    advantages, returns = torch.zeros_like(mask), torch.zeros_like(mask)
    for start, end in itertools.pairwise(cu_seqlens.tolist()):
        positions = torch.nonzero(mask[start:end]).flatten() + start
        if positions.numel() == 0:
            continue
        rewards = penalty[positions].tolist()
        rewards[-1] += float(sample_term[positions[-1]])
        v = values[positions].float().tolist()
        out, running, next_value = [0.0] * len(rewards), 0.0, 0.0
        for k in range(len(rewards) - 1, -1, -1):  # Python floats: no tensor op per token
            running = rewards[k] + gamma * next_value - v[k] + gamma * lambd * running
            out[k], next_value = running, v[k]
        adv = torch.tensor(out)
        advantages[positions] = adv
        returns[positions] = adv + torch.tensor(v)
    return advantages, returns


def explained_variance_sums(values: torch.Tensor, returns: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """``[count, sum R, sum R^2, sum (R - V), sum (R - V)^2]`` over loss tokens (float64), to add across batches."""
    mask = loss_mask.double()
    r, e = returns.double() * mask, (returns.double() - values.double()) * mask
    return torch.stack([mask.sum(), r.sum(), (r * r).sum(), e.sum(), (e * e).sum()])


def explained_variance(sums: torch.Tensor) -> float:
    """``1 - Var(R - V) / Var(R)`` from :func:`explained_variance_sums` totals.

    1: the critic predicts the returns; 0: no better than their mean; NaN when the returns do not vary.
    """
    count = float(sums[0].clamp(min=1))
    var_r = float(sums[2]) / count - (float(sums[1]) / count) ** 2
    var_e = float(sums[4]) / count - (float(sums[3]) / count) ** 2
    return 1.0 - var_e / var_r if var_r > 1e-12 else float("nan")


def whiten_sums(values: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """``[count, sum, sum of squares]`` of ``values`` over loss tokens (float64), to add across batches/ranks."""
    mask = loss_mask.double()
    v = values.double() * mask
    return torch.stack([mask.sum(), v.sum(), (v * values.double()).sum()])


def whiten(values: torch.Tensor, loss_mask: torch.Tensor, sums: torch.Tensor) -> torch.Tensor:
    """``(v - mean) / sqrt(var + 1e-8)`` on loss tokens (0 elsewhere), mean/var from :func:`whiten_sums` totals.

    The variance is the population (biased) one over every loss token of the rollout, as slime's masked whitening.
    """
    count = float(sums[0].clamp(min=1))
    mean = float(sums[1]) / count
    var = max(float(sums[2]) / count - mean * mean, 0.0)
    return (values.float() - mean) / (var + WHITEN_EPS) ** 0.5 * loss_mask.float()
