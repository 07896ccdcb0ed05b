"""ReferenceModel: frozen, from HF or a Megatron checkpoint (--ref-load), offloaded between uses."""

import pytest
import torch
from tidal.actor import Actor, ActorConfig, ReferenceModel
from tidal.batching import pack
from tidal.ckpt import CheckpointError, save_checkpoint

SEQS = [[5, 17, 99, 3, 42, 7, 64], [1, 2, 3, 4], [120, 0, 33, 33, 8, 90]]


def trained_actor(hf_dir, rl_batch):
    actor = Actor(ActorConfig(hf_checkpoint=str(hf_dir), lr=1e-2))
    actor.train_step([rl_batch(actor, SEQS)])
    return actor


def test_reference_is_frozen_and_keeps_the_initial_policy(dist_env, qwen2_dir, hf_reference, rl_batch):
    ref = ReferenceModel(ActorConfig(hf_checkpoint=str(qwen2_dir)))
    assert ref.offloaded and all(not p.requires_grad for p in ref.model.parameters())
    before = ref.compute_log_probs(pack(SEQS))
    _, expected = hf_reference(qwen2_dir, SEQS)
    torch.testing.assert_close(before, torch.cat(expected), atol=1e-4, rtol=0)
    assert ref.offloaded  # offloaded again after use
    actor = trained_actor(qwen2_dir, rl_batch)  # training another model leaves the reference alone
    assert not torch.allclose(actor.compute_log_probs(pack(SEQS)), before, atol=1e-3)
    torch.testing.assert_close(ref.compute_log_probs(pack(SEQS)), before, atol=0, rtol=0)


def test_reference_from_megatron_checkpoint(dist_env, qwen2_dir, tmp_path, rl_batch):
    actor = trained_actor(qwen2_dir, rl_batch)
    save_checkpoint(tmp_path / "ckpt", 1, actor.sharded_state_dict(with_optimizer=False))
    ref = ReferenceModel(ActorConfig(hf_checkpoint=str(qwen2_dir)), load_dir=tmp_path / "ckpt", offload=False)
    assert not ref.offloaded
    batch = pack(SEQS)
    torch.testing.assert_close(ref.compute_log_probs(batch), actor.compute_log_probs(batch), atol=0, rtol=0)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match=r"^--ref-load \S+ holds no checkpoint.*Point --ref-load at"):
        ReferenceModel(ActorConfig(hf_checkpoint=str(qwen2_dir)), load_dir=tmp_path / "empty")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="offloading moves parameters off a CUDA device")
def test_offload_frees_device_memory(dist_env, qwen2_dir):
    ref = ReferenceModel(ActorConfig(hf_checkpoint=str(qwen2_dir)), offload=False)
    on_device = torch.cuda.memory_allocated()
    expected = ref.compute_log_probs(pack(SEQS))
    ref.offload()
    assert all(p.device.type == "cpu" for p in ref.model.parameters())
    assert torch.cuda.memory_allocated() < on_device
    ref.offload_between_uses = True
    torch.testing.assert_close(ref.compute_log_probs(pack(SEQS)), expected, atol=0, rtol=0)
    assert all(p.device.type == "cpu" for p in ref.model.parameters())


def test_train_on_rollout_feeds_the_kl_term_from_the_reference(dist_env, qwen2_dir):
    from tidal.actor.trainer import train_on_rollout
    from tidal.batching import BatchingConfig

    tokens = [[5, 17, 99, 3], [5, 17, 42], [120, 0, 33, 33, 8], [120, 0, 4]]
    masks = [[0, 0, 1, 1], [0, 0, 1], [0, 0, 1, 1, 1], [0, 0, 1]]
    cfg = ActorConfig(hf_checkpoint=str(qwen2_dir), lr=1e-2, kl_loss_coef=0.1)
    batching = BatchingConfig(rollout_batch_size=2, n_samples_per_prompt=2, num_steps_per_rollout=2)
    rollout = dict(tokens=tokens, loss_masks=masks, rewards=[1.0, 0.0, 0.0, 1.0], group_size=2)
    with pytest.raises(ValueError, match="ref_log_probs"):
        train_on_rollout(Actor(cfg), batching, **rollout)
    ref = ReferenceModel(cfg)
    metrics = train_on_rollout(Actor(cfg), batching, **rollout, reference=ref)
    # step 1: actor == reference (KL 0); step 2: the actor moved, k3 > 0
    assert metrics["train/kl"] > 0 and ref.offloaded
