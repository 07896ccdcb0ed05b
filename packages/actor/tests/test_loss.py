import math

import pytest
import torch
from tidal.actor.loss import LossSettings, actor_loss, grpo_advantages, kl_penalty, ppo_clip_loss


def test_grpo_advantages_matches_manual():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    adv = grpo_advantages(rewards, 4)
    g0 = torch.tensor([1.0, 0.0, 0.0, 1.0])
    expected0 = (g0 - 0.5) / (g0.std() + 1e-6)
    torch.testing.assert_close(adv[:4], expected0)
    assert torch.equal(adv[4:], torch.zeros(4))  # identical rewards -> no signal
    torch.testing.assert_close(grpo_advantages(rewards, 4, normalize_std=False)[:4], g0 - 0.5)


@pytest.mark.parametrize("bad", [0, 3])
def test_grpo_advantages_rejects_bad_group_size(bad):
    with pytest.raises(ValueError):
        grpo_advantages(torch.zeros(8), bad)


def test_ppo_clip_low_high_separately():
    old = torch.zeros(4)
    lp = torch.log(torch.tensor([0.5, 1.5, 0.5, 1.5]))  # ratios
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0])
    loss, clipped = ppo_clip_loss(lp, old, adv, eps_clip=0.2, eps_clip_high=0.3)
    # A>0: r=0.5 -> max(-0.5, -0.8) = -0.5 (unclipped); r=1.5 -> max(-1.5, -1.3) = -1.3 (clipped high)
    # A<0: r=0.5 -> max(0.5, 0.8) = 0.8 (clipped low); r=1.5 -> max(1.5, 1.3) = 1.5 (unclipped)
    torch.testing.assert_close(loss, torch.tensor([-0.5, -1.3, 0.8, 1.5]))
    assert clipped.tolist() == [0.0, 1.0, 1.0, 0.0]


def test_kl_estimators():
    lp, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0])
    d = lp - ref
    torch.testing.assert_close(kl_penalty(lp, ref, "k1"), d)
    torch.testing.assert_close(kl_penalty(lp, ref, "k2"), 0.5 * d**2)
    torch.testing.assert_close(kl_penalty(lp, ref, "k3"), torch.exp(-d) - 1 + d)
    assert (kl_penalty(lp, ref, "k3") >= 0).all()
    with pytest.raises(ValueError, match="--kl-loss-type"):
        kl_penalty(lp, ref, "k4")


def plain_reference(lp, ent, old, adv, ref, mask, eps_lo, eps_hi, kl_coef, ent_coef, denom):
    """Straight loops, one token at a time."""
    total = 0.0
    for i in range(lp.numel()):
        if mask[i] == 0:
            continue
        r, a = math.exp(float(lp[i] - old[i])), float(adv[i])
        pg = max(-a * r, -a * min(max(r, 1 - eps_lo), 1 + eps_hi))
        d = float(lp[i] - ref[i])
        total += float(pg) + kl_coef * (math.exp(-d) - 1 + d) - ent_coef * float(ent[i])
    return total / denom


def test_actor_loss_matches_plain_reference_and_gradients_flow():
    torch.manual_seed(0)
    n = 12
    lp = (torch.randn(n) * 0.3 - 2).requires_grad_()
    ent = torch.rand(n)
    fields = {"old_log_probs": lp.detach() + 0.2 * torch.randn(n), "advantages": torch.randn(n)}
    fields["ref_log_probs"] = lp.detach() + 0.1 * torch.randn(n)
    mask = (torch.arange(n) % 3 != 0).float()
    settings = LossSettings(eps_clip=0.2, eps_clip_high=0.28, kl_loss_coef=0.05, entropy_coef=0.01)
    loss, sums = actor_loss(lp, ent, fields, mask, settings, num_loss_tokens=20)
    expected = plain_reference(
        lp.detach(),
        ent,
        fields["old_log_probs"],
        fields["advantages"],
        fields["ref_log_probs"],
        mask,
        0.2,
        0.28,
        0.05,
        0.01,
        20.0,
    )
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    assert sums["loss"].item() == pytest.approx(expected, rel=1e-5)
    loss.backward()
    assert torch.equal(lp.grad[mask == 0], torch.zeros(int((mask == 0).sum())))
    assert lp.grad[mask == 1].abs().sum() > 0


def test_actor_loss_requires_ref_log_probs_when_kl_on():
    fields = {"old_log_probs": torch.zeros(3), "advantages": torch.ones(3)}
    with pytest.raises(ValueError, match="ref_log_probs"):
        actor_loss(
            torch.zeros(3),
            None,
            fields,
            torch.ones(3),
            LossSettings(eps_clip=0.2, eps_clip_high=0.2, kl_loss_coef=0.1),
            num_loss_tokens=3,
        )


@pytest.mark.parametrize("mode", ["truncate", "mask"])
def test_tis_truncates_or_masks_the_behaviour_to_proximal_weight(mode):
    old = torch.tensor([-1.0, -1.0, -1.0])
    rollout = old - torch.tensor([0.0, 0.5, 2.0])  # weights 1, e^0.5 (below the clip 2) and e^2 (above it)
    fields = {"old_log_probs": old, "advantages": torch.ones(3), "rollout_log_probs": rollout}
    settings = LossSettings(eps_clip=0.2, eps_clip_high=0.2, use_tis=True, tis_clip=2.0, tis_mode=mode)
    loss, sums = actor_loss(old.clone().requires_grad_(), None, fields, torch.ones(3), settings, num_loss_tokens=3)
    last = 2.0 if mode == "truncate" else 0.0  # MIS drops the token whose weight exceeds the clip
    assert loss.item() == pytest.approx(-(1.0 + math.exp(0.5) + last) / 3)
    assert sums["tis"].item() == pytest.approx((1.0 + math.exp(0.5) + last) / 3)
    assert ("tis_masked_frac" in sums) == (mode == "mask")
