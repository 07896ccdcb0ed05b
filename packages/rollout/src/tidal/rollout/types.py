"""Frozen records that cross package boundaries."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
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
    reward_error: str | None = None
    """Why scoring this sample failed (its reward is then 0.0), None when it did not."""

    def __post_init__(self) -> None:
        if len(self.response_ids) != len(self.response_log_probs):
            raise ValueError(
                f"Sample.response_log_probs has {len(self.response_log_probs)} entries for "
                f"{len(self.response_ids)} response tokens; they must pair one to one"
            )

    @property
    def tokens(self) -> list[int]:
        """Prompt then response token ids, the sequence the actor trains on."""
        return [*self.prompt_ids, *self.response_ids]

    @property
    def loss_mask(self) -> list[int]:
        """0 on prompt tokens, 1 on response tokens (aligned with :attr:`tokens`)."""
        return [0] * len(self.prompt_ids) + [1] * len(self.response_ids)

    @property
    def truncated(self) -> bool:
        """Whether the response was cut by the length limit rather than ended by a stop token."""
        return self.finish_reason == "length"
