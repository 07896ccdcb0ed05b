"""GRPO advantages and the PPO-clip policy loss with KL and entropy terms (token-level aggregation)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

KL_ESTIMATORS = ("k1", "k2", "k3")
ADVANTAGE_ESTIMATORS = ("grpo", "rloo", "reinforce_plus_plus_baseline")


def grpo_advantages(rewards: torch.Tensor, group_size: int, *, normalize_std: bool = True) -> torch.Tensor:
    """Group-relative advantages: each reward minus its group's mean (optionally over the group's std).

    Samples of one prompt are consecutive: ``rewards[g * group_size : (g + 1) * group_size]``.

    Args:
        rewards: ``[N]`` one scalar reward per sample, ``N % group_size == 0``.
        group_size: samples per prompt (``--n-samples-per-prompt``).
        normalize_std: divide by the group's (unbiased) std plus 1e-6, as GRPO does.

    Returns:
        float32 ``[N]`` advantages (0 for a group whose rewards are all equal).

    Raises:
        ValueError: ``group_size < 1`` or ``N`` not a multiple of it.
    """
    if group_size < 1:
        raise ValueError(f"--n-samples-per-prompt must be >= 1, got {group_size}")
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(
            f"grpo_advantages needs a 1-D rewards tensor whose length is a multiple of group_size={group_size}, "
            f"got shape {tuple(rewards.shape)}"
        )
    grouped = rewards.float().reshape(-1, group_size)
    centered = grouped - grouped.mean(dim=-1, keepdim=True)
    if normalize_std and group_size > 1:
        centered = centered / (grouped.std(dim=-1, keepdim=True) + 1e-6)
    return centered.reshape(-1)


def compute_advantages(
    rewards: torch.Tensor, group_size: int, *, estimator: str = "grpo", normalize_std: bool = True
) -> torch.Tensor:
    """Per-sample advantages of one rollout by ``--advantage-estimator``.

    - ``grpo``: reward minus the group mean, over the group std unless ``normalize_std`` is False.
    - ``rloo``: reward minus the mean of the *other* samples of its group (leave-one-out baseline).
    - ``reinforce_plus_plus_baseline``: reward minus the group mean, then whitened over the whole rollout.

    Raises:
        ValueError: an unknown estimator (naming the flag), or rewards that do not form whole groups.
    """
    if estimator == "grpo":
        return grpo_advantages(rewards, group_size, normalize_std=normalize_std)
    if estimator not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"--advantage-estimator must be one of {ADVANTAGE_ESTIMATORS}, got {estimator!r}")
    centered = grpo_advantages(rewards, group_size, normalize_std=False)
    if estimator == "rloo":
        return centered * (group_size / (group_size - 1)) if group_size > 1 else centered
    if centered.numel() < 2:
        return centered
    return (centered - centered.mean()) / (centered.std() + 1e-6)


def kl_penalty(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token KL(pi || pi_ref) estimate from sampled-token log-probs (Schulman's k1/k2/k3).

    k1 = log r, k2 = (log r)^2 / 2, k3 = exp(-log r) - 1 + log r, with log r = log pi - log pi_ref.
    k3 ("low_var_kl") is unbiased and non-negative.
    """
    log_ratio = log_probs - ref_log_probs
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    if estimator == "k3":
        return torch.expm1(-log_ratio) + log_ratio
    raise ValueError(f"--kl-loss-type must be one of {KL_ESTIMATORS}, got {estimator!r}")


def ppo_clip_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    *,
    eps_clip: float,
    eps_clip_high: float,
    eps_clip_c: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token PPO-clip loss with separate low/high clip ranges (DAPO's clip-higher) and optional dual clip.

    ``loss = max(-A * r, -A * clip(r, 1 - eps_clip, 1 + eps_clip_high))`` with ``r = exp(lp - old_lp)``; with
    ``eps_clip_c`` (dual-clip PPO), tokens with ``A < 0`` are further bounded by ``-A * eps_clip_c``.

    Returns:
        ``(loss [T], clipped [T])`` where ``clipped`` is 1.0 where the clipped branch was taken.
    """
    ratio = torch.exp(log_probs - old_log_probs)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - eps_clip, 1.0 + eps_clip_high)
    loss = torch.maximum(unclipped, clipped)
    if eps_clip_c is not None:
        loss = torch.where(advantages < 0, torch.minimum(loss, -advantages * eps_clip_c), loss)
    return loss, (clipped > unclipped).float()


@dataclass(frozen=True, kw_only=True, slots=True)
class LossSettings:
    """The knobs of ``actor_loss`` (copied from ``ActorConfig``)."""

    eps_clip: float
    """Lower clip range (``--eps-clip``)."""
    eps_clip_high: float
    """Upper clip range (``--eps-clip-high``)."""
    kl_loss_coef: float = 0.0
    """Weight of the KL-to-reference term (``--kl-loss-coef``); 0 disables it."""
    kl_loss_type: str = "k3"
    """KL estimator (``--kl-loss-type``)."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus (``--entropy-coef``)."""
    eps_clip_c: float | None = None
    """Dual-clip bound for negative advantages (``--eps-clip-c``); None: off."""
    use_tis: bool = False
    """Truncated importance sampling: weight each token by min(pi_old / pi_rollout, tis_clip) (``--use-tis``)."""
    tis_clip: float = 2.0
    """Upper bound of the TIS weight (``--tis-clip``)."""
    tis_mode: str = "truncate"
    """Above the bound: "truncate" to it (TIS), or "mask" the token out of the loss (MIS) (``--tis-mode``)."""


def actor_loss(
    log_probs: torch.Tensor,
    entropy: torch.Tensor | None,
    fields: dict[str, torch.Tensor],
    loss_mask: torch.Tensor,
    settings: LossSettings,
    *,
    num_loss_tokens: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Token-level PPO loss of one micro-batch, normalised by the whole step's loss-token count.

    Summing the returned losses over all micro-batches (and DP ranks) gives the mean over every
    loss token of the optimizer step, so gradient accumulation needs no further scaling.

    Args:
        log_probs: ``[T]`` current policy log-probs (with grad).
        entropy: ``[T]`` entropy (needed when ``settings.entropy_coef`` is non-zero).
        fields: token fields; ``"old_log_probs"``, ``"advantages"``, with KL ``"ref_log_probs"``, with TIS
            ``"rollout_log_probs"``, and optionally ``"loss_weights"`` (per-token weights: ``1/len`` of each
            sample gives the per-sample mean; ``num_loss_tokens`` is then the sum of the weights).
        loss_mask: ``[T]`` float 0/1.
        settings: loss coefficients.
        num_loss_tokens: loss tokens in the whole optimizer step (all micro-batches, all DP ranks).

    Returns:
        ``(loss, sums)``: the scalar to backpropagate and detached token sums of each metric
        (``pg_loss``, ``pg_clipfrac``, ``kl``, ``entropy``, ``ppo_kl``), already divided by
        ``num_loss_tokens``.
    """
    for name in ("old_log_probs", "advantages"):
        if name not in fields:
            raise ValueError(f"train_step needs token field {name!r}; got {sorted(fields)}")
    denom = max(float(num_loss_tokens), 1.0)
    mask = loss_mask.float()
    if "loss_weights" in fields:
        mask = mask * fields["loss_weights"]

    def reduce(x: torch.Tensor) -> torch.Tensor:
        return (x * mask).sum() / denom

    pg, clipped = ppo_clip_loss(
        log_probs,
        fields["old_log_probs"],
        fields["advantages"],
        eps_clip=settings.eps_clip,
        eps_clip_high=settings.eps_clip_high,
        eps_clip_c=settings.eps_clip_c,
    )
    sums: dict[str, torch.Tensor] = {}
    if settings.use_tis:
        if "rollout_log_probs" not in fields:
            raise ValueError("--use-tis needs the engine's log-probs: token field 'rollout_log_probs' is missing")
        # Decoupled PPO: old_log_probs are the proximal policy's (the actor's before this step), rollout_log_probs
        # the behaviour policy's (the engines', possibly --max-staleness versions older).
        weight = torch.exp(fields["old_log_probs"] - fields["rollout_log_probs"])
        if settings.tis_mode == "mask":
            kept = (weight <= settings.tis_clip).float()
            tis = weight * kept
            sums["tis_masked_frac"] = reduce(1.0 - kept)
        else:
            tis = weight.clamp(max=settings.tis_clip)
        pg = pg * tis
        sums["tis"] = reduce(tis)
    loss = reduce(pg)
    sums |= {
        "pg_loss": loss.detach(),
        "pg_clipfrac": reduce(clipped),
        "ppo_kl": reduce((fields["old_log_probs"] - log_probs).detach()),
    }
    if settings.kl_loss_coef != 0.0:
        if "ref_log_probs" not in fields:
            raise ValueError("--kl-loss-coef is non-zero but the batch has no 'ref_log_probs' token field")
        kl = reduce(kl_penalty(log_probs, fields["ref_log_probs"], settings.kl_loss_type))
        loss = loss + settings.kl_loss_coef * kl
        sums["kl"] = kl.detach()
    if entropy is not None:
        ent = reduce(entropy)
        sums["entropy"] = ent.detach()
        if settings.entropy_coef != 0.0:
            loss = loss - settings.entropy_coef * ent
    sums["loss"] = loss.detach()
    return loss, sums
