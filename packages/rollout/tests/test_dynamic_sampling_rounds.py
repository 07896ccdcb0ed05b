"""The rounds of dynamic sampling: which groups are kept, in what order, and when it gives up.

``sample_with_dynamic_filter`` takes any ``generate_groups``; here the groups' rewards are set by the prompt's
label ("mixed" groups vary, "easy" and "hard" ones do not), so each round's outcome is known in advance (the
SGLang-backed runs are in test_dynamic_sampling.py).
"""

from __future__ import annotations

import pytest
from tidal.rollout import RolloutError, Sample, reward_variance, sample_with_dynamic_filter

GROUP = 3
REWARDS = {"mixed": [1.0, 0.0, 1.0], "easy": [1.0, 1.0, 1.0], "hard": [0.0, 0.0, 0.0]}


def _prompts(*labels: str) -> list[tuple[list[int], str]]:
    return [([i], label) for i, label in enumerate(labels)]


def generate_groups(batch: list[tuple[list[int], str]]) -> list[Sample]:
    """GROUP scored samples per prompt, ``group_index`` = the prompt's position in ``batch``."""
    return [
        Sample(
            prompt_ids=ids,
            response_ids=[k],
            response_log_probs=[-1.0],
            finish_reason="stop",
            label=label,
            reward=REWARDS[label][k],
            group_index=position,
        )
        for position, (ids, label) in enumerate(batch)
        for k in range(GROUP)
    ]


def test_keeps_the_first_groups_with_signal_in_order_and_renumbers_them():
    prompts = iter(_prompts("mixed", "easy", "mixed", "hard", "mixed", "mixed"))
    result = sample_with_dynamic_filter(generate_groups, prompts, rollout_batch_size=3, over_sampling_batch_size=2)
    # round 1: mixed (kept), easy (dropped); round 2: mixed (kept), hard (dropped); round 3: mixed, mixed (1 surplus)
    assert [s.prompt_ids[0] for s in result.samples] == [0] * 3 + [2] * 3 + [4] * 3
    assert [s.group_index for s in result.samples] == [0] * 3 + [1] * 3 + [2] * 3
    assert [s.reward for s in result.samples] == REWARDS["mixed"] * 3
    assert result.metrics == {
        "rollout/dynamic_sampling/rounds": 3.0,
        "rollout/dynamic_sampling/groups_generated": 6.0,
        "rollout/dynamic_sampling/groups_dropped": 2.0,
        "rollout/dynamic_sampling/groups_surplus": 1.0,
        "rollout/dynamic_sampling/kept_frac": 4 / 6,
    }
    assert list(prompts) == []  # every prompt of the 3 rounds was taken


def test_takes_no_prompt_beyond_the_round_that_fills_the_batch():
    prompts = iter(_prompts("mixed", "mixed", "hard", "hard"))
    result = sample_with_dynamic_filter(generate_groups, prompts, rollout_batch_size=2, over_sampling_batch_size=2)
    assert result.metrics["rollout/dynamic_sampling/rounds"] == 1.0
    assert result.metrics["rollout/dynamic_sampling/groups_surplus"] == 0.0
    assert [p[0] for p in prompts] == [[2], [3]]


def test_the_last_allowed_round_may_fill_the_batch_and_one_fewer_may_not():
    labels = ("hard", "easy", "mixed", "mixed")
    result = sample_with_dynamic_filter(
        generate_groups, _prompts(*labels), rollout_batch_size=2, over_sampling_batch_size=2, max_rounds=2
    )
    assert result.metrics["rollout/dynamic_sampling/rounds"] == 2.0
    assert result.metrics["rollout/dynamic_sampling/kept_frac"] == 0.5
    with pytest.raises(RolloutError, match=r"kept 0 of 2 groups after 1 rounds \(2 groups generated, 2 dropped"):
        sample_with_dynamic_filter(
            generate_groups, _prompts(*labels), rollout_batch_size=2, over_sampling_batch_size=2, max_rounds=1
        )


def test_running_out_of_prompts_names_what_was_kept():
    with pytest.raises(RolloutError, match="ran out of prompts with 1 of 2 groups kept after 2 rounds"):
        sample_with_dynamic_filter(
            generate_groups, _prompts("mixed", "easy", "hard"), rollout_batch_size=2, over_sampling_batch_size=2
        )


def test_a_custom_filter_sees_whole_groups_and_decides():
    seen = []

    def only_hard(group):
        seen.append([s.label for s in group])
        return all(s.reward == 0.0 for s in group)

    result = sample_with_dynamic_filter(
        generate_groups, _prompts("mixed", "hard"), rollout_batch_size=1, over_sampling_batch_size=2,
        group_filter=only_hard,
    )  # fmt: skip
    assert seen == [["mixed"] * GROUP, ["hard"] * GROUP]
    assert [s.label for s in result.samples] == ["hard"] * GROUP and {s.group_index for s in result.samples} == {0}


def test_bad_sizes_and_a_generator_that_loses_groups_are_refused():
    for sizes in ({"rollout_batch_size": 0, "over_sampling_batch_size": 2},
                  {"rollout_batch_size": 2, "over_sampling_batch_size": 0}):  # fmt: skip
        with pytest.raises(ValueError, match="must be >= 1"):
            sample_with_dynamic_filter(generate_groups, _prompts("mixed"), **sizes)

    def loses_one(batch):
        return generate_groups(batch[:-1])

    with pytest.raises(RolloutError, match="returned 1 groups for 2 prompts"):
        sample_with_dynamic_filter(loses_one, _prompts("mixed", "mixed"), rollout_batch_size=1,
                                   over_sampling_batch_size=2)  # fmt: skip


def test_one_prompt_per_round_is_enough_and_each_round_is_logged(caplog):
    with caplog.at_level("INFO", logger="tidal.rollout.dynamic_sampling"):
        result = sample_with_dynamic_filter(
            generate_groups, _prompts("easy", "mixed", "mixed"), rollout_batch_size=2, over_sampling_batch_size=1
        )
    assert result.metrics["rollout/dynamic_sampling/rounds"] == 3.0
    assert caplog.messages == [
        "dynamic sampling round 1: 0/1 groups kept, 0/2 in the batch",
        "dynamic sampling round 2: 1/1 groups kept, 1/2 in the batch",
        "dynamic sampling round 3: 1/1 groups kept, 2/2 in the batch",
    ]


def test_sixteen_rounds_by_default_and_the_message_names_every_knob():
    endless = iter(lambda: ([1], "easy"), None)
    with pytest.raises(RolloutError) as e:
        sample_with_dynamic_filter(generate_groups, endless, rollout_batch_size=1, over_sampling_batch_size=2)
    assert str(e.value) == (
        "dynamic sampling kept 0 of 1 groups after 16 rounds (32 groups generated, 32 dropped by the filter); the "
        "prompts are too easy or too hard for the policy: raise --dynamic-sampling-max-rounds or "
        "--over-sampling-batch-size, or change --dynamic-sampling-filter-path"
    )


def test_an_unscored_group_of_one_names_its_group():
    unscored = Sample(prompt_ids=[1], response_ids=[2], response_log_probs=[-1.0], finish_reason="stop", group_index=5)
    with pytest.raises(ValueError, match=r"^dynamic sampling needs scored samples; group 5 has one unscored$"):
        reward_variance([unscored])
