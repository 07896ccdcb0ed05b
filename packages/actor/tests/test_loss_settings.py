"""The loss options reach ``actor_loss`` through the ActorConfig the app builds (``LossSettings.of``, as the Actor)."""

import math

import pytest
import torch
from tidal.actor import ActorConfig
from tidal.actor.loss import LossSettings, actor_loss


def _loss(entropy=None, **options) -> float:
    """The loss of three tokens with ratios 0.5, 1.5, 5 and advantages -1, +1, -1, under ``options``' settings."""
    lp = torch.log(torch.tensor([0.5, 1.5, 5.0]))
    fields = {
        "old_log_probs": torch.zeros(3),
        "advantages": torch.tensor([-1.0, 1.0, -1.0]),
        "ref_log_probs": torch.tensor([0.0, -1.0, 1.0]),
        "rollout_log_probs": torch.tensor([0.0, -math.log(1.5), -math.log(4.0)]),  # TIS weights 1, 1.5, 4
    }
    settings = LossSettings.of(ActorConfig(hf_checkpoint="model", **options))
    loss, _ = actor_loss(lp, entropy, fields, torch.ones(3), settings, num_loss_tokens=3)
    return loss.item()


def test_the_clip_options_reach_the_loss_through_the_actor_config():
    # per token max(-A r, -A clip(r, 1 - eps, 1 + eps_high)), and for A < 0 at most -A c
    assert _loss(eps_clip=0.1, eps_clip_high=0.3, eps_clip_c=3.0) == pytest.approx((0.9 - 1.3 + 3.0) / 3)
    assert _loss(eps_clip=0.1) == pytest.approx((0.9 - 1.1 + 5.0) / 3)  # eps_clip_high unset: eps_clip's


def test_the_kl_and_entropy_options_reach_the_loss_through_the_actor_config():
    base = _loss(eps_clip=0.1, eps_clip_high=0.3)
    d = torch.log(torch.tensor([0.5, 1.5, 5.0])) - torch.tensor([0.0, -1.0, 1.0])  # log pi - log pi_ref
    k2 = float((0.5 * d**2).mean())
    kl = _loss(eps_clip=0.1, eps_clip_high=0.3, use_kl_loss=True, kl_loss_coef=0.5, kl_loss_type="k2")
    assert kl == pytest.approx(base + 0.5 * k2)
    entropy = torch.tensor([1.0, 2.0, 3.0])
    assert _loss(entropy, eps_clip=0.1, eps_clip_high=0.3, entropy_coef=0.1) == pytest.approx(base - 0.1 * 2.0)


def test_tis_and_the_loss_type_reach_the_loss_through_the_actor_config():
    # the per-token losses 0.9, -1.3, 5 (no dual clip), weighted by the engine ratio truncated at --tis-clip
    tis = _loss(eps_clip=0.1, eps_clip_high=0.3, use_tis=True, tis_clip=3.0)
    assert tis == pytest.approx((0.9 * 1.0 - 1.3 * 1.5 + 5.0 * 3.0) / 3)
    sft = _loss(loss_type="sft_loss")
    assert sft == pytest.approx(-float(torch.log(torch.tensor([0.5, 1.5, 5.0])).mean()))
