"""PPO's critic on the real Megatron model over gloo: its head, learning a known value function, PPO rollouts,
critic-only rollouts, and its checkpoint section beside the actor's (``--critic-load``)."""

import math

import pytest
import torch
from tidal.actor import Actor, ActorConfig
from tidal.actor.bridge import ValueHead
from tidal.actor.critic import Critic
from tidal.actor.trainer import train_on_rollout
from tidal.batching import BatchingConfig, pack
from tidal.ckpt import load_checkpoint, save_checkpoint

# A toy task with a known value function: a response after prompt [5, 17] is worth 1, after [120, 0] nothing.
TOKENS = [[5, 17, 99, 3], [5, 17, 42], [120, 0, 33, 33, 8], [120, 0, 4]]
MASKS = [[0, 0, 1, 1], [0, 0, 1], [0, 0, 1, 1, 1], [0, 0, 1]]
REWARDS = [1.0, 1.0, 0.0, 0.0]


def ppo_config(hf_dir, **kw):
    return ActorConfig(hf_checkpoint=str(hf_dir), advantage_estimator="ppo", lr=1e-2, critic_lr=5e-3, **kw)


def critic_batch(critic):
    """The returns of the toy task at gamma = lambda = 1 (every action's return is its sample's reward)."""
    plain = pack(TOKENS, loss_masks=MASKS)
    returns = [[r * m for m in mask] for r, mask in zip(REWARDS, MASKS, strict=True)]
    old = torch.split(critic.compute_values(plain), [len(t) for t in TOKENS])
    fields = {"returns": returns, "old_values": [o.tolist() for o in old]}
    return pack(TOKENS, loss_masks=MASKS, token_fields=fields)


@pytest.mark.parametrize("tied", [False, True])
def test_critic_is_the_backbone_with_a_zero_value_head(dist_env, qwen2_dir, qwen2_tied_dir, tied):
    hf_dir = qwen2_tied_dir if tied else qwen2_dir
    critic, actor = Critic(ppo_config(hf_dir)), Actor(ppo_config(hf_dir))
    assert isinstance(critic.model.output_layer, ValueHead)
    assert critic.cfg.lr == 5e-3 and critic.loss_settings.value_clip is None
    critic_params = dict(critic.model.named_parameters())
    for name, p in actor.model.named_parameters():  # the same backbone, loaded from the same HF checkpoint
        if not name.startswith("output_layer."):
            assert torch.equal(p, critic_params[name]), name
    assert sorted(n for n in critic_params if n.startswith("output_layer.")) == [
        "output_layer.bias",
        "output_layer.weight",
    ]
    values = critic.compute_values(pack(TOKENS))
    assert values.shape == (sum(map(len, TOKENS)),) and values.abs().max() == 0


def test_critic_learns_a_known_value_function(dist_env, qwen2_dir):
    critic = Critic(ppo_config(qwen2_dir, value_clip=0.5))
    losses = []
    for _ in range(12):
        metrics = critic.train_step([critic_batch(critic)])
        losses.append(metrics["critic/value_loss"])
        assert math.isfinite(metrics["critic/grad_norm"]) and metrics["critic/lr"] == 5e-3
    assert losses[0] == pytest.approx(0.5 * 3 / 7, abs=1e-6)  # 0.5 * mean over tokens of (0 - return)^2
    assert losses[-1] < 0.1 * losses[0], losses
    assert losses[0] > losses[1] > losses[2] > losses[3], losses  # seen: 0.214, 0.124, 0.055, 0.016, ... 0.0016
    values = torch.split(critic.compute_values(pack(TOKENS, loss_masks=MASKS)), [len(t) for t in TOKENS])
    for v, mask, reward in zip(values, MASKS, REWARDS, strict=True):  # V(s) ~ the prompt's reward on every action
        actions = v[torch.tensor(mask, dtype=torch.bool)]
        assert (actions - reward).abs().max() < 0.3, (actions, reward)


def test_ppo_rollouts_train_the_critic_alone_first_then_both(dist_env, qwen2_dir):
    cfg = ppo_config(qwen2_dir, value_clip=0.2, num_critic_only_steps=1, gamma=1.0, lambd=0.95)
    actor, critic = Actor(cfg), Critic(cfg)
    batching = BatchingConfig(rollout_batch_size=2, n_samples_per_prompt=2, num_steps_per_rollout=2)
    rewards = [1.0, 0.0, 0.0, 1.0]  # one good and one bad response per prompt
    plain = pack(TOKENS, loss_masks=MASKS)
    before = actor.compute_log_probs(plain)
    kw = dict(tokens=TOKENS, loss_masks=MASKS, rewards=rewards, group_size=2, critic=critic)
    first = train_on_rollout(actor, batching, rollout_id=0, **kw)
    assert first["train/critic_only"] == 1.0 and "train/loss" not in first
    assert torch.equal(actor.compute_log_probs(plain), before)  # the actor waited
    for key in ("critic/value_loss", "critic/clipfrac", "critic/values_mean", "critic/explained_variance"):
        assert math.isfinite(first[key]), key
    # the zero head's first values are 0: no better than the returns' mean
    assert first["critic/explained_variance"] == pytest.approx(0.0, abs=1e-6) and first["critic/returns_mean"] > 0
    second = train_on_rollout(actor, batching, rollout_id=1, **kw)
    assert second["train/critic_only"] == 0.0 and second["train/num_steps"] == 2.0
    assert math.isfinite(second["train/loss"]) and second["train/grad_norm"] > 0
    assert second["critic/value_loss"] < first["critic/value_loss"]
    after = actor.compute_log_probs(plain)
    gain = sum(
        (r - 0.5) * float(((a - b) * torch.tensor(m, dtype=torch.float32)).sum())
        for a, b, m, r in zip(*(torch.split(x, [4, 3, 5, 3]) for x in (after, before)), MASKS, rewards, strict=True)
    )
    assert gain > 0  # rewarded responses became likelier
    with pytest.raises(ValueError, match="ppo"):
        train_on_rollout(actor, batching, tokens=TOKENS, loss_masks=MASKS, rewards=rewards, group_size=2)


def test_critic_checkpoint_section_beside_the_actor_and_critic_load(dist_env, qwen2_dir, tmp_path):
    cfg = ppo_config(qwen2_dir)
    actor, critic = Actor(cfg), Critic(cfg)
    critic.train_step([critic_batch(critic)])
    save_checkpoint(tmp_path / "ckpt", 1, {**actor.sharded_state_dict(), **critic.checkpoint_sections()})

    resumed = Critic(cfg)
    state, _ = load_checkpoint(tmp_path / "ckpt", resumed.checkpoint_sections())
    resumed.load_checkpoint_sections(state)
    assert resumed.num_steps == 1
    probe = pack(TOKENS)
    torch.testing.assert_close(resumed.compute_values(probe), critic.compute_values(probe), atol=0, rtol=0)
    ma, mb = critic.train_step([critic_batch(critic)]), resumed.train_step([critic_batch(resumed)])
    assert ma == mb  # Adam moments and step count came back too

    loaded = Critic(cfg, load_dir=tmp_path / "ckpt")  # --critic-load: model only
    assert loaded.num_steps == 0 and loaded.compute_values(probe).abs().max() > 0
    # the actor's own section is untouched by the critic's
    state, _ = load_checkpoint(tmp_path / "ckpt", actor.sharded_state_dict())
    assert set(state) == {"model", "optimizer"}
