"""What one rollout's samples weigh in the loss: their advantages and their tokens' loss weights.

:func:`tidal.actor.trainer.train_on_rollout` packs these as token fields of every micro-batch: "advantages" (the
sample's advantage on each of its tokens; the token-level estimators and GAE replace them later) and, unless
``--calculate-per-token-loss``, "loss_weights" (one over the sample's response tokens, so the loss is a mean over
each sample's tokens, then over samples: slime's default).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from tidal.actor.advantages import compute_advantages, overlong_penalty
from tidal.actor.loss import load_function


@dataclass(frozen=True, kw_only=True, slots=True)
class SampleWeights:
    """One rollout's per-sample advantages and the per-token fields the trainer packs from them."""

    advantages: torch.Tensor
    """float32 ``[N]``: each sample's advantage, from its reward plus its overlong penalty."""
    penalty: torch.Tensor
    """float32 ``[N]``: each sample's overlong penalty (0 without ``--overlong-buffer-len``)."""
    token_fields: dict[str, list[list[float]]]
    """"advantages" and (per-sample loss aggregation) "loss_weights": one value per token of each sample."""


def sample_weights(
    cfg,
    *,
    loss_masks: Sequence[Sequence[int]],
    rewards: Sequence[float],
    group_size: int,
    normalize_std: bool | None = None,
) -> SampleWeights:
    """The advantages and loss weights of one rollout's samples, by the actor's config.

    Args:
        cfg: the actor's :class:`tidal.actor.ActorConfig` (estimator, overlong penalty, custom advantage
            function, loss aggregation).
        loss_masks: per sample, 0 on prompt tokens and 1 on response tokens (one entry per token).
        rewards: scalar reward per sample; groups of ``group_size`` consecutive samples.
        group_size: samples per prompt.
        normalize_std: divide GRPO advantages by the group's reward std; None: ``not
            cfg.disable_grpo_std_normalization``.

    Raises:
        ValueError: a custom advantage function that does not return one advantage per sample, or rewards that do
            not form whole groups.
    """
    if normalize_std is None:
        normalize_std = not cfg.disable_grpo_std_normalization
    penalty = overlong_penalty(
        torch.tensor([response_len(m) for m in loss_masks]),
        max_response_len=cfg.max_response_len,
        buffer_len=cfg.overlong_buffer_len,
        penalty_factor=cfg.overlong_penalty_factor,
    )
    shaped = torch.tensor(rewards, dtype=torch.float32) + penalty
    advantages = _sample_advantages(cfg, shaped, group_size, normalize_std)
    token_fields = {"advantages": [[float(advantages[i])] * len(m) for i, m in enumerate(loss_masks)]}
    if not cfg.calculate_per_token_loss:  # slime's default: mean over each sample's tokens, then over samples
        token_fields["loss_weights"] = [[1.0 / max(sum(m), 1)] * len(m) for m in loss_masks]
    return SampleWeights(advantages=advantages, penalty=penalty, token_fields=token_fields)


def response_len(loss_mask: Sequence[int]) -> int:
    """Tokens from the first trained token to the end (a multi-turn response's tool tokens count too)."""
    first = next((i for i, m in enumerate(loss_mask) if m), len(loss_mask))
    return len(loss_mask) - first


def _sample_advantages(cfg, rewards: torch.Tensor, group_size: int, normalize_std: bool) -> torch.Tensor:
    if cfg.custom_advantage_function_path is None:
        return compute_advantages(rewards, group_size, estimator=cfg.advantage_estimator, normalize_std=normalize_std)
    flag = "--custom-advantage-function-path"
    fn = load_function(cfg.custom_advantage_function_path, flag=flag)
    out = torch.as_tensor(fn(rewards, group_size=group_size, normalize_std=normalize_std), dtype=torch.float32)
    if out.shape != rewards.shape:
        raise ValueError(
            f"{flag} {cfg.custom_advantage_function_path!r} returned shape {tuple(out.shape)}; it must return one "
            f"advantage per sample, shape {tuple(rewards.shape)}"
        )
    return out
