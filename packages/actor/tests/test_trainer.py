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
