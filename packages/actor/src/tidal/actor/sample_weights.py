"""What one rollout's samples weigh in the loss: their advantages and their tokens' loss weights.

:func:`tidal.actor.trainer.train_on_rollout` packs these as token fields of every micro-batch: "advantages" (the
sample's advantage on each of its tokens; the token-level estimators and GAE replace them later) and, unless
``--calculate-per-token-loss``, "loss_weights" (one over the sample's response tokens, so the loss is a mean over
each sample's tokens, then over samples: slime's default).

An agent episode whose agent rewrote its history gives several samples (its trajectories, consecutive, ``episode_ids``
equal): the episode then counts as one sample does. Its advantage comes from its reward among its group's episodes
and goes to every token of each trajectory, and its trajectories' tokens share one sample's loss weight.
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
    episode_ids: Sequence[int] | None = None,
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
        episode_ids: each sample's episode (0, 0, 1, 2, 2, ...: consecutive samples of one episode share it);
            groups of ``group_size`` consecutive *episodes* then. None: every sample is an episode.

    Raises:
        ValueError: a custom advantage function that does not return one advantage per sample, rewards that do
            not form whole groups, or episode ids that are not consecutive or whose samples' rewards differ.
    """
    if normalize_std is None:
        normalize_std = not cfg.disable_grpo_std_normalization
    penalty = overlong_penalty(
        torch.tensor([response_len(m) for m in loss_masks]),
        max_response_len=cfg.max_response_len,
        buffer_len=cfg.overlong_buffer_len,
        penalty_factor=cfg.overlong_penalty_factor,
    )
    reward = torch.tensor(rewards, dtype=torch.float32)
    episode = episode_index(episode_ids, len(loss_masks))
    first, last = _episode_ends(episode)
    differs = (reward != reward[first][episode]) & ~reward.isnan()  # a NaN reward skips its step later
    if differs.any():
        bad = int(differs.nonzero()[0])
        raise ValueError(f"sample {bad} has another reward than the rest of its episode {int(episode[bad])}")
    # An episode's shaped reward: its reward plus the overlong penalty of its last trajectory (the final answer).
    advantages = _sample_advantages(cfg, reward[first] + penalty[last], group_size, normalize_std)[episode]
    token_fields = {"advantages": [[float(advantages[i])] * len(m) for i, m in enumerate(loss_masks)]}
    if not cfg.calculate_per_token_loss:  # slime's default: mean over each sample's tokens, then over samples
        tokens = torch.zeros(len(first)).index_add_(0, episode, torch.tensor([float(sum(m)) for m in loss_masks]))
        token_fields["loss_weights"] = [
            [1.0 / max(float(tokens[e]), 1.0)] * len(m) for m, e in zip(loss_masks, episode.tolist(), strict=True)
        ]
    return SampleWeights(advantages=advantages, penalty=penalty, token_fields=token_fields)


def episode_index(episode_ids: Sequence[int] | None, num_samples: int) -> torch.Tensor:
    """``[N]`` each sample's episode, 0, 1, ... in order (``arange(N)`` without ``episode_ids``).

    Raises:
        ValueError: ``episode_ids`` of another length, or not consecutive from 0 (an episode's samples together).
    """
    if episode_ids is None:
        return torch.arange(num_samples)
    ids = torch.as_tensor(list(episode_ids), dtype=torch.long)
    if ids.shape != (num_samples,):
        raise ValueError(f"episode_ids has {ids.numel()} entries for {num_samples} samples")
    steps = ids.diff() if num_samples else ids
    if num_samples and (int(ids[0]) != 0 or bool(((steps != 0) & (steps != 1)).any())):
        raise ValueError(
            "episode_ids must count episodes 0, 1, 2, ... with each episode's samples consecutive, got "
            f"{ids.tolist()[:20]}"
        )
    return ids


def _episode_ends(episode: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Index of each episode's first and last sample."""
    counts = torch.unique_consecutive(episode, return_counts=True)[1]
    last = counts.cumsum(0) - 1
    return last - counts + 1, last


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
