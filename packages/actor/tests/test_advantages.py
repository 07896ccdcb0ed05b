"""Each --advantage-estimator against its paper's formula, computed with plain Python on a hand-made batch.

The batch: groups of different sizes (3, 1, 4, 2), responses with a prompt, a masked-out middle token
(a tool output) and a padding tail, so token-level and sample-level masks both matter.
"""

import dataclasses
import itertools
import math
import statistics

import pytest
import torch
from tidal.actor import ActorConfig
from tidal.actor.advantages import (
    ADVANTAGE_ESTIMATORS,
    compute_advantages,
    explained_variance,
    explained_variance_sums,
    gae_advantages,
    grpo_advantages,
    overlong_penalty,
    sequence_mean,
    token_advantages,
    whiten,
    whiten_sums,
)
from tidal.actor.config import _ADVANTAGE_ESTIMATORS
from tidal.actor.sample_weights import response_len
from tidal.actor.trainer import _gae, _shaped_advantages, _token_level
from tidal.batching import pack

REWARDS = [1.0, 0.0, 0.5, 0.7, 0.0, 1.0, 1.0, 0.25, 2.0, -1.0]
GROUPS = [0, 0, 0, 1, 2, 2, 2, 2, 3, 3]


def groups():
    out: dict[int, list[int]] = {}
    for i, g in enumerate(GROUPS):
        out.setdefault(g, []).append(i)
    return out.values()


def test_estimator_lists_agree():
    assert _ADVANTAGE_ESTIMATORS == ADVANTAGE_ESTIMATORS


@pytest.mark.parametrize("normalize_std", [True, False])
def test_grpo_and_dr_grpo_formula_on_groups_of_different_sizes(normalize_std):
    # GRPO: A_i = (r_i - mean(group)) / (std(group) + eps); Dr.GRPO (no std normalisation): A_i = r_i - mean(group)
    expected = [0.0] * len(REWARDS)
    for members in groups():
        rs = [REWARDS[i] for i in members]
        mean = statistics.fmean(rs)
        std = statistics.stdev(rs) if len(rs) > 1 else None
        for i in members:
            expected[i] = (REWARDS[i] - mean) / (std + 1e-6) if normalize_std and std is not None else REWARDS[i] - mean
    for estimator in ("grpo", "gspo", "cispo"):  # gspo and cispo take GRPO's advantages
        got = compute_advantages(
            torch.tensor(REWARDS), 0, estimator=estimator, normalize_std=normalize_std, group_ids=torch.tensor(GROUPS)
        )
        torch.testing.assert_close(got, torch.tensor(expected), rtol=1e-5, atol=1e-6)


def test_fixed_group_size_matches_group_ids():
    rewards = torch.tensor(REWARDS[:8])
    ids = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    torch.testing.assert_close(grpo_advantages(rewards, 2), grpo_advantages(rewards, 0, group_ids=ids))


def test_rloo_formula():
    # RLOO: A_i = r_i - 1/(n-1) * sum_{j != i} r_j; a group of one has no baseline and no signal
    expected = []
    for i, g in enumerate(GROUPS):
        others = [REWARDS[j] for j, h in enumerate(GROUPS) if h == g and j != i]
        expected.append(REWARDS[i] - sum(others) / len(others) if others else 0.0)
    got = compute_advantages(torch.tensor(REWARDS), 0, estimator="rloo", group_ids=torch.tensor(GROUPS))
    torch.testing.assert_close(got, torch.tensor(expected), rtol=1e-5, atol=1e-6)


# Packed batch: three samples, prompt tokens (mask 0), a tool output inside the response (mask 0), padding tail.
MASKS = [[0, 0, 1, 1, 0, 1, 1], [0, 1, 1, 1], [0, 0, 0, 1, 1]]
SAMPLE_REWARDS = [1.0, -0.5, 2.0]
KL = [[0.0, 0.0, 0.1, -0.2, 0.5, 0.3, 0.05], [0.0, 0.2, 0.2, -0.1], [0.0, 0.0, 0.0, 0.4, 0.1]]


def packed_batch():
    seqs = [list(range(1, len(m) + 1)) for m in MASKS]
    ref = [[-1.0 - 0.1 * t for t in range(len(m))] for m in MASKS]
    old = [[r + k for r, k in zip(rs, ks, strict=True)] for rs, ks in zip(ref, KL, strict=True)]
    fields = {
        "advantages": [[r] * len(m) for r, m in zip(SAMPLE_REWARDS, MASKS, strict=True)],
        "old_log_probs": old,
        "ref_log_probs": ref,
    }
    return pack(seqs, loss_masks=MASKS, token_fields=fields, pad_to_multiple_of=8)


def reinforce_pp_reference(kl_coef, gamma, baseline):
    """REINFORCE++: r_t = -kl_coef * KL_t (+ the reward on the last action), A_t = sum_{s>=t} gamma^(s-t) r_s;
    the baseline variant: A_t = reward - kl_coef * KL_t; then whitened over every action token of the batch."""
    per_sample = []
    for mask, kl, reward in zip(MASKS, KL, SAMPLE_REWARDS, strict=True):
        actions = [t for t, m in enumerate(mask) if m]
        rs = [-kl_coef * kl[t] for t in actions]
        if baseline:
            per_sample.append({t: reward + r for t, r in zip(actions, rs, strict=True)})
            continue
        rs[-1] += reward
        per_sample.append({t: sum(gamma ** (s - k) * rs[s] for s in range(k, len(rs))) for k, t in enumerate(actions)})
    values = [v for d in per_sample for v in d.values()]
    mean, var = statistics.fmean(values), statistics.pvariance(values)
    out = []
    for mask, d in zip(MASKS, per_sample, strict=True):
        out += [(d[t] - mean) / (var + 1e-8) ** 0.5 if m else 0.0 for t, m in enumerate(mask)]
    return torch.tensor(out + [0.0] * 8)[: packed_batch().tokens.numel()]


@pytest.mark.parametrize(
    ("estimator", "kl_coef", "gamma"),
    [
        ("reinforce_plus_plus", 0.0, 1.0),
        ("reinforce_plus_plus", 0.1, 1.0),
        ("reinforce_plus_plus", 0.1, 0.9),
        ("reinforce_plus_plus_baseline", 0.1, 1.0),
    ],
)
def test_reinforce_plus_plus_formula(estimator, kl_coef, gamma):
    mb = packed_batch()
    cfg = ActorConfig(hf_checkpoint="x", advantage_estimator=estimator, kl_coef=kl_coef, gamma=gamma)
    # the trainer's path: two micro-batches of one rollout are whitened together (here: the batch twice)
    ((got, again),) = _token_level([[mb, mb]], cfg, device="cpu")
    expected = reinforce_pp_reference(kl_coef, gamma, baseline=estimator.endswith("baseline"))
    torch.testing.assert_close(got.token_fields["advantages"], expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(again.token_fields["advantages"], expected, rtol=1e-5, atol=1e-5)
    mask = mb.loss_mask.bool()
    whitened = got.token_fields["advantages"][mask]
    assert abs(float(whitened.mean())) < 1e-5
    assert float(whitened.var(unbiased=False)) == pytest.approx(1.0, rel=1e-4)


def test_reinforce_plus_plus_no_kl_gives_the_reward_on_every_action():
    mb = packed_batch()
    raw = token_advantages(
        mb.token_fields["advantages"], None, mb.loss_mask, mb.cu_seqlens, estimator="reinforce_plus_plus", kl_coef=0.0
    )
    expected = [r * m for r, mask in zip(SAMPLE_REWARDS, MASKS, strict=True) for m in mask]
    torch.testing.assert_close(raw[: len(expected)], torch.tensor(expected))
    assert whiten(raw, mb.loss_mask, whiten_sums(raw, mb.loss_mask))[mb.loss_mask == 0].abs().max() == 0


def test_kl_coef_shapes_the_advantage_per_token():
    # --kl-coef with a per-sample estimator: A_t = A - kl_coef * (log pi_old - log pi_ref) on action tokens, as the
    # trainer shapes its micro-batches from the actor's config; PPO takes the KL into its rewards instead (GAE)
    mb = packed_batch()
    ((got,),) = _shaped_advantages([[mb]], ActorConfig(hf_checkpoint="x", kl_coef=0.3), device="cpu")
    expected = [
        r - 0.3 * k * m
        for r, mask, kl in zip(SAMPLE_REWARDS, MASKS, KL, strict=True)
        for m, k in zip(mask, kl, strict=True)
    ]
    torch.testing.assert_close(got.token_fields["advantages"][: len(expected)], torch.tensor(expected), rtol=1e-5,
                               atol=1e-6)  # fmt: skip
    ppo = ActorConfig(hf_checkpoint="x", kl_coef=0.3, advantage_estimator="ppo")
    ((untouched,),) = _shaped_advantages([[mb]], ppo, device="cpu")
    assert torch.equal(untouched.token_fields["advantages"], mb.token_fields["advantages"])


def test_estimator_and_loss_flags_are_checked():
    with pytest.raises(ValueError, match="--advantage-estimator"):
        ActorConfig(hf_checkpoint="x", advantage_estimator="ppo2")
    with pytest.raises(ValueError, match="--gamma"):
        ActorConfig(hf_checkpoint="x", gamma=1.5)
    with pytest.raises(ValueError, match="--custom-loss-function-path"):
        ActorConfig(hf_checkpoint="x", loss_type="custom_loss")
    with pytest.raises(ValueError, match="--custom-advantage-function-path"):
        ActorConfig(hf_checkpoint="x", custom_advantage_function_path="no_colon")


def test_dapo_overlong_penalty_formula():
    # DAPO eq. 13: R = 0 if |y| <= L_max - L_cache, ((L_max - L_cache) - |y|) / L_cache if |y| <= L_max; x factor
    lengths, l_max, l_cache, factor = [3, 12, 13, 14, 16], 16, 4, 0.5
    expected = [factor * (0.0 if n <= l_max - l_cache else ((l_max - l_cache) - n) / l_cache) for n in lengths]
    got = overlong_penalty(torch.tensor(lengths), max_response_len=l_max, buffer_len=l_cache, penalty_factor=factor)
    torch.testing.assert_close(got, torch.tensor(expected))
    assert overlong_penalty(torch.tensor(lengths), max_response_len=16, buffer_len=0, penalty_factor=1.0).eq(0).all()
    assert response_len([0, 0, 1, 1, 0, 1]) == 4 and response_len([0, 0]) == 0
    with pytest.raises(ValueError, match="--overlong-buffer-len"):
        ActorConfig(hf_checkpoint="x", overlong_buffer_len=1024, max_response_len=1024)


# PPO: the critic's value of the state before each token (tidal's convention), on every position of the batch.
VALUES = [[0.0, 0.3, 0.5, -0.2, 9.0, 0.8, 0.1], [0.4, 0.6, -0.3, 0.2], [7.0, 7.0, 0.2, 0.9, -0.4]]


def gae_reference(kl_coef, gamma, lambd):
    """GAE straight from the definition on each sample's action tokens t = 0..n-1 (tool and prompt tokens skipped):
    r_t = -kl_coef * KL_t (+ the reward on the last action), delta_t = r_t + gamma * V_{t+1} - V_t with V_n = 0,
    A_t = sum_{l >= 0} (gamma * lambd)^l delta_{t+l}; returns R_t = A_t + V_t."""
    adv, ret = [], []
    for mask, kl, values, reward in zip(MASKS, KL, VALUES, SAMPLE_REWARDS, strict=True):
        actions = [t for t, m in enumerate(mask) if m]
        rs = [-kl_coef * kl[t] for t in actions]
        rs[-1] += reward
        vs = [values[t] for t in actions] + [0.0]
        deltas = [rs[k] + gamma * vs[k + 1] - vs[k] for k in range(len(rs))]
        a = {t: sum((gamma * lambd) ** (s - k) * deltas[s] for s in range(k, len(rs))) for k, t in enumerate(actions)}
        adv += [a.get(t, 0.0) for t in range(len(mask))]
        ret += [a[t] + values[t] if t in a else 0.0 for t in range(len(mask))]
    pad = packed_batch().tokens.numel() - len(adv)
    return torch.tensor(adv + [0.0] * pad), torch.tensor(ret + [0.0] * pad)


def ppo_batch():
    mb = packed_batch()
    values = torch.tensor([v for vs in VALUES for v in vs] + [5.0] * (mb.tokens.numel() - sum(map(len, VALUES))))
    return mb, values


@pytest.mark.parametrize(
    ("kl_coef", "gamma", "lambd"), [(0.0, 1.0, 1.0), (0.1, 1.0, 0.95), (0.2, 0.9, 0.8), (0.0, 0.99, 0.0)]
)
def test_gae_formula(kl_coef, gamma, lambd):
    mb, values = ppo_batch()
    kl = mb.token_fields["old_log_probs"] - mb.token_fields["ref_log_probs"]
    adv, ret = gae_advantages(
        mb.token_fields["advantages"],
        kl,
        values,
        mb.loss_mask,
        mb.cu_seqlens,
        kl_coef=kl_coef,
        gamma=gamma,
        lambd=lambd,
    )
    expected_adv, expected_ret = gae_reference(kl_coef, gamma, lambd)
    torch.testing.assert_close(adv, expected_adv, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ret, expected_ret, rtol=1e-5, atol=1e-5)
    if lambd == 1.0 and gamma == 1.0 and kl_coef == 0.0:  # Monte-Carlo: every action's return is the reward
        expected = [r * m for r, mask in zip(SAMPLE_REWARDS, MASKS, strict=True) for m in mask]
        torch.testing.assert_close(ret[: len(expected)], torch.tensor(expected))


def test_ppo_trainer_path_whitens_the_gae_advantages_over_the_rollout_and_keeps_raw_returns():
    mb, values = ppo_batch()
    mb = dataclasses.replace(mb, token_fields={**mb.token_fields, "old_values": values})
    cfg = ActorConfig(hf_checkpoint="x", advantage_estimator="ppo", kl_coef=0.1, gamma=0.9, lambd=0.8)
    ((got, again),), metrics = _gae([[mb, mb]], cfg, device="cpu")
    expected_adv, expected_ret = gae_reference(0.1, 0.9, 0.8)
    mask = mb.loss_mask.bool()
    raw = expected_adv[mask]
    whitened = (expected_adv - raw.mean()) / (raw.var(unbiased=False) + 1e-8) ** 0.5 * mb.loss_mask
    for out in (got, again):
        torch.testing.assert_close(out.token_fields["advantages"], whitened, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out.token_fields["returns"], expected_ret, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out.token_fields["old_values"], values)
    r, v = expected_ret[mask].double(), values[mask].double()
    assert metrics["critic/explained_variance"] == pytest.approx(
        float(1 - (r - v).var(unbiased=False) / r.var(unbiased=False))
    )
    assert metrics["critic/returns_mean"] == pytest.approx(float(r.mean()))


def test_explained_variance_of_a_perfect_and_a_constant_critic():
    returns, mask = torch.tensor([1.0, 2.0, 4.0, 9.0]), torch.tensor([1, 1, 1, 0])
    assert explained_variance(explained_variance_sums(returns, returns, mask)) == pytest.approx(1.0)
    assert explained_variance(explained_variance_sums(torch.full((4,), 2.0), returns, mask)) == pytest.approx(0.0)


def test_critic_flags_need_ppo():
    for kwargs, flag in (
        ({"value_clip": 0.2}, "--value-clip"),
        ({"num_critic_only_steps": 2}, "--num-critic-only-steps"),
        ({"lambd": 0.9}, "--lambd"),
        ({"critic_lr": 1e-5}, "--critic-lr"),
    ):
        with pytest.raises(ValueError, match=f"^{flag} .*--advantage-estimator ppo"):
            ActorConfig(hf_checkpoint="x", **kwargs)
        ActorConfig(hf_checkpoint="x", advantage_estimator="ppo", **kwargs)
    for kwargs, flag in (({"lambd": 1.5}, "--lambd"), ({"value_clip": 0.0}, "--value-clip")):
        with pytest.raises(ValueError, match=flag):
            ActorConfig(hf_checkpoint="x", advantage_estimator="ppo", **kwargs)
    with pytest.raises(ValueError, match="--custom-advantage-function-path"):
        ActorConfig(hf_checkpoint="x", advantage_estimator="ppo", custom_advantage_function_path="m:f")


def test_group_shapes_at_their_bounds():
    rewards = torch.tensor([1.0, 0.0, 0.5])
    # one sample per prompt is a valid group: nothing to compare with, so no advantage
    for estimator in ("grpo", "rloo", "reinforce_plus_plus_baseline"):
        assert compute_advantages(rewards, 1, estimator=estimator).tolist() == [0.0, 0.0, 0.0]
    assert compute_advantages(torch.tensor([]), 2).tolist() == []
    assert compute_advantages(rewards, 3).tolist() == pytest.approx(grpo_advantages(rewards, 3).tolist())  # grpo
    with pytest.raises(ValueError, match=r"^--n-samples-per-prompt must be >= 1, got 0$"):
        compute_advantages(rewards, 0)
    unknown = r"^--advantage-estimator must be one of \(.*'on_policy_distillation'\), got 'ppo2'$"
    with pytest.raises(ValueError, match=unknown):
        compute_advantages(rewards, 1, estimator="ppo2")
    # PPO's sample term is the reward itself: GAE with the critic's values does the rest
    assert compute_advantages(rewards, 3, estimator="ppo").tolist() == rewards.tolist()
    with pytest.raises(ValueError, match=r"multiple of group_size=2, got shape \(3,\)$"):
        compute_advantages(rewards, 2)
    with pytest.raises(ValueError, match=r"multiple of group_size=1, got shape \(1, 3\)$"):
        compute_advantages(rewards[None], 1)
    with pytest.raises(ValueError, match=r"^group_ids must have rewards' shape \(3,\), got \(2,\)$"):
        compute_advantages(rewards, 1, group_ids=torch.tensor([0, 1]))


def test_overlong_penalty_with_a_one_token_buffer():
    got = overlong_penalty(torch.tensor([3, 4, 5]), max_response_len=5, buffer_len=1, penalty_factor=2.0)
    torch.testing.assert_close(got, torch.tensor([0.0, 0.0, -2.0]))


# Four samples: 3 loss tokens, none (a prompt-only sample), one, and 3 split by a masked tool output.
EDGE_MASK = torch.tensor([0, 1, 1, 1, 0, 0, 0, 1, 0, 1, 0, 1, 1], dtype=torch.float32)
EDGE_CU = torch.tensor([0, 4, 6, 8, 13], dtype=torch.int32)
EDGE_REWARD = torch.tensor([1.0] * 4 + [5.0] * 2 + [-2.0] * 2 + [3.0] * 5)
EDGE_KL = torch.arange(13, dtype=torch.float32) / 10


def _edge_token_rewards(*, kl_coef: float) -> list[tuple[list[int], list[float]]]:
    """Per sample: its loss-token positions and their rewards (-kl_coef * kl, plus the reward on the last one)."""
    out = []
    for start, end in itertools.pairwise(EDGE_CU.tolist()):
        steps = [t for t in range(start, end) if EDGE_MASK[t]]
        rewards = [-kl_coef * float(EDGE_KL[t]) for t in steps]
        if steps:
            rewards[-1] += float(EDGE_REWARD[steps[-1]])
        out.append((steps, rewards))
    return out


def test_reinforce_plus_plus_returns_on_samples_with_no_one_and_split_loss_tokens():
    for gamma in (1.0, 0.5):
        got = token_advantages(EDGE_REWARD, EDGE_KL, EDGE_MASK, EDGE_CU, estimator="reinforce_plus_plus",
                               kl_coef=0.1, gamma=gamma)  # fmt: skip
        expected = torch.zeros(13)
        for steps, rewards in _edge_token_rewards(kl_coef=0.1):
            for i, t in enumerate(steps):
                expected[t] = sum(gamma ** (j - i) * rewards[j] for j in range(i, len(steps)))
        torch.testing.assert_close(got, expected)
        assert float(got[7]) == pytest.approx(-2.0 - 0.07, abs=1e-6) and got[[1, 2, 3, 9, 11, 12]].abs().min() > 0
    with pytest.raises(ValueError, match=r"^token_advantages handles .*reinforce_plus_plus_baseline.*got 'grpo'$"):
        token_advantages(EDGE_REWARD, None, EDGE_MASK, EDGE_CU, estimator="grpo", kl_coef=0.0)


def test_gae_on_samples_with_no_one_and_split_loss_tokens():
    values = torch.linspace(-1.0, 1.0, 13)
    adv, returns = gae_advantages(EDGE_REWARD, EDGE_KL, values, EDGE_MASK, EDGE_CU, kl_coef=0.1, gamma=0.9,
                                  lambd=0.8)  # fmt: skip
    expected = torch.zeros(13)
    for steps, rewards in _edge_token_rewards(kl_coef=0.1):
        running = 0.0
        for i in reversed(range(len(steps))):
            next_value = float(values[steps[i + 1]]) if i + 1 < len(steps) else 0.0
            running = rewards[i] + 0.9 * next_value - float(values[steps[i]]) + 0.9 * 0.8 * running
            expected[steps[i]] = running
    torch.testing.assert_close(adv, expected)
    torch.testing.assert_close(returns, (expected + values) * EDGE_MASK)
    assert adv[[9, 11, 12]].abs().min() > 0  # the samples after the empty one got their advantages


def test_sequence_mean_keeps_the_dtype_and_a_one_token_mean():
    values = torch.arange(13, dtype=torch.float64)
    got = sequence_mean(values, EDGE_MASK, EDGE_CU)
    assert got.dtype == torch.float64
    expected = [2.0] * 4 + [0.0] * 2 + [7.0] * 2 + [(9 + 11 + 12) / 3] * 5
    torch.testing.assert_close(got, torch.tensor(expected, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"^cu_seqlens covers 13 tokens, the batch has 12$"):
        sequence_mean(values[:12], EDGE_MASK[:12], EDGE_CU)


def test_whitening_and_explained_variance_of_constant_and_single_token_batches():
    one = torch.ones(1)
    assert whiten(torch.tensor([4.0]), one, whiten_sums(torch.tensor([4.0]), one)).tolist() == [0.0]
    flat = torch.full((3,), 2.0)
    whitened = whiten(flat, torch.ones(3), whiten_sums(flat, torch.ones(3)))
    assert whitened.dtype == torch.float32 and whitened.tolist() == [0.0, 0.0, 0.0]
    assert math.isnan(explained_variance(explained_variance_sums(torch.zeros(1), torch.tensor([3.0]), one)))
    assert math.isnan(explained_variance(explained_variance_sums(torch.zeros(3), flat, torch.ones(3))))
    assert explained_variance(explained_variance_sums(torch.zeros(2), torch.tensor([1.0, 3.0]), torch.ones(2))) == 0.0


def test_grpo_adds_its_epsilon_to_a_tiny_std():
    rewards = torch.tensor([0.0, 2e-6])  # std 1.41e-6: the epsilon 1e-6 is of the same size
    expected = 1e-6 / (2**0.5 * 1e-6 + 1e-6)
    assert grpo_advantages(rewards, 2).tolist() == pytest.approx([-expected, expected], rel=1e-3)


def test_distillation_has_no_reward_term():
    """on_policy_distillation's per-sample advantage is 0 whatever the rewards: the teacher's term is all of it."""
    rewards = torch.tensor([1.0, 0.0, 3.0, -2.0])
    out = compute_advantages(rewards, 2, estimator="on_policy_distillation")
    assert out.dtype == torch.float32 and out.tolist() == [0.0, 0.0, 0.0, 0.0]
