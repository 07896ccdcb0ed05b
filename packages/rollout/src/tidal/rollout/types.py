"""Frozen records that cross package boundaries."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, kw_only=True, slots=True)
class Sample:
    """One sampled response to one prompt, with everything training needs.

    ``response_ids`` are exactly the tokens SGLang sampled (a matched stop token included), never a
    re-tokenization of the text, and ``response_log_probs[i]`` is the sampler's log-prob of
    ``response_ids[i]``. Change a field with ``dataclasses.replace``.
    """

    prompt_ids: Sequence[int]
    """Token ids of the prompt, as sent to the engine."""
    response_ids: Sequence[int]
    """Token ids the engine sampled, in order."""
    response_log_probs: Sequence[float]
    """Log-prob of each response token under the weights that sampled it (same length as response_ids)."""
    finish_reason: str
    """Why generation ended: "stop" (a stop/EOS token), "length" (max_new_tokens) or "abort"."""
    label: Any = None
    """Reference answer the reward compares against (from the dataset)."""
    reward: float | None = None
    """Scalar reward; None until scored."""
    group_index: int = 0
    """Index of the prompt this sample answers; samples of one prompt share it (GRPO groups)."""
    weight_version: str | None = None
    """Version of the engine weights that produced the response."""
    response_text: str = ""
    """Decoded response, for rule-based rewards and logs (the ids stay authoritative)."""
    metadata: Any = field(default=None, compare=False)
    """The dataset row's ``--metadata-key`` value, for reward functions; None without one."""
    reward_error: str | None = None
    """Why scoring this sample failed (its reward is then 0.0), None when it did not."""
    reward_metrics: dict[str, float] | None = None
    """Figures the reward reported about this sample (the code sandbox's seconds, why a program scored 0), summed
    per rollout as ``rollout/<key>``; None: none."""
    response_loss_mask: Sequence[int] | None = None
    """Per response token 1 (trained on) or 0 (e.g. a tool result a multi-turn rollout inserted, whose
    log-prob is then 0.0); None: every response token counts."""
    response_weight_versions: Sequence[str | None] | None = None
    """Weight version that sampled each response token (a partial rollout resumed after a weight update
    mixes versions); None: all came from ``weight_version``."""
    episode: int | None = None
    """Within its group, the agent episode this sample is a trajectory of: an agent that rewrote its history gives
    several samples of one episode, consecutive and with its reward, and training counts the episode as one sample
    (one advantage, one sample's loss weight over all its trajectories). None: the sample is an episode by itself."""
    rollout_routed_experts: Any = field(default=None, compare=False)
    """Experts the engine routed each token it forwarded to (``--use-rollout-routing-replay``): an int array
    ``[len(tokens) - 1, MoE layers x top-k]`` (row t: token t's top-k expert ids of layer 0, then of layer 1, ...;
    the last token is never forwarded); None when not asked for."""

    def __post_init__(self) -> None:
        if len(self.response_ids) != len(self.response_log_probs):
            raise ValueError(
                f"Sample.response_log_probs has {len(self.response_log_probs)} entries for "
                f"{len(self.response_ids)} response tokens; they must pair one to one"
            )
        mask = self.response_loss_mask
        if mask is not None and (len(mask) != len(self.response_ids) or any(m not in (0, 1) for m in mask)):
            raise ValueError(
                f"Sample.response_loss_mask must hold one 0 or 1 per response token ({len(self.response_ids)}), "
                f"got {len(mask)} entries"
            )
        versions = self.response_weight_versions
        if versions is not None and len(versions) != len(self.response_ids):
            raise ValueError(
                f"Sample.response_weight_versions has {len(versions)} entries for {len(self.response_ids)} "
                "response tokens; they must pair one to one"
            )

        routed, tokens = self.rollout_routed_experts, len(self.prompt_ids) + len(self.response_ids)
        if routed is not None and (routed.ndim != 2 or routed.shape[0] != tokens - 1):
            raise ValueError(
                f"Sample.rollout_routed_experts has shape {tuple(routed.shape)}; it must be "
                f"[tokens - 1, layers x top-k] with tokens = {tokens}"
            )

    @property
    def token_weight_versions(self) -> list[str | None]:
        """The weight version of each response token (``weight_version`` repeated when not tracked per token)."""
        if self.response_weight_versions is not None:
            return list(self.response_weight_versions)
        return [self.weight_version] * len(self.response_ids)

    @property
    def tokens(self) -> list[int]:
        """Prompt then response token ids, the sequence the actor trains on."""
        return [*self.prompt_ids, *self.response_ids]

    @property
    def loss_mask(self) -> list[int]:
        """0 on prompt tokens, then ``response_loss_mask`` (all 1 when None); aligned with :attr:`tokens`."""
        response = [1] * len(self.response_ids) if self.response_loss_mask is None else list(self.response_loss_mask)
        return [0] * len(self.prompt_ids) + response

    @property
    def truncated(self) -> bool:
        """Whether the response was cut by the length limit rather than ended by a stop token."""
        return self.finish_reason == "length"


def episode_ids(samples: Sequence[Sample]) -> list[int] | None:
    """Each sample's episode, counted 0, 1, ... over ``samples``; None when every sample is an episode by itself.

    Consecutive samples of one group with the same ``episode`` share one.
    """
    if all(s.episode is None for s in samples):
        return None
    ids: list[int] = []
    for i, s in enumerate(samples):
        prev = samples[i - 1] if i else None
        same = (
            prev is not None
            and s.episode is not None
            and (prev.group_index, prev.episode) == (s.group_index, s.episode)
        )
        ids.append(ids[-1] if same else (ids[-1] + 1 if ids else 0))
    return ids


def num_episodes(samples: Sequence[Sample]) -> int:
    """Episodes among ``samples`` (its length, unless an agent episode gave several)."""
    ids = episode_ids(samples)
    return len(samples) if ids is None else (ids[-1] + 1 if ids else 0)


@dataclass(frozen=True, slots=True)
class RewardResult:
    """A reward with figures about how it was reached (summed per rollout as ``rollout/<key>``)."""

    value: float
    """The reward."""
    metrics: dict[str, float]
    """Per-sample figures, e.g. ``{"code/sandbox_s": 0.2, "code/zero/timeout": 1.0}``."""
