import itertools
import math

import pytest
import torch
from tidal.actor.loss import (
    LossSettings,
    actor_loss,
    cispo_loss,
    critic_loss,
    grpo_advantages,
    kl_penalty,
    load_function,
    policy_loss_of,
    ppo_clip_loss,
    value_loss,
)


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
    """--eps-clip bounds the ratio from below, --eps-clip-high from above."""
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
    """--kl-loss-coef and --entropy-coef weigh their terms as in the plain reference."""
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


# Three samples packed with a padding tail: [prompt, prompt, a, a, tool, a] [prompt, a, a] [prompt, a, a, a] [pad x2]
SEG_MASKS = [[0, 0, 1, 1, 0, 1], [0, 1, 1], [0, 1, 1, 1], [0, 0]]
SEG_ADV = [1.0, -1.0, 0.5, 0.0]


def seg_batch(seed=0):
    torch.manual_seed(seed)
    lengths = [len(m) for m in SEG_MASKS]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    mask = torch.tensor([x for m in SEG_MASKS for x in m], dtype=torch.float32)
    adv = torch.tensor([a for a, m in zip(SEG_ADV, SEG_MASKS, strict=True) for _ in m])
    old = torch.randn(mask.numel()) * 0.5 - 1.5
    lp = (old + torch.randn(mask.numel()) * 0.4).requires_grad_()  # ratios well outside [0.8, 1.28]
    return lp, old, adv, mask, cu


def samples(x, cu):
    return [x[int(a) : int(b)] for a, b in itertools.pairwise(cu)][:3]  # the three real samples


def per_sample_weights(mask, cu):
    """The trainer's default aggregation (``--calculate-per-token-loss`` off): 1/len of each sample's actions."""
    return torch.cat(
        [torch.full((int(b - a),), 1.0 / max(float(mask[a:b].sum()), 1.0)) for a, b in itertools.pairwise(cu)]
    )


def test_gspo_sequence_ratio_matches_the_paper_values_and_gradients():
    # GSPO: s_i = exp(1/|y_i| sum_t (log pi - log pi_old)), J = 1/G sum_i min(s_i A_i, clip(s_i, 1-e, 1+e_h) A_i)
    lp, old, adv, mask, cu = seg_batch()
    lp = (lp.detach() + torch.where(torch.arange(lp.numel()) < 6, 0.6, 0.0)).requires_grad_()  # clip sample 0
    settings = LossSettings(eps_clip=0.2, eps_clip_high=0.28, policy_loss="gspo")
    fields = {"old_log_probs": old, "advantages": adv, "loss_weights": per_sample_weights(mask, cu)}
    loss, sums = actor_loss(lp, None, fields, mask, settings, num_loss_tokens=3.0, cu_seqlens=cu)
    (grad,) = torch.autograd.grad(loss, lp)

    lp2 = lp.detach().clone().requires_grad_()
    terms = []
    for lp_i, old_i, m_i, a in zip(samples(lp2, cu), samples(old, cu), samples(mask, cu), SEG_ADV, strict=False):
        s = torch.exp(((lp_i - old_i) * m_i).sum() / m_i.sum())
        terms.append(-torch.minimum(s * a, s.clamp(0.8, 1.28) * a))
    expected = torch.stack(terms).mean()
    (expected_grad,) = torch.autograd.grad(expected, lp2)
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(grad, expected_grad)
    assert 0 < float(sums["pg_clipfrac"]) < 1  # some sequences clipped, not all
    assert grad[mask == 0].abs().max() == 0


def test_gspo_takes_host_cu_seqlens_with_the_model_on_another_device():
    """The actor passes the batch's cu_seqlens (host) with log-probs on the GPU. The sequence ids are built on the
    host and sent over; building them on the model's device crashed GSPO on an H200 ("index is on cuda:0, different
    from other tensors on cpu"). The meta device stands in for the GPU: the loss must build there, shape and all."""
    lp, old, adv, mask, cu = seg_batch()
    meta = torch.device("meta")
    settings = LossSettings(eps_clip=0.2, eps_clip_high=0.28, policy_loss="gspo")
    fields = {"old_log_probs": old, "advantages": adv, "loss_weights": per_sample_weights(mask, cu)}
    fields = {k: v.to(meta) for k, v in fields.items()}
    lp = lp.detach().to(meta).requires_grad_()
    loss, _ = actor_loss(lp, None, fields, mask.to(meta), settings, num_loss_tokens=3.0, cu_seqlens=cu)
    assert loss.device == meta and loss.shape == ()


def test_cispo_clipped_detached_weight_times_log_prob():
    # CISPO: J = 1/sum|y_i| sum_i sum_t sg(min(r_it, 1 + e_h)) A_i log pi(y_it); token-level aggregation
    lp, old, adv, mask, _ = seg_batch(1)
    settings = LossSettings(eps_clip=0.2, eps_clip_high=0.28, policy_loss="cispo")
    n = float(mask.sum())
    loss, sums = actor_loss(lp, None, {"old_log_probs": old, "advantages": adv}, mask, settings, num_loss_tokens=n)
    (grad,) = torch.autograd.grad(loss, lp)
    expected, expected_grad, clipped = 0.0, torch.zeros_like(old), 0
    for t in range(old.numel()):
        if mask[t]:
            r = math.exp(float(lp[t] - old[t]))
            w = min(r, 1.28)
            clipped += r > 1.28
            expected += -w * float(adv[t]) * float(lp[t]) / n
            expected_grad[t] = -w * float(adv[t]) / n  # the weight is a constant: no gradient through it
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    torch.testing.assert_close(grad, expected_grad)
    assert 0 < clipped < n and float(sums["pg_clipfrac"]) == pytest.approx(clipped / n)


def test_dual_clip_bounds_negative_advantages():
    # dual-clip PPO (Ye et al. 2020): for A < 0 the objective is max(min(r A, clip(r) A), c A)
    old = torch.zeros(4)
    lp = torch.log(torch.tensor([5.0, 2.0, 5.0, 0.5])).requires_grad_()
    adv = torch.tensor([-1.0, -1.0, 1.0, -1.0])
    loss, _ = ppo_clip_loss(lp, old, adv, eps_clip=0.2, eps_clip_high=0.2, eps_clip_c=3.0)
    expected = []
    for r, a in zip([5.0, 2.0, 5.0, 0.5], adv.tolist(), strict=True):
        obj = min(r * a, min(max(r, 0.8), 1.2) * a)
        expected.append(-(max(obj, 3.0 * a) if a < 0 else obj))
    torch.testing.assert_close(loss, torch.tensor(expected))  # [3, 2, -6, 0.8]: token 0 bounded at c * |A|
    loss.sum().backward()
    assert lp.grad[0] == 0 and lp.grad[1] != 0  # the dual-clipped token has no gradient


def test_tis_weights_each_token_by_the_truncated_engine_ratio():
    """--use-tis weights each token by the engine ratio truncated at --tis-clip."""
    lp, old, adv, mask, _ = seg_batch(2)
    rollout = old + torch.randn(old.numel()) * 0.5
    n = float(mask.sum())
    fields = {"old_log_probs": old, "advantages": adv, "rollout_log_probs": rollout}
    base = LossSettings(eps_clip=0.2, eps_clip_high=0.2)
    with_tis = LossSettings(eps_clip=0.2, eps_clip_high=0.2, use_tis=True, tis_clip=1.5)
    plain, _ = ppo_clip_loss(lp, old, adv, eps_clip=0.2, eps_clip_high=0.2)
    loss, sums = actor_loss(lp, None, fields, mask, with_tis, num_loss_tokens=n)
    w = torch.exp(old - rollout).clamp(max=1.5)
    torch.testing.assert_close(loss, (plain * w * mask).sum() / n)
    torch.testing.assert_close(sums["tis"], (w * mask).sum() / n)
    assert not torch.isclose(loss, actor_loss(lp, None, fields, mask, base, num_loss_tokens=n)[0])
    with pytest.raises(ValueError, match="--use-tis"):
        actor_loss(lp, None, {"old_log_probs": old, "advantages": adv}, mask, with_tis, num_loss_tokens=n)


@pytest.mark.parametrize("per_token", [True, False])
def test_per_sample_and_per_token_aggregation(per_token):
    # per token: sum over all action tokens / their count; per sample: mean over each sample's actions, then samples
    lp, old, adv, mask, cu = seg_batch(3)
    fields = {"old_log_probs": old, "advantages": adv}
    if not per_token:
        fields["loss_weights"] = per_sample_weights(mask, cu)
    denom = float(mask.sum()) if per_token else 3.0
    loss, _ = actor_loss(lp, None, fields, mask, LossSettings(eps_clip=0.2, eps_clip_high=0.2), num_loss_tokens=denom)
    pg, _ = ppo_clip_loss(lp, old, adv, eps_clip=0.2, eps_clip_high=0.2)
    per_sample = [float((p * m).sum() / m.sum()) for p, m in zip(samples(pg, cu), samples(mask, cu), strict=True)]
    token_sum = float((pg * mask).sum())
    expected = token_sum / float(mask.sum()) if per_token else sum(per_sample) / 3
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    other = sum(per_sample) / 3 if per_token else token_sum / float(mask.sum())
    assert loss.item() != pytest.approx(other, rel=1e-3)  # the two aggregations differ on this batch


def test_sft_loss_is_the_mean_negative_log_likelihood_per_sample():
    """--loss-type sft_loss trains on the negative log-likelihood."""
    lp, _, _, mask, cu = seg_batch(4)
    fields = {"loss_weights": per_sample_weights(mask, cu)}
    settings = LossSettings(eps_clip=0.2, eps_clip_high=0.2, loss_type="sft_loss")
    loss, sums = actor_loss(lp, None, fields, mask, settings, num_loss_tokens=3.0)
    expected = sum(-float((x * m).sum() / m.sum()) for x, m in zip(samples(lp, cu), samples(mask, cu), strict=True))
    assert loss.item() == pytest.approx(expected / 3, rel=1e-5)
    assert "sft_loss" in sums and "pg_loss" not in sums
    loss.backward()
    torch.testing.assert_close(lp.grad, -fields["loss_weights"] * mask / 3)


def test_load_function_names_the_flag():
    assert load_function("math:sqrt", flag="--custom-loss-function-path") is math.sqrt
    with pytest.raises(ValueError, match="--custom-loss-function-path 'no_such_module_x:f'"):
        load_function("no_such_module_x:f", flag="--custom-loss-function-path")
    with pytest.raises(ValueError, match="not a function"):
        load_function("math:pi", flag="--custom-advantage-function-path")


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


@pytest.mark.parametrize("value_clip", [None, 0.2])
@pytest.mark.parametrize("per_token", [True, False])
def test_value_loss_matches_ppo_clipped_value_formula_values_and_gradients(value_clip, per_token):
    # L = 0.5 * max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2) per action token, aggregated as the actor's
    _, old, _, mask, cu = seg_batch(4)
    torch.manual_seed(5)
    returns = torch.randn(mask.numel())
    values = (old + torch.randn(mask.numel()) * 0.4).requires_grad_()  # many tokens moved further than 0.2
    fields = {"old_values": old, "returns": returns}
    if not per_token:
        fields["loss_weights"] = per_sample_weights(mask, cu)
    denom = float(mask.sum()) if per_token else 3.0
    settings = LossSettings(eps_clip=0.2, eps_clip_high=0.2, value_clip=value_clip)
    loss, sums = critic_loss(values, None, fields, mask, settings, num_loss_tokens=denom)
    loss.backward()

    ref_values = values.detach().clone().requires_grad_()
    expected, clipped_tokens, weights = 0.0, 0, fields.get("loss_weights", torch.ones(mask.numel()))
    for t in range(mask.numel()):
        if not mask[t]:
            continue
        v, v_old, r = ref_values[t], float(old[t]), float(returns[t])
        term = (v - r) ** 2
        if value_clip is not None:
            v_clip = v_old + min(max(float(v) - v_old, -value_clip), value_clip)
            if v_clip - r != float(v) - r:  # the clipped branch is constant in v: no gradient through it
                clipped = torch.tensor((v_clip - r) ** 2)
                clipped_tokens += int(clipped > term)
                term = torch.maximum(term, clipped)
        expected = expected + 0.5 * term * float(weights[t]) / denom
    expected.backward()
    expected = float(expected.detach())
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    torch.testing.assert_close(values.grad, ref_values.grad, rtol=1e-5, atol=1e-7)
    assert sums["value_loss"].item() == pytest.approx(expected, rel=1e-5)
    if value_clip is None:
        assert sums["clipfrac"].item() == 0.0
    else:
        assert clipped_tokens > 0 and (values.grad[mask.bool()] == 0).sum() == clipped_tokens  # clipped: no gradient
        if per_token:
            assert sums["clipfrac"].item() == pytest.approx(clipped_tokens / denom)
    expected_mean = float((values.detach() * mask * weights).sum()) / denom
    assert sums["values_mean"].item() == pytest.approx(expected_mean, rel=1e-5)


def test_value_loss_clips_only_moves_away_from_the_return():
    old, returns = torch.tensor([0.0, 0.0, 0.0]), torch.tensor([1.0, 1.0, -1.0])
    values = torch.tensor([0.5, 2.0, 0.5])  # 0.5 towards the return; past it; 0.5 away from it
    loss, clipped = value_loss(values, old, returns, value_clip=0.2)
    # 1: 0.5*(0.5-1)^2 < 0.5*(0.2-1)^2: the clipped (pessimistic) branch; 2: 0.5*1 > 0.5*0.64; 3: 1.125 > 0.72
    torch.testing.assert_close(loss, torch.tensor([0.32, 0.5, 1.125]))
    torch.testing.assert_close(clipped, torch.tensor([1.0, 0.0, 0.0]))


def test_value_clip_bounds_moves_down_as_well_as_up():
    old, returns = torch.tensor([0.0, 0.0]), torch.tensor([-1.0, 1.0])
    values = torch.tensor([-0.5, 0.5])  # each 0.5 towards its return: the clipped branch (+-0.2) is pessimistic
    loss, clipped = value_loss(values, old, returns, value_clip=0.2)
    torch.testing.assert_close(loss, torch.tensor([0.5 * 0.8**2, 0.5 * 0.8**2]))
    torch.testing.assert_close(clipped, torch.tensor([1.0, 1.0]))


def test_critic_loss_names_a_missing_field_and_divides_by_one_token_at_least():
    settings = LossSettings(eps_clip=0.2, eps_clip_high=0.2)
    values, mask = torch.tensor([1.0, 3.0]), torch.tensor([0.0, 1.0])
    for missing in ("old_values", "returns"):
        fields = {"old_values": torch.zeros(2), "returns": torch.zeros(2)}
        del fields[missing]
        with pytest.raises(ValueError, match=rf"needs token field '{missing}'; got \['(old_values|returns)'\]"):
            critic_loss(values, None, fields, mask, settings, num_loss_tokens=1)
    fields = {"old_values": torch.zeros(2), "returns": torch.zeros(2)}
    for num_loss_tokens in (0, 0.5, 1):  # a micro-batch without loss tokens is not divided by less than one
        loss, sums = critic_loss(values, None, fields, mask, settings, num_loss_tokens=num_loss_tokens)
        assert loss.item() == pytest.approx(4.5) and sums["loss"].item() == pytest.approx(4.5)
        assert sums["value_loss"].item() == pytest.approx(4.5) and sums["values_mean"].item() == pytest.approx(3.0)


def test_cispo_weight_at_exactly_the_bound_is_not_counted_as_clipped():
    old = torch.zeros(3)
    lp = torch.log(torch.tensor([1.0, 1.5, 2.0]))  # ratios 1, 1.5 (the bound 1 + 0.5), 2
    loss, clipped = cispo_loss(lp, old, torch.ones(3), eps_clip_high=0.5)
    torch.testing.assert_close(clipped, torch.tensor([0.0, 0.0, 1.0]))
    torch.testing.assert_close(loss, -torch.tensor([1.0, 1.5, 1.5]) * lp)


@pytest.mark.parametrize(
    ("estimator", "policy_loss"),
    [("grpo", "ppo_clip"), ("rloo", "ppo_clip"), ("ppo", "ppo_clip"), ("reinforce_plus_plus", "ppo_clip"),
     ("gspo", "gspo"), ("cispo", "cispo")],
)  # fmt: skip
def test_each_estimator_trains_with_its_policy_loss(estimator, policy_loss):
    assert policy_loss_of(estimator) == policy_loss


def test_load_function_says_what_the_attribute_is():
    with pytest.raises(ValueError, match=r"^--custom-loss-function-path 'math:pi': 'pi' is a float, not a function$"):
        load_function("math:pi", flag="--custom-loss-function-path")
    with pytest.raises(ValueError, match=r"^--x 'math:sqrt:extra': cannot load it: .*'sqrt:extra'"):
        load_function("math:sqrt:extra", flag="--x")


def test_every_metric_is_its_token_mean_under_its_own_name():
    # two loss tokens of three; ratio 1 everywhere (lp == old): pg = -A, no clipping
    lp = torch.tensor([-1.0, -2.0, -0.5], requires_grad=True)
    mask, adv = torch.tensor([1.0, 1.0, 0.0]), torch.tensor([1.0, -3.0, 9.0])
    ref, entropy = torch.tensor([-1.5, -2.0, 0.0]), torch.tensor([0.4, 0.8, 5.0])
    fields = {"old_log_probs": lp.detach().clone(), "advantages": adv, "ref_log_probs": ref}
    settings = LossSettings(eps_clip=0.2, eps_clip_high=0.2, kl_loss_coef=0.5, kl_loss_type="k1", entropy_coef=0.1)
    loss, sums = actor_loss(lp, entropy, fields, mask, settings, num_loss_tokens=2)
    pg, kl, ent = (-1.0 + 3.0) / 2, (0.5 + 0.0) / 2, (0.4 + 0.8) / 2
    assert set(sums) == {"pg_loss", "pg_clipfrac", "ppo_kl", "kl", "entropy", "loss"}
    assert sums["pg_loss"].item() == pytest.approx(pg) and sums["kl"].item() == pytest.approx(kl)
    assert sums["entropy"].item() == pytest.approx(ent) and sums["ppo_kl"].item() == 0.0
    assert sums["pg_clipfrac"].item() == 0.0
    assert loss.item() == pytest.approx(pg + 0.5 * kl - 0.1 * ent) and sums["loss"].item() == loss.item()
    # entropy is reported without a coefficient, and then leaves the loss alone
    loss0, sums0 = actor_loss(lp, entropy, fields, mask, LossSettings(eps_clip=0.2, eps_clip_high=0.2),
                              num_loss_tokens=2)  # fmt: skip
    assert loss0.item() == pytest.approx(pg) and sums0["entropy"].item() == pytest.approx(ent)
    full = LossSettings(eps_clip=0.2, eps_clip_high=0.2, entropy_coef=1.0)
    loss1, _ = actor_loss(lp, entropy, fields, mask, full, num_loss_tokens=2)
    assert loss1.item() == pytest.approx(pg - ent)
    # a step without loss tokens divides by one, not by zero or two
    _, one = actor_loss(lp, None, fields, torch.tensor([1.0, 0.0, 0.0]), settings, num_loss_tokens=0)
    assert one["pg_loss"].item() == pytest.approx(-1.0) and one["kl"].item() == pytest.approx(0.5)


def test_missing_token_fields_are_named():
    lp, mask = torch.zeros(2), torch.ones(2)
    settings = LossSettings(eps_clip=0.2, eps_clip_high=0.2)
    with pytest.raises(ValueError, match=r"^train_step needs token field 'advantages'; got \['old_log_probs'\]$"):
        actor_loss(lp, None, {"old_log_probs": lp}, mask, settings, num_loss_tokens=2)
    fields = {"old_log_probs": lp, "advantages": lp}
    with pytest.raises(ValueError, match=r"^--kl-loss-coef is non-zero but the batch has no 'ref_log_probs'"):
        actor_loss(lp, None, fields, mask, LossSettings(eps_clip=0.2, eps_clip_high=0.2, kl_loss_coef=0.1),
                   num_loss_tokens=2)  # fmt: skip
    with pytest.raises(ValueError, match=r"^--advantage-estimator gspo needs the batch's cu_seqlens"):
        actor_loss(lp, None, fields, mask, LossSettings(eps_clip=0.2, eps_clip_high=0.2, policy_loss="gspo"),
                   num_loss_tokens=2)  # fmt: skip
    with pytest.raises(ValueError, match=r"^--use-tis needs the engine's log-probs: token field 'rollout_log_probs'"):
        actor_loss(lp, None, fields, mask, LossSettings(eps_clip=0.2, eps_clip_high=0.2, use_tis=True),
                   num_loss_tokens=2)  # fmt: skip


def test_clip_bounds_are_exclusive_and_dual_clip_spares_zero_and_positive_advantages():
    old = torch.zeros(4)
    lp = torch.log(torch.tensor([1.2, 1.3, 0.5, 4.0]))  # at the high bound 1.2, past it, below 0.8, far past
    adv = torch.tensor([1.0, 1.0, -1.0, 0.5])
    _, clipped = ppo_clip_loss(lp, old, adv, eps_clip=0.2, eps_clip_high=0.2)
    torch.testing.assert_close(clipped, torch.tensor([0.0, 1.0, 1.0, 1.0]))
    # dual clip bounds -A * r for A < 0 only; A = 0 keeps its zero loss, A > 0 its clipped loss (not -A * c)
    lp = torch.log(torch.tensor([5.0, 5.0, 5.0]))
    adv = torch.tensor([-1.0, 0.0, 0.5])
    loss, _ = ppo_clip_loss(lp, torch.zeros(3), adv, eps_clip=0.2, eps_clip_high=0.2, eps_clip_c=3.0)
    torch.testing.assert_close(loss, torch.tensor([3.0, 0.0, -0.5 * 1.2]))


def test_dual_clip_reaches_the_loss_through_the_settings():
    """--eps-clip-c bounds the loss of a negative advantage."""
    lp = torch.log(torch.tensor([5.0]))
    fields = {"old_log_probs": torch.zeros(1), "advantages": torch.tensor([-1.0])}
    settings = LossSettings(eps_clip=0.2, eps_clip_high=0.2, eps_clip_c=3.0)
    loss, _ = actor_loss(lp, None, fields, torch.ones(1), settings, num_loss_tokens=1)
    assert loss.item() == pytest.approx(3.0)  # not -A * r = 5


def test_tis_mask_keeps_a_weight_exactly_at_the_clip():
    old = torch.tensor([-1.0, -1.0, -1.0])
    rollout = old - torch.tensor([0.0, math.log(2.0), 1.0])  # weights 1, exactly 2 (the clip), e > 2
    fields = {"old_log_probs": old, "advantages": torch.ones(3), "rollout_log_probs": rollout}
    settings = LossSettings(eps_clip=0.2, eps_clip_high=0.2, use_tis=True, tis_clip=2.0, tis_mode="mask")
    loss, sums = actor_loss(old.clone(), None, fields, torch.ones(3), settings, num_loss_tokens=3)
    assert loss.item() == pytest.approx(-(1.0 + 2.0) / 3)
    assert sums["tis_masked_frac"].item() == pytest.approx(1 / 3)
