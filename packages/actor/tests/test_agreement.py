import math

import pytest
import torch
from tidal.actor.agreement import AGREEMENT_KEYS, agreement_metrics, agreement_sums, combine_sums


def _k3(d: float) -> float:
    return math.exp(d) - 1.0 - d


def test_known_values_on_loss_tokens_only():
    actor = torch.tensor([0.0, -1.0, -2.0, -0.5, -0.1])
    engine = torch.tensor([0.0, -1.5, -2.0, -0.3, -9.0])  # the last token has no loss: its gap of 8.9 is ignored
    mask = torch.tensor([0, 1, 1, 1, 0])
    m = agreement_metrics(agreement_sums(actor, engine, mask))
    assert list(m) == list(AGREEMENT_KEYS)
    assert m["rollout/logprob_abs_diff/mean"] == pytest.approx((0.5 + 0.0 + 0.2) / 3)
    assert m["rollout/logprob_abs_diff/max"] == pytest.approx(0.5)
    # k3 of d = actor - engine: KL(engine || actor) on the engine's samples
    assert m["rollout/engine_actor_kl"] == pytest.approx((_k3(0.5) + _k3(0.0) + _k3(-0.2)) / 3)


def test_identical_log_probs_agree_exactly():
    lp = torch.tensor([0.0, -0.7, -3.2, -0.01])
    m = agreement_metrics(agreement_sums(lp, lp.clone(), torch.tensor([0, 1, 1, 1])))
    assert m == dict.fromkeys(AGREEMENT_KEYS, 0.0)


def test_micro_batches_add_up_to_the_whole_rollout():
    actor = torch.tensor([-0.1, -0.2, -0.3, -0.4, -0.5, -0.6])
    engine = torch.tensor([-0.1, -0.9, -0.3, -0.45, -0.2, -0.6])
    mask = torch.tensor([1, 1, 0, 1, 1, 1])
    whole = agreement_metrics(agreement_sums(actor, engine, mask))
    parts = [agreement_sums(actor[s], engine[s], mask[s]) for s in (slice(0, 2), slice(2, 3), slice(3, 6))]
    split = agreement_metrics(combine_sums(parts))
    assert split == pytest.approx(whole)
    assert split["rollout/logprob_abs_diff/max"] == pytest.approx(0.7)  # the max, not a sum of maxima


def test_no_loss_token_gives_zeros():
    lp = torch.tensor([-1.0, -2.0])
    assert agreement_metrics(agreement_sums(lp, lp - 1, torch.zeros(2))) == dict.fromkeys(AGREEMENT_KEYS, 0.0)
    assert agreement_metrics(combine_sums([])) == dict.fromkeys(AGREEMENT_KEYS, 0.0)


def test_kl_is_non_negative_second_order_and_finite_for_huge_gaps():
    d = torch.tensor([1e-3, -1e-3, 30.0, -30.0])
    zeros = torch.zeros(4)
    small = agreement_metrics(agreement_sums(d[:2], zeros[:2], torch.ones(2)))
    assert small["rollout/engine_actor_kl"] == pytest.approx(0.5e-6, rel=1e-2)  # k3 ~ d^2 / 2
    huge = agreement_metrics(agreement_sums(d[2:], zeros[2:], torch.ones(2)))
    assert math.isfinite(huge["rollout/engine_actor_kl"]) and huge["rollout/engine_actor_kl"] > 0
    assert huge["rollout/logprob_abs_diff/max"] == 30.0  # |d| itself is not clamped


def test_bf16_rounded_log_probs_give_a_small_positive_gap():
    # what a bf16-serving engine looks like next to an fp32 actor: log-probs rounded to bf16 (relative 2**-8)
    actor = -torch.rand(1000, generator=torch.Generator().manual_seed(0)) * 5
    engine = actor.to(torch.bfloat16).float()
    m = agreement_metrics(agreement_sums(actor, engine, torch.ones(1000)))
    assert 0 < m["rollout/logprob_abs_diff/mean"] < m["rollout/logprob_abs_diff/max"] <= 5 * 2**-8
    assert 0 < m["rollout/engine_actor_kl"] < 1e-4
