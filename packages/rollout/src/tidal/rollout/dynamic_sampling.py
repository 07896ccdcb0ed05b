"""Over-sampling with dynamic filtering (DAPO): generate groups in rounds until enough carry a learning signal.

Under GRPO a group whose rewards are all equal has zero advantage everywhere and teaches nothing. Each
round generates ``over_sampling_batch_size`` prompts' groups, the group filter drops the useless ones, and
rounds continue until ``rollout_batch_size`` groups are kept, or fail after ``max_rounds``.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from tidal.rollout.config import BUILTIN_GROUP_FILTER_NAMES
from tidal.rollout.errors import RolloutError
from tidal.rollout.import_path import load_callable
from tidal.rollout.types import Sample

logger = logging.getLogger(__name__)

Prompt = tuple[Sequence[int], Any]
"""A prompt as ``(token ids, label)``."""


class GroupFilter(Protocol):
    """Decides whether one group (all samples of one prompt, scored) is kept."""

    def __call__(self, group: Sequence[Sample]) -> bool:
        """True keeps the group."""
        ...


def reward_variance(group: Sequence[Sample]) -> bool:
    """Keep a group whose rewards are not all equal (slime's ``check_reward_nonzero_std``).

    Raises:
        ValueError: A sample has not been scored.
    """
    if any(s.reward is None for s in group):
        raise ValueError(f"dynamic sampling needs scored samples; group {group[0].group_index} has one unscored")
    return len({s.reward for s in group}) > 1


BUILTIN_GROUP_FILTERS: dict[str, GroupFilter] = {"reward_variance": reward_variance}
assert tuple(BUILTIN_GROUP_FILTERS) == BUILTIN_GROUP_FILTER_NAMES  # config.py validates against the names


def resolve_group_filter(spec: str) -> GroupFilter:
    """A built-in group filter by name (``reward_variance``) or one by import path ``pkg.module:fn``.

    Raises:
        ValueError: Unknown name, or the import path does not lead to a callable (the message names it).
    """
    if spec in BUILTIN_GROUP_FILTERS:
        return BUILTIN_GROUP_FILTERS[spec]
    if ":" in spec:
        return load_callable(spec, flag="--dynamic-sampling-filter-path")
    raise ValueError(
        f"--dynamic-sampling-filter-path {spec!r}: use one of {sorted(BUILTIN_GROUP_FILTERS)} or 'pkg.module:fn'"
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class DynamicSamplingResult:
    """The filled batch of one rollout and what it took."""

    samples: list[Sample]
    """``rollout_batch_size`` kept groups, prompt-major, ``group_index`` renumbered 0..rollout_batch_size-1."""
    metrics: dict[str, float]
    """``rollout/dynamic_sampling/{rounds,groups_generated,groups_dropped,groups_surplus,kept_frac}``."""


def _groups(samples: Sequence[Sample]) -> list[list[Sample]]:
    by_index: dict[int, list[Sample]] = {}
    for s in samples:
        by_index.setdefault(s.group_index, []).append(s)
    return list(by_index.values())


def sample_with_dynamic_filter(
    generate_groups: Callable[[list[Prompt]], Sequence[Sample]],
    prompts: Iterable[Prompt],
    *,
    rollout_batch_size: int,
    over_sampling_batch_size: int,
    group_filter: GroupFilter = reward_variance,
    max_rounds: int = 16,
) -> DynamicSamplingResult:
    """Generate rounds of groups until ``rollout_batch_size`` of them pass ``group_filter``.

    Args:
        generate_groups: Generates AND scores the groups of a list of prompts; returns their samples with
            ``group_index`` = the prompt's position in that list (e.g. ``generate_samples`` then
            ``score_samples``, on one engine or spread over several).
        prompts: Where the prompts come from; each round takes the next ``over_sampling_batch_size``.
        rollout_batch_size: Groups the rollout needs.
        over_sampling_batch_size: Prompts generated per round (``--over-sampling-batch-size``).
        group_filter: Keeps a group when it returns True (``--dynamic-sampling-filter-path``).
        max_rounds: Rounds allowed before giving up (``--dynamic-sampling-max-rounds``).

    Returns:
        The first ``rollout_batch_size`` kept groups (in generation order) and the metrics; groups kept
        beyond that in the last round are counted as surplus and discarded.

    Raises:
        ValueError: A batch size below 1.
        RolloutError: ``max_rounds`` rounds, or the end of ``prompts``, came before the batch was full.
    """
    if rollout_batch_size < 1 or over_sampling_batch_size < 1:
        raise ValueError(
            f"rollout_batch_size ({rollout_batch_size}) and --over-sampling-batch-size "
            f"({over_sampling_batch_size}) must be >= 1"
        )
    source: Iterator[Prompt] = iter(prompts)
    kept: list[list[Sample]] = []
    generated = dropped = rounds = 0
    while len(kept) < rollout_batch_size:
        if rounds == max_rounds:
            raise RolloutError(
                f"dynamic sampling kept {len(kept)} of {rollout_batch_size} groups after {rounds} rounds "
                f"({generated} groups generated, {dropped} dropped by the filter); the prompts are too easy or too "
                "hard for the policy: raise --dynamic-sampling-max-rounds or --over-sampling-batch-size, or change "
                "--dynamic-sampling-filter-path"
            )
        batch = list(itertools.islice(source, over_sampling_batch_size))  # takes no prompt beyond
        if not batch:
            raise RolloutError(
                f"dynamic sampling ran out of prompts with {len(kept)} of {rollout_batch_size} groups kept "
                f"after {rounds} rounds"
            )
        rounds += 1
        groups = _groups(generate_groups(batch))
        if len(groups) != len(batch):
            raise RolloutError(f"generate_groups returned {len(groups)} groups for {len(batch)} prompts")
        generated += len(groups)
        passing = [group for group in groups if group_filter(group)]
        dropped += len(groups) - len(passing)
        kept += passing
        logger.info(
            "dynamic sampling round %d: %d/%d groups kept, %d/%d in the batch",
            rounds, len(passing), len(groups), min(len(kept), rollout_batch_size), rollout_batch_size,
        )  # fmt: skip
    surplus = len(kept) - rollout_batch_size
    samples = [
        dataclasses.replace(s, group_index=new_index)
        for new_index, group in enumerate(kept[:rollout_batch_size])
        for s in group
    ]
    metrics = {
        "rollout/dynamic_sampling/rounds": float(rounds),
        "rollout/dynamic_sampling/groups_generated": float(generated),
        "rollout/dynamic_sampling/groups_dropped": float(dropped),
        "rollout/dynamic_sampling/groups_surplus": float(surplus),
        "rollout/dynamic_sampling/kept_frac": (generated - dropped) / generated,
    }
    return DynamicSamplingResult(samples=samples, metrics=metrics)
