"""Over-sampling with dynamic filtering (DAPO) on the session's real SGLang server."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest
from tidal.rollout import (
    RolloutConfig,
    RolloutError,
    Sample,
    SGLangEngine,
    generate_samples,
    resolve_group_filter,
    resolve_reward_fn,
    reward_variance,
    sample_with_dynamic_filter,
    score_samples,
)

# Two prompts; "const" groups always get reward 1.0 (no signal), "parity" groups vary with the sampled tokens.
PROMPTS = [([3, 4, 5], "const"), ([6, 7, 8], "parity")]


def _generator(engine: SGLangEngine, cfg: RolloutConfig, reward: str) -> Callable[[list], list[Sample]]:
    reward_fn = resolve_reward_fn(reward)

    def generate_groups(batch: list) -> list[Sample]:
        samples = generate_samples(
            engine, [ids for ids, _ in batch], cfg.sampling_params(), labels=[label for _, label in batch]
        )
        return score_samples(samples, reward_fn)

    return generate_groups


@pytest.fixture
def cfg(plugins: str) -> RolloutConfig:
    return RolloutConfig(
        n_samples_per_prompt=4,
        rollout_max_response_len=3,
        rollout_temperature=2.0,  # flat enough that parity groups are rarely uniform
        custom_rm_path=f"{plugins}:parity_reward",
        over_sampling_batch_size=4,
        dynamic_sampling_filter_path="reward_variance",
        dynamic_sampling_max_rounds=12,
    )


def test_batch_fills_with_groups_that_have_reward_variance(sglang_server: SGLangEngine, cfg: RolloutConfig) -> None:
    result = sample_with_dynamic_filter(
        _generator(sglang_server, cfg, cfg.custom_rm_path),
        itertools.cycle(PROMPTS),
        rollout_batch_size=3,
        over_sampling_batch_size=cfg.over_sampling_batch_size,
        group_filter=resolve_group_filter(cfg.dynamic_sampling_filter_path),
        max_rounds=cfg.dynamic_sampling_max_rounds,
    )
    assert [s.group_index for s in result.samples] == [0] * 4 + [1] * 4 + [2] * 4
    for g in range(3):
        group = result.samples[4 * g : 4 * g + 4]
        assert {s.label for s in group} == {"parity"}
        assert len({s.reward for s in group}) > 1
    m = result.metrics
    rounds = m["rollout/dynamic_sampling/rounds"]
    assert rounds >= 2  # a round holds only 2 parity groups
    assert m["rollout/dynamic_sampling/groups_generated"] == 4 * rounds
    assert m["rollout/dynamic_sampling/groups_dropped"] >= 2 * rounds  # every const group
    kept = m["rollout/dynamic_sampling/groups_generated"] - m["rollout/dynamic_sampling/groups_dropped"]
    assert kept - m["rollout/dynamic_sampling/groups_surplus"] == 3
    assert m["rollout/dynamic_sampling/kept_frac"] == kept / m["rollout/dynamic_sampling/groups_generated"]


def test_every_prompt_is_used_once_in_order(sglang_server: SGLangEngine, cfg: RolloutConfig) -> None:
    prompts = iter([([3, 4], 0), ([5, 6], 1), ([7, 8], 2), ([9, 10], 3), ([11, 12], 4)])
    result = sample_with_dynamic_filter(
        _generator(sglang_server, cfg, cfg.custom_rm_path), prompts, rollout_batch_size=4,
        over_sampling_batch_size=2, group_filter=lambda group: True, max_rounds=2,
    )  # fmt: skip
    assert [s.label for s in result.samples] == [0] * 4 + [1] * 4 + [2] * 4 + [3] * 4
    assert next(prompts) == ([11, 12], 4)  # no prompt consumed beyond the two rounds
    assert result.metrics["rollout/dynamic_sampling/groups_dropped"] == 0.0


def test_rounds_are_bounded_and_prompts_can_run_out(
    sglang_server: SGLangEngine, cfg: RolloutConfig, plugins: str
) -> None:
    generate_groups = _generator(sglang_server, cfg, cfg.custom_rm_path)
    keep_nothing = resolve_group_filter(f"{plugins}:keep_nothing")
    with pytest.raises(RolloutError, match=r"kept 0 of 2 groups after 2 rounds \(4 groups generated, 4 dropped"):
        sample_with_dynamic_filter(
            generate_groups, itertools.cycle(PROMPTS), rollout_batch_size=2, over_sampling_batch_size=2,
            group_filter=keep_nothing, max_rounds=2,
        )  # fmt: skip
    with pytest.raises(RolloutError, match="ran out of prompts with 0 of 2 groups kept after 1 rounds"):
        sample_with_dynamic_filter(
            generate_groups, [PROMPTS[0]], rollout_batch_size=2, over_sampling_batch_size=4, max_rounds=5
        )


def test_group_filter_resolution_and_built_in() -> None:
    assert resolve_group_filter("reward_variance") is reward_variance
    with pytest.raises(ValueError, match=r"--dynamic-sampling-filter-path 'std': use one of \['reward_variance'\]"):
        resolve_group_filter("std")
    with pytest.raises(ValueError, match="--dynamic-sampling-filter-path 'no_such_mod_xyz:f': cannot import"):
        resolve_group_filter("no_such_mod_xyz:f")

    def sample(reward: float | None) -> Sample:
        return Sample(prompt_ids=[1], response_ids=[2], response_log_probs=[-1.0], finish_reason="stop", reward=reward)

    assert reward_variance([sample(0.0), sample(1.0)]) is True
    assert reward_variance([sample(1.0), sample(1.0)]) is False
    with pytest.raises(ValueError, match="needs scored samples"):
        reward_variance([sample(None), sample(1.0)])
