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


def _label_filter(group) -> bool:
    return group[0].label == "keep"


def test_partial_rollout_path_runs_rounds_until_the_filter_keeps_enough(
    sglang_server: SGLangEngine, cfg: RolloutConfig
) -> None:
    """What `train` calls: generate_partial_rollout with a group filter and further rounds of prompts."""
    from tidal.rollout import generate_partial_rollout

    asked: list[int] = []

    def more_prompts(round_no: int):
        asked.append(round_no)
        return [([11, 12, 13], "keep")]  # one prompt a round: the count of finished groups is exact

    result = generate_partial_rollout(
        sglang_server, [[3, 4, 5], [6, 7]], cfg.sampling_params(), num_groups=2, labels=["drop", "keep"],
        reward_fn=resolve_reward_fn(cfg.custom_rm_path), group_filter=_label_filter, max_rounds=3,
        more_prompts=more_prompts,
    )  # fmt: skip
    assert asked == [2]  # round 2 filled the batch: round 3 was never asked for
    assert [(list(s.prompt_ids), s.group_index) for s in result.samples] == [([6, 7], 0)] * 4 + [([11, 12, 13], 1)] * 4
    assert all(s.reward is not None and s.finish_reason != "abort" for s in result.samples)
    assert {k: v for k, v in result.metrics.items() if "dynamic_sampling" in k} == {
        "rollout/dynamic_sampling/rounds": 2.0,
        "rollout/dynamic_sampling/groups_generated": 3.0,
        "rollout/dynamic_sampling/groups_dropped": 1.0,
        "rollout/dynamic_sampling/groups_surplus": 0.0,
        "rollout/dynamic_sampling/kept_frac": 2 / 3,
    }


def test_partial_rollout_path_stops_with_one_line_after_the_last_round(
    sglang_server: SGLangEngine, cfg: RolloutConfig, plugins: str
) -> None:
    from tidal.rollout import generate_partial_rollout

    asked: list[int] = []

    def more_prompts(round_no: int):
        asked.append(round_no)
        return [([11, 12, 13], "keep")]

    kwargs = dict(num_groups=1, labels=["keep"], reward_fn=resolve_reward_fn(cfg.custom_rm_path))
    keep_nothing = resolve_group_filter(f"{plugins}:keep_nothing")
    message = (
        r"^dynamic sampling kept 0 of 1 groups after 3 round\(s\) \(3 groups generated, 3 dropped by the filter\); "
        r"the prompts are too easy or too hard for the policy: raise --dynamic-sampling-max-rounds or "
        r"--over-sampling-batch-size, or change --dynamic-sampling-filter-path$"
    )
    with pytest.raises(RolloutError, match=message):
        generate_partial_rollout(sglang_server, [[3, 4]], cfg.sampling_params(), group_filter=keep_nothing,
                                 max_rounds=3, more_prompts=more_prompts, **kwargs)  # fmt: skip
    assert asked == [2, 3]
    with pytest.raises(RolloutError, match=r"kept 0 of 1 groups when the prompts ran out after 1 round\(s\)"):
        generate_partial_rollout(sglang_server, [[3, 4]], cfg.sampling_params(), group_filter=keep_nothing,
                                 max_rounds=3, more_prompts=lambda r: [], **kwargs)  # fmt: skip


def test_partial_rollout_path_runs_a_custom_generate_function(
    sglang_server: SGLangEngine, cfg: RolloutConfig, plugins: str
) -> None:
    from tidal.rollout import generate_partial_rollout, load_generate_fn
    from transformers import AutoTokenizer

    fn = load_generate_fn(f"{plugins}:two_turn_tool_task")
    tool = AutoTokenizer.from_pretrained(sglang_server.model_path).encode("the answer is 4")
    params = {**cfg.sampling_params(), "n": 2, "ignore_eos": True}
    result = generate_partial_rollout(
        sglang_server, [[3, 4, 5], [6, 7], [8, 9]], params, num_groups=1, labels=["drop", "keep", "keep"],
        reward_fn=resolve_reward_fn(cfg.custom_rm_path), group_filter=_label_filter, generate_fn=fn,
        max_concurrency=1, more_prompts=lambda r: [], decode=lambda ids: f"{len(ids)} tokens",
    )  # fmt: skip
    # Group by group, in prompt order: "drop" was dropped, the first "keep" filled the batch, the last one was
    # cancelled before it started and is handed back unstarted.
    assert [list(s.prompt_ids) for s in result.samples] == [[6, 7]] * 2
    turn = cfg.rollout_max_response_len
    for s in result.samples:  # two turns around the tool's tokens, which the loss does not see
        assert list(s.response_ids[turn : turn + len(tool)]) == tool
        assert s.response_loss_mask == [1] * turn + [0] * len(tool) + [1] * (len(s.response_ids) - turn - len(tool))
        assert s.response_text == f"{len(s.response_ids)} tokens" and s.reward is not None and s.label == "keep"
    assert result.metrics["rollout/dynamic_sampling/groups_dropped"] == 1.0
    assert [[(list(s.prompt_ids), len(s.response_ids)) for s in group] for group in result.carry_over] == [
        [([8, 9], 0)] * 2
    ]
    with pytest.raises(ValueError, match=r"^--custom-generate-function-path: a custom generate function's sample"):
        generate_partial_rollout(sglang_server, [], params, num_groups=1, carry_over=[result.samples], generate_fn=fn)
