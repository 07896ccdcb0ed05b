import functools
import math

import pytest
import torch
from tidal.actor import Actor, ActorConfig
from tidal.actor.trainer import train_on_rollout
from tidal.batching import BatchingConfig, pack

# 2 prompts x 2 samples; the first token of each is the prompt.
TOKENS = [[5, 17, 99, 3], [5, 17, 42], [120, 0, 33, 33, 8], [120, 0, 4]]
MASKS = [[0, 0, 1, 1], [0, 0, 1], [0, 0, 1, 1, 1], [0, 0, 1]]
REWARDS = [1.0, 0.0, 0.0, 1.0]


def test_train_on_rollout_runs_every_step_from_the_same_old_log_probs(dist_env, qwen2_dir):
    actor = Actor(ActorConfig(hf_checkpoint=str(qwen2_dir), lr=1e-2))
    reference = pack(TOKENS, loss_masks=MASKS)
    engine_lp = [lp.tolist() for lp in torch.split(actor.compute_log_probs(reference), [len(t) for t in TOKENS])]
    batching = BatchingConfig(rollout_batch_size=2, n_samples_per_prompt=2, num_steps_per_rollout=2)
    metrics = train_on_rollout(
        actor, batching, tokens=TOKENS, loss_masks=MASKS, rewards=REWARDS, group_size=2, rollout_log_probs=engine_lp
    )
    assert metrics["train/num_steps"] == 2.0
    assert math.isfinite(metrics["train/loss"]) and metrics["train/grad_norm"] > 0
    # old log-probs came from the actor before any step: identical to the "engine" ones computed the same way
    assert metrics["rollout/logprob_abs_diff/mean"] < 1e-6 and metrics["rollout/logprob_abs_diff/max"] < 1e-6
    assert 0.0 <= metrics["rollout/engine_actor_kl"] < 1e-10
    # the second step's ratio is against pre-rollout weights, so it is no longer 1 everywhere
    assert metrics["train/ppo_kl"] != 0.0
    after = actor.compute_log_probs(reference)
    gain = sum(
        (r - 0.5) * float(((a - torch.tensor(lp)) * torch.tensor(m, dtype=torch.float32)).sum())
        for a, lp, m, r in zip(torch.split(after, [len(t) for t in TOKENS]), engine_lp, MASKS, REWARDS, strict=True)
    )
    assert gain > 0  # rewarded responses became likelier relative to the others


def test_train_on_rollout_rejects_a_short_rollout(dist_env, qwen2_dir):
    actor = Actor(ActorConfig(hf_checkpoint=str(qwen2_dir)))
    batching = BatchingConfig(rollout_batch_size=4, n_samples_per_prompt=2)
    with pytest.raises(ValueError, match="--n-samples-per-prompt"):
        train_on_rollout(actor, batching, tokens=TOKENS, loss_masks=MASKS, rewards=REWARDS, group_size=2)


def _gain(actor, engine_lp, rewards=REWARDS):
    after = actor.compute_log_probs(pack(TOKENS, loss_masks=MASKS))
    return sum(
        (r - 0.5) * float(((a - torch.tensor(lp)) * torch.tensor(m, dtype=torch.float32)).sum())
        for a, lp, m, r in zip(torch.split(after, [len(t) for t in TOKENS]), engine_lp, MASKS, rewards, strict=True)
    )


def _train(qwen2_dir, **cfg):
    actor = Actor(ActorConfig(hf_checkpoint=str(qwen2_dir), lr=1e-2, **cfg))
    engine_lp = [
        lp.tolist() for lp in torch.split(actor.compute_log_probs(pack(TOKENS, loss_masks=MASKS)), [4, 3, 5, 3])
    ]
    batching = BatchingConfig(rollout_batch_size=2, n_samples_per_prompt=2, num_steps_per_rollout=2)
    metrics = train_on_rollout(actor, batching, tokens=TOKENS, loss_masks=MASKS, rewards=REWARDS, group_size=2)
    return metrics, _gain(actor, engine_lp)


@pytest.mark.parametrize("estimator", ["gspo", "cispo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"])
def test_each_estimator_makes_rewarded_responses_likelier(dist_env, qwen2_dir, estimator):
    metrics, gain = _train(qwen2_dir, advantage_estimator=estimator)
    assert math.isfinite(metrics["train/loss"]) and metrics["train/grad_norm"] > 0
    assert gain > 0


CUSTOM = """
import torch
from tidal.actor.loss import actor_loss

CALLS = []


def negated(rewards, *, group_size, normalize_std):
    return -(rewards - 0.5)


def loss(log_probs, entropy, fields, loss_mask, settings, *, num_loss_tokens, cu_seqlens):
    CALLS.append(int(cu_seqlens.numel()))
    return actor_loss(log_probs, entropy, fields, loss_mask, settings, num_loss_tokens=num_loss_tokens)
"""


def test_custom_advantage_and_loss_functions_are_called(dist_env, qwen2_dir, tmp_path, monkeypatch):
    (tmp_path / "my_algo.py").write_text(CUSTOM)
    monkeypatch.syspath_prepend(str(tmp_path))
    import my_algo

    metrics, gain = _train(
        qwen2_dir,
        custom_advantage_function_path="my_algo:negated",
        loss_type="custom_loss",
        custom_loss_function_path="my_algo:loss",
    )
    assert my_algo.CALLS and math.isfinite(metrics["train/loss"])
    assert gain < 0  # the negated advantages pushed the rewarded responses down


def test_one_step_rollout_reuses_the_training_forward_for_old_log_probs_with_the_same_result(dist_env, qwen2_dir):
    """One step per rollout: no separate old-log-prob pass, and the same update and metrics as with it."""
    batching = BatchingConfig(rollout_batch_size=2, n_samples_per_prompt=2)
    results = []
    for reuse in (False, True):
        actor = Actor(ActorConfig(hf_checkpoint=str(qwen2_dir), lr=1e-2))
        engine_lp = [lp.tolist() for lp in torch.split(actor.compute_log_probs(pack(TOKENS)), [4, 3, 5, 3])]
        calls = []
        actor.compute_log_probs = functools.partial(_counted, calls, actor.compute_log_probs)
        metrics = train_on_rollout(actor, batching, tokens=TOKENS, loss_masks=MASKS, rewards=REWARDS, group_size=2,
                                   rollout_log_probs=engine_lp, reuse_step_log_probs=reuse)  # fmt: skip
        results.append((len(calls), metrics, [p.detach().clone() for p in actor.params]))
    (calls_pass, with_pass, params_pass), (calls_reuse, reused, params_reuse) = results
    assert calls_pass >= 1 and calls_reuse == 0  # one pass per micro-batch, or none
    assert all(torch.equal(a, b) for a, b in zip(params_pass, params_reuse, strict=True))
    for key in ("train/loss", "train/grad_norm", "train/ppo_kl", "rollout/logprob_abs_diff/mean"):
        assert reused[key] == pytest.approx(with_pass[key], abs=1e-7), key
    assert reused["train/ppo_kl"] == 0.0 and reused["rollout/logprob_abs_diff/max"] < 1e-6


def _counted(calls: list, fn, *args):
    calls.append(1)
    return fn(*args)


def _recorded(store: dict, calls: list, fn, batch):
    """``fn(batch)``, counted, keeping each sequence's values under its tokens (packings differ; samples do not)."""
    from tidal.batching import unpack

    calls.append(batch.num_tokens)
    out = fn(batch)
    for seq, values in zip(unpack(batch.tokens, batch), unpack(out, batch), strict=True):
        store.setdefault(tuple(seq.tolist()), []).append(values.clone())
    return out


def test_log_probs_budget_packs_the_forward_passes_apart_with_the_same_results(dist_env, qwen2_dir):
    """--log-probs-max-tokens-per-gpu: old and reference log-probs on fewer, larger micro-batches, same numbers."""
    from tidal.actor import ReferenceModel
    from tidal.batching import plan_micro_batches

    gen = torch.Generator().manual_seed(0)
    lengths = [40, 25, 60, 33, 50, 20, 45, 30]  # 4 prompts x 2 samples, 2 optimizer steps of 4
    tokens = [torch.randint(0, 128, (n,), generator=gen).tolist() for n in lengths]
    masks = [[0] * 10 + [1] * (n - 10) for n in lengths]
    cfg = ActorConfig(hf_checkpoint=str(qwen2_dir), lr=1e-2, kl_loss_coef=0.1)
    runs = {}
    for budget in (None, 160):
        batching = BatchingConfig(rollout_batch_size=4, n_samples_per_prompt=2, num_steps_per_rollout=2,
                                  use_dynamic_batch_size=True, max_tokens_per_gpu=64,
                                  log_probs_max_tokens_per_gpu=budget)  # fmt: skip
        actor, reference = Actor(cfg), ReferenceModel(cfg)
        old, ref, calls = {}, {}, {"old": [], "ref": []}
        actor.compute_log_probs = functools.partial(_recorded, old, calls["old"], actor.compute_log_probs)
        reference.compute_log_probs = functools.partial(_recorded, ref, calls["ref"], reference.compute_log_probs)
        metrics = train_on_rollout(actor, batching, tokens=tokens, loss_masks=masks, rewards=[1.0, 0.0] * 4,
                                   group_size=2, reference=reference)  # fmt: skip
        runs[budget] = metrics, old, ref, calls, [p.detach().clone() for p in actor.params]
    (base, old_a, ref_a, calls_a, params_a), (own, old_b, ref_b, calls_b, params_b) = runs[None], runs[160]
    # the training micro-batches (64 tokens) of each step, against one forward plan of all 8 samples at 160 tokens
    steps = [plan_micro_batches(lengths[i : i + 4], dp_size=1, max_tokens_per_gpu=64) for i in (0, 4)]
    forward = plan_micro_batches(lengths, dp_size=1, max_tokens_per_gpu=160).num_micro_batches
    assert base["batching/logprob_num_micro_batches"] == sum(p.num_micro_batches for p in steps) == 6
    assert own["batching/logprob_num_micro_batches"] == forward == 2
    assert [len(c) for c in calls_a.values()] == [6, 6] and [len(c) for c in calls_b.values()] == [2, 2]
    assert max(calls_a["old"]) <= 64 and 64 < max(calls_b["old"]) <= 160
    for store in (old_a, ref_a, old_b, ref_b):  # every sample computed once
        assert len(store) == 8 and all(len(v) == 1 for v in store.values())
    for a, b in ((old_a, old_b), (ref_a, ref_b)):
        for seq, (values,) in a.items():
            torch.testing.assert_close(b[seq][0], values, rtol=0, atol=1e-5)
            assert values[10:].abs().sum() > 0
    for key in ("train/loss", "train/kl", "train/ppo_kl", "train/grad_norm"):
        assert own[key] == pytest.approx(base[key], rel=1e-4, abs=1e-6), key
    for a, b in zip(params_a, params_b, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def test_each_dp_rank_computes_the_forward_passes_of_exactly_the_samples_it_trains_on(dist_env, qwen2_dir):
    from tidal.actor.trainer import _forward_only_fields, _forward_passes, _plan_steps
    from tidal.batching import unpack

    gen = torch.Generator().manual_seed(1)
    lengths = [40, 25, 60, 33, 50, 20, 45, 30]
    tokens = [torch.randint(0, 128, (n,), generator=gen).tolist() for n in lengths]
    batching = BatchingConfig(
        rollout_batch_size=4, n_samples_per_prompt=2, num_steps_per_rollout=2,
        use_dynamic_batch_size=True, max_tokens_per_gpu=64, log_probs_max_tokens_per_gpu=160,
    )  # fmt: skip
    actor = Actor(ActorConfig(hf_checkpoint=str(qwen2_dir)))
    whole = pack(tokens)
    expected = unpack(actor.compute_log_probs(whole), whole)
    steps, pads = _plan_steps(batching, lengths, dp_size=2)
    assert pads == []
    passes = _forward_passes(actor, None, None, old_log_probs=True)
    covered, counts = set(), []
    for rank in (0, 1):
        fields, count = _forward_only_fields(passes, batching, steps, tokens, rank=rank, dp_size=2)
        trained = {int(indices[i]) for indices, plan in steps for mb in plan.micro_batches(rank) for i in mb}
        computed = {i for i, v in enumerate(fields["old_log_probs"]) if v is not None}
        assert computed == trained and len(trained) == 4  # its own samples of both steps, nothing else
        for i in computed:
            torch.testing.assert_close(fields["old_log_probs"][i], expected[i], rtol=0, atol=1e-5)
        covered |= computed
        counts.append(count)
    assert covered == set(range(8)) and counts[0] == counts[1] >= 1  # every rank reports the busiest rank's count


def test_a_rollout_with_nan_and_inf_rewards_skips_its_steps_and_reports_the_running_total(dist_env, qwen2_dir):
    actor = Actor(ActorConfig(hf_checkpoint=str(qwen2_dir), lr=1e-2, check_for_nan_in_loss_and_grad=False))
    batching = BatchingConfig(rollout_batch_size=2, n_samples_per_prompt=2, num_steps_per_rollout=2)
    rollout = {"tokens": TOKENS, "loss_masks": MASKS, "group_size": 2}
    poisoned = [math.nan, 0.0, 1.0, math.inf]  # one in each group: both steps of the rollout are non-finite
    for rollout_id, total in ((0, 2.0), (1, 4.0)):
        metrics = train_on_rollout(actor, batching, rewards=poisoned, rollout_id=rollout_id, **rollout)
        assert metrics["train/skipped"] == 1.0 and metrics["train/skipped_steps"] == total, metrics
    metrics = train_on_rollout(actor, batching, rewards=REWARDS, rollout_id=2, **rollout)
    assert metrics["train/skipped"] == 0.0 and metrics["train/skipped_steps"] == 4.0 and actor.num_steps == 2


def test_the_trained_micro_batches_carry_each_samples_own_advantage_and_loss_weight(dist_env, qwen2_dir):
    """Whatever micro-batch a sample lands in, its tokens carry its group-relative advantage and 1 / its length."""
    from tidal.actor.sample_weights import sample_weights
    from tidal.batching import unpack_micro_batches

    actor = Actor(ActorConfig(hf_checkpoint=str(qwen2_dir), lr=1e-2))
    seen = []
    train_step = actor.train_step
    actor.train_step = lambda mbs: seen.append(list(mbs)) or train_step(mbs)
    batching = BatchingConfig(rollout_batch_size=2, n_samples_per_prompt=2, micro_batch_size=1)
    train_on_rollout(actor, batching, tokens=TOKENS, loss_masks=MASKS, rewards=REWARDS, group_size=2)
    [step] = seen
    assert len(step) >= 2  # samples are spread over micro-batches
    expected = sample_weights(actor.cfg, loss_masks=MASKS, rewards=REWARDS, group_size=2)
    assert expected.advantages.tolist() == pytest.approx([0.7071, -0.7071, -0.7071, 0.7071], abs=1e-3)
    for name, per_sample in (("advantages", expected.advantages.tolist()), ("loss_weights", [1 / 2, 1, 1 / 3, 1])):
        got = unpack_micro_batches([mb.token_fields[name] for mb in step], step, num_samples=len(TOKENS))
        for values, tokens, value in zip(got, TOKENS, per_sample, strict=True):
            torch.testing.assert_close(values, torch.full((len(tokens),), float(value)))


def test_steps_count_episodes_and_pad_a_step_that_does_not_split_over_the_ranks():
    """4 episodes, 2 steps of 2 episodes: the first holds 3 samples (episode 0 forked), padded to 4 for 2 ranks."""
    from tidal.actor.trainer import _plan_steps

    batching = BatchingConfig(rollout_batch_size=2, n_samples_per_prompt=2, num_steps_per_rollout=2)
    lengths = [9, 4, 7, 6, 8]
    steps, pads = _plan_steps(batching, lengths, dp_size=2, episode=torch.tensor([0, 0, 1, 2, 3]))
    assert [indices for indices, _ in steps] == [[0, 1, 2, 5], [3, 4]] and pads == [1]  # the shortest, sample 1
    for indices, plan in steps:
        assert plan.lengths.tolist() == [lengths[i] if i < 5 else lengths[pads[i - 5]] for i in indices]
    with pytest.raises(ValueError, match=r"holds 3 episodes \(5 samples\)"):
        _plan_steps(batching, lengths, dp_size=2, episode=torch.tensor([0, 0, 1, 1, 2]))


def test_a_forked_episode_trains_both_trajectories_and_padding_trains_nothing(dist_env, qwen2_dir):
    """The samples of each rank of a 2-rank split: every real sample once with its episode's advantage and loss
    weight, the padding sample with loss mask 0; a step's loss weights sum to its episodes' count."""
    from tidal.actor.sample_weights import sample_weights

    tokens = [*TOKENS[:1], [5, 17, 99, 3, 61, 62], *TOKENS[1:]]  # episode 0 forked: a second trajectory
    masks = [*MASKS[:1], [0, 0, 0, 0, 1, 1], *MASKS[1:]]
    rewards = [REWARDS[0], *REWARDS]
    ids = [0, 0, 1, 2, 3]
    batching = BatchingConfig(rollout_batch_size=2, n_samples_per_prompt=2, micro_batch_size=1)
    actor = Actor(ActorConfig(hf_checkpoint=str(qwen2_dir), lr=1e-2))
    seen: dict[int, list] = {}
    train_step = actor.train_step
    expected = sample_weights(actor.cfg, loss_masks=masks, rewards=rewards, group_size=2, episode_ids=ids)
    found: dict[int, tuple] = {}
    for rank in (0, 1):
        actor.train_step = lambda mbs, rank=rank: seen.setdefault(rank, list(mbs)) and train_step(mbs)
        train_on_rollout(
            actor, batching, tokens=tokens, loss_masks=masks, rewards=rewards, group_size=2, rank=rank, dp_size=2,
            episode_ids=ids,
        )  # fmt: skip
        step = seen[rank]
        assert len(step) == 3  # 6 samples (5 and one padding) over 2 ranks, one per micro-batch
        weights = [mb.token_fields["loss_weights"] * mb.loss_mask for mb in step]
        for mb, w in zip(step, weights, strict=True):  # one sample per micro-batch; one step: indices are global
            found.setdefault(int(mb.sample_indices[0]), []).append(
                (mb.token_fields["advantages"], w, mb.loss_mask.tolist())
            )
    assert sorted(found) == [0, 1, 2, 3, 4, 5] and all(len(v) == 1 for v in found.values())
    for i in range(5):
        [(adv, _, mask)] = found[i]
        assert mask[: len(masks[i])] == masks[i]
        torch.testing.assert_close(adv[: len(tokens[i])], torch.full((len(tokens[i]),), float(expected.advantages[i])))
    [(_, padding_weight, padding_mask)] = found[5]
    assert not any(padding_mask) and float(padding_weight.sum()) == 0.0
    assert sum(float(lw.sum()) for v in found.values() for _, lw, _ in v) == pytest.approx(4.0)  # 4 episodes


def test_sft_loss_steps_lower_the_nll_of_the_loss_tokens_without_an_old_log_prob_pass(dist_env, qwen2_dir):
    """--loss-type sft_loss over several steps (the SFT stage's): no forward-only pass, loss = token-mean NLL."""
    cfg = ActorConfig(hf_checkpoint=str(qwen2_dir), lr=1e-2, loss_type="sft_loss", calculate_per_token_loss=True)
    actor = Actor(cfg)
    batch = pack(TOKENS, loss_masks=MASKS)
    mask = batch.loss_mask
    compute = actor.compute_log_probs
    before = float(-(compute(batch) * mask).sum() / mask.sum())
    calls = []
    actor.compute_log_probs = functools.partial(_counted, calls, compute)
    batching = BatchingConfig(rollout_batch_size=4, n_samples_per_prompt=1, num_steps_per_rollout=2)
    metrics = train_on_rollout(actor, batching, tokens=TOKENS, loss_masks=MASKS, rewards=[0.0] * 4, group_size=1)
    assert calls == [] and metrics["batching/logprob_num_micro_batches"] == 0.0
    assert metrics["train/num_steps"] == 2.0 and metrics["train/num_loss_tokens"] == 3.5  # 3 then 4 response tokens
    assert metrics["train/sft_loss"] == metrics["train/loss"] and math.isfinite(metrics["train/sft_loss"])
    after = float(-(compute(batch) * mask).sum() / mask.sum())
    assert after < before
