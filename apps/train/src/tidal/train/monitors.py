"""Warnings about problems that do not crash a run but waste it (slime's FAQ).

Flat rewards, doubled chat templates, an engine whose log-probs drift from the actor's.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

logger = logging.getLogger(__name__)

# Markers of an already-rendered chat prompt, by template family.
_CHAT_MARKERS = re.compile(
    r"<\|im_start\|>|<\|start_header_id\|>|<\|user\|>|\[INST\]|<start_of_turn>|<\|begin_of_text\|>"
)


class RewardSanity:
    """Warns when every reward of a rollout was identical for ``patience`` rollouts in a row (0 disables)."""

    def __init__(self, patience: int) -> None:
        """Count from zero; warn once per streak."""
        self.patience = patience
        self.streak = 0
        self.warned = False

    def observe(self, samples: Sequence) -> bool:
        """Record one rollout's samples; True when this call warned."""
        rewards = {float(s.reward) for s in samples}
        if len(rewards) != 1:
            self.streak, self.warned = 0, False
            return False
        self.streak += 1
        if not self.patience or self.streak < self.patience or self.warned:
            return False
        self.warned = True
        example = samples[0]
        logger.warning(
            "every reward was %s for %d rollouts in a row: the policy gets no learning signal. Example: response %r "
            "(finish %s) to label %r scored %s. Check --rm-type/--custom-rm-path against the answer format, "
            "--rollout-max-response-len (truncated answers), and --rollout-stop.",
            rewards.pop(),
            self.streak,
            _text(example),
            example.finish_reason,
            example.label,
            example.reward,
        )
        return True


def check_engine_agreement(record: Mapping[str, Any], threshold: float) -> str | None:
    """Warn when a rollout's mean |engine - actor log-prob| (tidal.actor.agreement) exceeds ``threshold`` (0: never).

    Returns the warning, or None (no warning, or no such metric: a run without an actor or without engines).
    """
    mean = record.get("rollout/logprob_abs_diff/mean")
    if mean is None or not threshold or mean <= threshold:  # a NaN mean warns
        return None
    if record.get("rollout/staleness_max", 0.0) > 0:  # --max-staleness: older weights sampled; the gap is expected
        return None
    message = (
        f"rollout {record.get('rollout')}: the engine's and the actor's log-probs of the sampled tokens differ by "
        f"{mean:.4f} nats on average (max {record.get('rollout/logprob_abs_diff/max', float('nan')):.3f}, "
        f"KL(engine || actor) {record.get('rollout/engine_actor_kl', float('nan')):.2e}), above "
        f"--mismatch-warn-threshold {threshold:g}: the PPO ratio is off-policy by that much. Usual causes: the "
        "engines serve another precision than the actor computes in (--sglang-dtype, default the actor's "
        "--params-dtype), weights synced only every --update-weights-interval rollouts, or a wrong weight mapping. "
        "--use-tis corrects the ratio for the gap; raise the threshold if it is expected."
    )
    logger.warning(message)
    return message


def _text(sample) -> str:
    text = getattr(sample, "response_text", None) or getattr(sample, "response", None)
    return text if isinstance(text, str) else str(list(sample.response_ids)[:32])


def check_prompt_chat_template(texts: Iterable[str], tokenizer, *, apply_chat_template: bool) -> str | None:
    """Warn when the prompt data already holds a chat template that is not the tokenizer's; returns the warning.

    A prompt rendered with another model's template (or rendered twice, with --apply-chat-template on top) trains
    the model on text it never sees at inference: slime's FAQ traces exploding gradient norms to exactly this.
    """
    example = next((t for t in texts if _CHAT_MARKERS.search(t)), None)
    if example is None:
        return None
    template = getattr(tokenizer, "chat_template", None)
    ours = None
    if template:
        try:
            ours = tokenizer.apply_chat_template(
                [{"role": "user", "content": "EXAMPLE"}], tokenize=False, add_generation_prompt=True
            )
        except Exception:  # a broken template is tidal.rollout's check_chat_template's to report
            ours = None
    marker = _CHAT_MARKERS.search(example).group(0)
    if ours is not None and marker in ours and not apply_chat_template:
        return None  # already rendered with this tokenizer's own template: fine
    if apply_chat_template:
        why = "and --apply-chat-template will wrap it in the tokenizer's template a second time"
    else:
        why = "that differs from the tokenizer's" if ours is not None else "but the tokenizer has no chat template"
    message = (
        f"the prompt data already contains a chat template ({marker!r}) {why}. Example prompt: {example[:200]!r}; "
        f"the tokenizer's template renders: {ours[:200] if ours else None!r}. Render prompts with this model's "
        "template, or pass raw prompts with --apply-chat-template."
    )
    logger.warning(message)
    return message
