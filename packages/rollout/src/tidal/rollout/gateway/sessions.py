"""Token-in/token-out bookkeeping of one agent episode: which tokens were sent and sampled, turn by turn.

Every chat call renders its messages to text with the chat template. An :class:`Episode` holds, per sample (a
:class:`Trajectory`), the exact token ids sent to the engine and sampled from it, and the text those ids stand
for. A call whose rendered text starts with a trajectory's text continues it: only the new text (the suffix:
the next turn's template, tool and user tokens) is tokenized, and appended with loss mask 0 and log-prob 0.0.
Any other call (the history was rewritten, compacted, or the template changed earlier turns) starts a new
trajectory of the same episode (a fork) from its own tokens. Earlier turns are never re-tokenized, so what is
trained on is exactly what was sent and sampled.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tidal.rollout.types import Sample


@dataclass(kw_only=True, slots=True)
class Trajectory:
    """One sample in the making: the first prompt's ids, then every later token with its mask and log-prob."""

    prompt_ids: list[int]
    """Token ids of the call that started it, as sent."""
    text: str
    """The text the held ids stand for (rendered prompts and decoded sampled tokens): what a later call extends."""
    response_ids: list[int] = field(default_factory=list)
    """Every token after the prompt: sampled (loss mask 1) and template/tool/user tokens (loss mask 0)."""
    log_probs: list[float] = field(default_factory=list)
    """Sampler log-prob of each response token (0.0 on the tokens it did not sample)."""
    loss_mask: list[int] = field(default_factory=list)
    """1 on sampled tokens, 0 on inserted ones."""
    weight_versions: list[str | None] = field(default_factory=list)
    """Weight version that sampled each response token (None on inserted ones)."""
    turns: int = 0
    """Calls answered on this trajectory."""
    finish_reason: str = "stop"
    """Why its last call ended."""
    weight_version: str | None = None
    """Weight version of its last call."""

    @property
    def ids(self) -> list[int]:
        """Every token held: what the next extending call sends before its suffix."""
        return [*self.prompt_ids, *self.response_ids]

    def sample(self, **fields: Any) -> Sample:
        """This trajectory as a :class:`Sample` (``fields``: reward, label, group_index, ...)."""
        return Sample(
            prompt_ids=list(self.prompt_ids),
            response_ids=list(self.response_ids),
            response_log_probs=list(self.log_probs),
            response_loss_mask=list(self.loss_mask),
            response_weight_versions=list(self.weight_versions),
            finish_reason=self.finish_reason,
            weight_version=self.weight_version,
            **fields,
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class Turn:
    """What one call sends: its prompt ids, and how they were made (for :meth:`Episode.record`)."""

    prompt_ids: list[int]
    """The ids sent to the engine."""
    rendered: str
    """The call's rendered prompt text."""
    base: Trajectory | None
    """The trajectory it extends (None: a fork, or the episode's first call)."""
    base_len: int
    """Tokens ``base`` held when the call was prepared (a concurrent call that grew it meanwhile makes a fork)."""
    suffix_ids: list[int]
    """The new tokens appended to ``base`` (loss mask 0)."""


class Episode:
    """The samples of one agent episode (one session of the gateway)."""

    def __init__(self, tokenize: Callable[[str], list[int]]) -> None:
        """``tokenize`` turns text into ids without adding special tokens (the chat template adds its own)."""
        self._tokenize = tokenize
        self.trajectories: list[Trajectory] = []
        self.forks = 0
        """Trajectories started by a call that extended none (the first one not counted)."""
        self.last: Trajectory | None = None
        """The trajectory that holds the latest answer (the episode's final one)."""

    def prepare(self, rendered: str) -> Turn:
        """The ids to send for a call whose chat template rendered ``rendered``.

        Extends the trajectory with the longest text that ``rendered`` starts with (tokenizing only the rest);
        without one, tokenizes ``rendered`` whole (a new trajectory once :meth:`record` stores the answer).
        """
        base = max(
            (t for t in self.trajectories if rendered.startswith(t.text)), key=lambda t: len(t.text), default=None
        )
        if base is None:
            ids = self._tokenize(rendered)
            return Turn(prompt_ids=ids, rendered=rendered, base=None, base_len=0, suffix_ids=[])
        suffix = self._tokenize(rendered[len(base.text) :])
        held = base.ids
        return Turn(prompt_ids=[*held, *suffix], rendered=rendered, base=base, base_len=len(held), suffix_ids=suffix)

    def record(
        self,
        turn: Turn,
        *,
        output_ids: Sequence[int],
        log_probs: Sequence[float],
        output_text: str,
        finish_reason: str,
        weight_version: str | None,
        weight_versions: Sequence[str | None] | None = None,
    ) -> Trajectory:
        """Store what the engine sampled for ``turn``; returns the trajectory that now holds it.

        ``weight_versions`` gives each sampled token's version (a generation resumed after a weight update mixes
        them); None: all are ``weight_version``.
        """
        base = turn.base
        if base is not None and len(base.prompt_ids) + len(base.response_ids) == turn.base_len:
            n = len(turn.suffix_ids)
            base.response_ids += turn.suffix_ids
            base.log_probs += [0.0] * n
            base.loss_mask += [0] * n
            base.weight_versions += [None] * n
            target = base
        else:
            # A new trajectory from exactly the ids sent (a fork; or a concurrent call grew ``base`` meanwhile).
            if self.trajectories:
                self.forks += 1
            target = Trajectory(prompt_ids=list(turn.prompt_ids), text=turn.rendered)
            self.trajectories.append(target)
        if base is not None:
            target.text = turn.rendered
        target.response_ids += [int(t) for t in output_ids]
        target.log_probs += [float(p) for p in log_probs]
        target.loss_mask += [1] * len(output_ids)
        target.weight_versions += list(weight_versions or [weight_version] * len(output_ids))
        target.text += output_text
        target.turns += 1
        target.finish_reason = finish_reason
        target.weight_version = weight_version
        self.last = target
        return target

    def samples(self, **fields: Any) -> list[Sample]:
        """One sample per trajectory that sampled anything, each with ``fields`` (the episode's reward, ...).

        In the order they started, but the one holding the latest answer (:attr:`last`) last.
        """
        order = [t for t in self.trajectories if t is not self.last] + ([self.last] if self.last else [])
        return [t.sample(**fields) for t in order if any(t.loss_mask)]

    def metrics(self) -> dict[str, float]:
        """Turns, forks and tokens of this episode."""
        return {
            "turns": float(sum(t.turns for t in self.trajectories)),
            "forks": float(self.forks),
            "samples": float(len(self.trajectories)),
            "sampled_tokens": float(sum(sum(t.loss_mask) for t in self.trajectories)),
            "tokens": float(sum(len(t.prompt_ids) + len(t.response_ids) for t in self.trajectories)),
        }
