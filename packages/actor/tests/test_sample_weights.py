"""The advantages and loss weights the trainer builds for a rollout, against plain-Python references.

``train_on_rollout`` packs exactly these token fields (test_trainer.py checks the packed micro-batches); the loss
tests feed weights of their own, so only these tests see the trainer build them wrong.
"""

import math
import statistics

import pytest
import torch
from tidal.actor import ActorConfig
from tidal.actor.sample_weights import response_len, sample_weights

# Two prompts x 3 samples: prompt tokens (0), response tokens (1), a masked tool output in the middle of one.
MASKS = [[0, 0, 1, 1, 1], [0, 1], [0, 0, 0, 1, 0, 1, 1], [0, 1, 1, 1], [0, 0], [0, 0, 1, 1]]
REWARDS = [1.0, 0.0, 0.0, 0.25, 1.0, -0.5]


def _cfg(**kw) -> ActorConfig:
    return ActorConfig(hf_checkpoint="unused", **kw)


def _grpo(rewards, group_size, *, std: bool) -> list[float]:
    out = []
    for g in range(0, len(rewards), group_size):
        group = rewards[g : g + group_size]
        mean, sd = statistics.fmean(group), statistics.stdev(group)
        out += [(r - mean) / (sd + 1e-6) if std else r - mean for r in group]
    return out


def _per_token(values, masks):
    return [[v] * len(m) for v, m in zip(values, masks, strict=True)]


def test_grpo_advantages_and_per_sample_loss_weights_on_every_token():
    w = sample_weights(_cfg(), loss_masks=MASKS, rewards=REWARDS, group_size=3)
    expected = _grpo(REWARDS, 3, std=True)
    assert w.advantages.tolist() == pytest.approx(expected, rel=1e-5)
    assert expected[0] > 0 > expected[1] and expected[4] > 0 > expected[5]  # the sign follows the reward
    got = w.token_fields["advantages"]
    assert [len(a) for a in got] == [len(m) for m in MASKS]
    for row, exp in zip(got, _per_token(expected, MASKS), strict=True):
        assert row == pytest.approx(exp, rel=1e-5)
    # slime's default aggregation: each sample's tokens weigh 1 / its response tokens (1 when it has none)
    assert w.token_fields["loss_weights"] == _per_token([1 / 3, 1.0, 1 / 3, 1 / 3, 1.0, 1 / 2], MASKS)
    assert w.penalty.tolist() == [0.0] * len(MASKS)


def test_std_normalization_follows_the_config_unless_the_caller_overrides_it():
    """--disable-grpo-std-normalization leaves the group's std out of the advantage."""
    plain = _grpo(REWARDS, 3, std=False)
    off = sample_weights(_cfg(disable_grpo_std_normalization=True), loss_masks=MASKS, rewards=REWARDS, group_size=3)
    assert off.advantages.tolist() == pytest.approx(plain, abs=1e-6)
    forced = sample_weights(_cfg(), loss_masks=MASKS, rewards=REWARDS, group_size=3, normalize_std=False)
    assert forced.advantages.tolist() == pytest.approx(plain, abs=1e-6)
    on = sample_weights(
        _cfg(disable_grpo_std_normalization=True), loss_masks=MASKS, rewards=REWARDS, group_size=3, normalize_std=True
    )
    assert on.advantages.tolist() == pytest.approx(_grpo(REWARDS, 3, std=True), rel=1e-5)


def test_rloo_baseline_leaves_each_sample_out():
    w = sample_weights(_cfg(advantage_estimator="rloo"), loss_masks=MASKS, rewards=REWARDS, group_size=3)
    expected = []
    for i, r in enumerate(REWARDS):
        others = [REWARDS[j] for j in range(3 * (i // 3), 3 * (i // 3) + 3) if j != i]
        expected.append(r - statistics.fmean(others))
    assert w.advantages.tolist() == pytest.approx(expected, abs=1e-6)


def test_per_token_loss_packs_no_loss_weights():
    """--calculate-per-token-loss: no per-sample loss weights (each token weighs the same)."""
    w = sample_weights(_cfg(calculate_per_token_loss=True), loss_masks=MASKS, rewards=REWARDS, group_size=3)
    assert set(w.token_fields) == {"advantages"}


def test_overlong_penalty_is_added_to_the_reward_before_the_advantage():
    """--overlong-buffer-len and --overlong-penalty-factor shape the reward of long responses."""
    # L_max 6, buffer 4: 0 up to 2 response tokens, then -factor/4 per token past 2 (response from the first 1)
    cfg = _cfg(advantage_estimator="reinforce_plus_plus", max_response_len=6, overlong_buffer_len=4,
               overlong_penalty_factor=0.5)  # fmt: skip
    w = sample_weights(cfg, loss_masks=MASKS, rewards=REWARDS, group_size=3)
    lengths = [response_len(m) for m in MASKS]
    assert lengths == [3, 1, 4, 3, 0, 2]
    expected_penalty = [-0.5 * max(n - 2, 0) / 4 for n in lengths]
    assert w.penalty.tolist() == pytest.approx(expected_penalty)
    assert min(expected_penalty) < 0
    # reinforce++: the sample's advantage term is its shaped reward
    assert w.advantages.tolist() == pytest.approx([r + p for r, p in zip(REWARDS, expected_penalty, strict=True)])


def test_wrong_group_size_is_refused():
    with pytest.raises(ValueError, match="group_size=4"):
        sample_weights(_cfg(), loss_masks=MASKS, rewards=REWARDS, group_size=4)


CUSTOM = """
import torch

SEEN = []


def scaled(rewards, *, group_size, normalize_std):
    SEEN.append((rewards.tolist(), group_size, normalize_std))
    return (rewards * 2.0).double()  # the trainer's tensors are float32 whatever the function returns


def too_short(rewards, *, group_size, normalize_std):
    return rewards[:-1]
"""


def test_custom_advantage_function_gets_the_shaped_rewards_and_must_return_one_per_sample(tmp_path, monkeypatch):
    (tmp_path / "my_weights.py").write_text(CUSTOM)
    monkeypatch.syspath_prepend(str(tmp_path))
    import my_weights

    my_weights.SEEN.clear()  # a module imported by an earlier run of this test in the same process keeps its list
    cfg = _cfg(custom_advantage_function_path="my_weights:scaled", disable_grpo_std_normalization=True,
               max_response_len=6, overlong_buffer_len=4)  # fmt: skip
    w = sample_weights(cfg, loss_masks=MASKS, rewards=REWARDS, group_size=3)
    shaped = [r + p for r, p in zip(REWARDS, w.penalty.tolist(), strict=True)]
    [(seen_rewards, seen_group_size, seen_std)] = my_weights.SEEN
    assert seen_rewards == pytest.approx(shaped) and seen_group_size == 3 and seen_std is False
    assert w.advantages.tolist() == pytest.approx([2 * s for s in shaped])
    assert w.advantages.dtype == torch.float32
    missing = _cfg(custom_advantage_function_path="my_weights:nowhere")
    with pytest.raises(ValueError, match=r"^--custom-advantage-function-path 'my_weights:nowhere': cannot load it"):
        sample_weights(missing, loss_masks=MASKS, rewards=REWARDS, group_size=3)
    bad = _cfg(custom_advantage_function_path="my_weights:too_short")
    with pytest.raises(
        ValueError, match=r"--custom-advantage-function-path 'my_weights:too_short' returned shape \(5,\)"
    ):
        sample_weights(bad, loss_masks=MASKS, rewards=REWARDS, group_size=3)


def test_response_len_counts_from_the_first_trained_token():
    assert response_len([0, 0, 1, 0, 1, 0]) == 4
    assert response_len([1]) == 1 and response_len([0, 0]) == 0 and response_len([]) == 0
    assert math.isclose(sum(sample_weights(_cfg(), loss_masks=[[0, 1]], rewards=[1.0], group_size=1).advantages), 0)


def test_an_agent_episode_of_several_trajectories_counts_as_one_sample():
    """Episode 0 rewrote its history (two samples): it gets the advantage its reward earns among its group's
    episodes, on every token of both samples, and the two share one sample's loss weight."""
    masks = [[0, 1, 1], [0, 0, 1, 1, 1], *MASKS[1:]]  # episode 0 = samples 0 and 1; then one sample per episode
    rewards = [REWARDS[0], REWARDS[0], *REWARDS[1:]]
    ids = [0, 0, 1, 2, 3, 4, 5]
    w = sample_weights(_cfg(), loss_masks=masks, rewards=rewards, group_size=3, episode_ids=ids)
    episode_adv = _grpo(REWARDS, 3, std=True)
    assert w.advantages.tolist() == pytest.approx([episode_adv[e] for e in ids], rel=1e-5)
    weights = w.token_fields["loss_weights"]
    assert weights[0] == [1 / 5] * 3 and weights[1] == [1 / 5] * 5  # 2 + 3 sampled tokens in the episode
    for m, mw in zip(masks[2:], weights[2:], strict=True):
        assert mw == [1 / max(sum(m), 1)] * len(m)
    # every episode weighs one: the episode's trajectories together as much as any other sample
    per_episode = [0.0] * 6
    for e, m, mw in zip(ids, masks, weights, strict=True):
        per_episode[e] += sum(a * b for a, b in zip(m, mw, strict=True))
    assert per_episode == pytest.approx([1.0, 1.0, 1.0, 1.0, 0.0, 1.0])  # sample 4 has no response token


def test_episode_ids_that_split_an_episode_or_disagree_on_its_reward_are_refused():
    masks, rewards = [[0, 1]] * 4, [1.0, 1.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="consecutive"):
        sample_weights(_cfg(), loss_masks=masks, rewards=rewards, group_size=1, episode_ids=[0, 1, 0, 2])
    with pytest.raises(ValueError, match="sample 1 has another reward than the rest of its episode 0"):
        sample_weights(_cfg(), loss_masks=masks, rewards=[1.0, 0.0, 0.0, 0.0], group_size=1, episode_ids=[0, 0, 1, 2])
    with pytest.raises(ValueError, match="3 entries for 4 samples"):
        sample_weights(_cfg(), loss_masks=masks, rewards=rewards, group_size=1, episode_ids=[0, 0, 1])
