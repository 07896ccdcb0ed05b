"""Losses: PPO-clip (GRPO, RLOO, REINFORCE++, PPO), GSPO, CISPO, SFT, KL and entropy; the critic's value loss.

Advantages come from :mod:`tidal.actor.advantages`; this module turns them and the log-probs into the loss.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from tidal.actor.advantages import compute_advantages, grpo_advantages, sequence_mean

if TYPE_CHECKING:
    from tidal.actor.config import ActorConfig

logger = logging.getLogger(__name__)

__all__ = [
    "actor_loss",
    "compute_advantages",
    "critic_loss",
    "grpo_advantages",
    "kl_penalty",
    "ppo_clip_loss",
    "value_loss",
]

KL_ESTIMATORS = ("k1", "k2", "k3")
POLICY_LOSSES = ("ppo_clip", "gspo", "cispo")
LOSS_TYPES = ("policy_loss", "sft_loss", "custom_loss")


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
    log_ratio: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token PPO-clip loss with separate low/high clip ranges (DAPO's clip-higher) and optional dual clip.

    ``loss = max(-A * r, -A * clip(r, 1 - eps_clip, 1 + eps_clip_high))`` with ``r = exp(lp - old_lp)``; with
    ``eps_clip_c`` (dual-clip PPO), tokens with ``A < 0`` are further bounded by ``-A * eps_clip_c``.

    ``log_ratio`` replaces ``lp - old_lp`` (GSPO: the sequence mean, :func:`tidal.actor.advantages.sequence_mean`).

    Returns:
        ``(loss [T], clipped [T])`` where ``clipped`` is 1.0 where the clipped branch was taken.
    """
    ratio = torch.exp(log_probs - old_log_probs if log_ratio is None else log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - eps_clip, 1.0 + eps_clip_high)
    loss = torch.maximum(unclipped, clipped)
    if eps_clip_c is not None:
        loss = torch.where(advantages < 0, torch.minimum(loss, -advantages * eps_clip_c), loss)
    return loss, (clipped > unclipped).float()


def cispo_loss(
    log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor, *, eps_clip_high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token CISPO loss (MiniMax-M1): ``-sg(min(r, 1 + eps_clip_high)) * A * log pi``.

    The importance weight is clipped and detached, so every token keeps its gradient ``A * w * grad log pi``;
    as in the paper, no lower bound (``eps_low`` set large), only ``--eps-clip-high``.

    Returns:
        ``(loss [T], clipped [T])``, ``clipped`` 1.0 where the weight was truncated.
    """
    ratio = torch.exp(log_probs - old_log_probs).detach()
    weight = ratio.clamp(max=1.0 + eps_clip_high)
    return -weight * advantages * log_probs, (ratio > 1.0 + eps_clip_high).float()


def value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, *, value_clip: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token PPO value loss: ``0.5 * max((V - R)^2, (V_clip - R)^2)``, ``V_clip = V_old + clip(V - V_old, +-c)``.

    Without ``value_clip`` it is ``0.5 * (V - R)^2``. The max keeps the pessimistic branch, so a value that moved
    more than ``c`` from ``V_old`` away from the return gets no gradient, as PPO's ratio clip does for the policy.

    Returns:
        ``(loss [T], clipped [T])``, ``clipped`` 1.0 where the clipped branch was taken (the critic's clipfrac).
    """
    unclipped = (values - returns).square()
    if value_clip is None:
        return 0.5 * unclipped, torch.zeros_like(unclipped)
    clipped = (old_values + (values - old_values).clamp(-value_clip, value_clip) - returns).square()
    return 0.5 * torch.maximum(unclipped, clipped), (clipped > unclipped).float()


def critic_loss(
    values: torch.Tensor,
    entropy: torch.Tensor | None,
    fields: dict[str, torch.Tensor],
    loss_mask: torch.Tensor,
    settings: LossSettings,
    *,
    num_loss_tokens: float,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The critic's loss of one micro-batch (:func:`value_loss`), aggregated as :func:`actor_loss` aggregates.

    Same signature as ``actor_loss`` (the critic's train step calls it in its place): ``values`` in place of the
    log-probs; token fields ``"old_values"`` and ``"returns"`` (and optionally ``"loss_weights"``).

    Returns:
        ``(loss, sums)``: sums ``value_loss``, ``clipfrac``, ``values_mean`` and ``loss``, divided by
        ``num_loss_tokens``.
    """
    del entropy, cu_seqlens  # the critic has no entropy; its loss is per token
    for name in ("old_values", "returns"):
        if name not in fields:
            raise ValueError(f"the critic's train_step needs token field {name!r}; got {sorted(fields)}")
    denom = max(float(num_loss_tokens), 1.0)
    mask = loss_mask.float()
    if "loss_weights" in fields:
        mask = mask * fields["loss_weights"]
    per_token, clipped = value_loss(
        values.float(), fields["old_values"].float(), fields["returns"].float(), value_clip=settings.value_clip
    )
    loss = (per_token * mask).sum() / denom
    sums = {
        "value_loss": loss.detach(),
        "clipfrac": (clipped * mask).sum() / denom,
        "values_mean": (values.detach().float() * mask).sum() / denom,
        "loss": loss.detach(),
    }
    return loss, sums


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
    policy_loss: str = "ppo_clip"
    """``ppo_clip`` (token ratio), ``gspo`` (sequence ratio) or ``cispo``; from ``--advantage-estimator``."""
    loss_type: str = "policy_loss"
    """``policy_loss`` (RL), ``sft_loss`` (negative log-likelihood of the loss tokens) (``--loss-type``)."""
    tis_mode: str = "truncate"
    """Above the bound: "truncate" to it (TIS), or "mask" the token out of the loss (MIS) (``--tis-mode``)."""
    value_clip: float | None = None
    """The critic's value clipping range (``--value-clip``); None: unclipped squared error."""

    @classmethod
    def of(cls, cfg: ActorConfig) -> LossSettings:
        """The actor's loss settings from its config (``--eps-clip-high`` unset: ``--eps-clip``)."""
        return cls(
            eps_clip=cfg.eps_clip,
            eps_clip_high=cfg.eps_clip if cfg.eps_clip_high is None else cfg.eps_clip_high,
            kl_loss_coef=cfg.kl_loss_coef,
            kl_loss_type=cfg.kl_loss_type,
            entropy_coef=cfg.entropy_coef,
            eps_clip_c=cfg.eps_clip_c,
            use_tis=cfg.off_policy_correction,
            tis_clip=cfg.tis_clip,
            policy_loss=policy_loss_of(cfg.advantage_estimator),
            loss_type=cfg.loss_type,
            tis_mode=cfg.tis_mode,
        )


def actor_loss(
    log_probs: torch.Tensor,
    entropy: torch.Tensor | None,
    fields: dict[str, torch.Tensor],
    loss_mask: torch.Tensor,
    settings: LossSettings,
    *,
    num_loss_tokens: float,
    cu_seqlens: torch.Tensor | None = None,
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
        cu_seqlens: sequence boundaries of the packed batch (GSPO's sequence ratio needs them).

    Returns:
        ``(loss, sums)``: the scalar to backpropagate and detached token sums of each metric
        (``pg_loss``, ``pg_clipfrac``, ``kl``, ``entropy``, ``ppo_kl``), already divided by
        ``num_loss_tokens``.
    """
    denom = max(float(num_loss_tokens), 1.0)
    mask = loss_mask.float()
    if "loss_weights" in fields:
        mask = mask * fields["loss_weights"]

    def reduce(x: torch.Tensor) -> torch.Tensor:
        return (x * mask).sum() / denom

    if settings.loss_type == "sft_loss":
        loss = reduce(-log_probs)
        sums = {"sft_loss": loss.detach()}
    else:
        loss, sums = _policy_loss(log_probs, fields, loss_mask, settings, reduce, cu_seqlens)
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


def _policy_loss(log_probs, fields, loss_mask, settings: LossSettings, reduce, cu_seqlens):
    for name in ("old_log_probs", "advantages"):
        if name not in fields:
            raise ValueError(f"train_step needs token field {name!r}; got {sorted(fields)}")
    old, adv = fields["old_log_probs"], fields["advantages"]
    if settings.policy_loss == "cispo":
        pg, clipped = cispo_loss(log_probs, old, adv, eps_clip_high=settings.eps_clip_high)
    else:
        log_ratio = None
        if settings.policy_loss == "gspo":  # one ratio per sequence: exp(mean over its tokens of log r)
            if cu_seqlens is None:
                raise ValueError("--advantage-estimator gspo needs the batch's cu_seqlens (sequence boundaries)")
            log_ratio = sequence_mean(log_probs - old, loss_mask, cu_seqlens)
        pg, clipped = ppo_clip_loss(
            log_probs,
            old,
            adv,
            eps_clip=settings.eps_clip,
            eps_clip_high=settings.eps_clip_high,
            eps_clip_c=settings.eps_clip_c,
            log_ratio=log_ratio,
        )
    sums: dict[str, torch.Tensor] = {}
    if settings.use_tis:
        if "rollout_log_probs" not in fields:
            raise ValueError("--use-tis needs the engine's log-probs: token field 'rollout_log_probs' is missing")
        # Decoupled PPO: old_log_probs are the proximal policy's (the actor's before this step), rollout_log_probs
        # the behaviour policy's (the engines', possibly --max-staleness versions older).
        weight = torch.exp(old - fields["rollout_log_probs"])
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
        "ppo_kl": reduce((old - log_probs).detach()),
    }
    return loss, sums


def policy_loss_of(estimator: str) -> str:
    """The policy loss an ``--advantage-estimator`` trains with (one of :data:`POLICY_LOSSES`; ppo's is ppo_clip)."""
    return estimator if estimator in ("gspo", "cispo") else "ppo_clip"


def load_function(path: str, *, flag: str) -> Callable:
    """The function ``pkg.module:fn`` names (the app checked at parse time that it imports); errors name ``flag``."""
    module_name, _, attr = path.partition(":")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"{flag} {path!r}: cannot load it: {e}") from e
    if not callable(fn):
        raise ValueError(f"{flag} {path!r}: {attr!r} is a {type(fn).__name__}, not a function")
    return fn
