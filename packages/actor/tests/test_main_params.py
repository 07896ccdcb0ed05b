"""bf16 parameters with fp32 main copies (--fp32-main-params) against fp32 parameters, and bucketed weight export."""

import pytest
import torch
from tidal.actor import Actor, ActorConfig

SEQS = [[5, 17, 99, 3, 42, 7, 64], [1, 2, 3, 4], [120, 0, 33, 33, 8, 90, 12, 101, 4, 56, 77], [9, 8, 7, 6, 5]]
MIXED = dict(params_dtype="bfloat16", fp32_main_params=True)


ADV = [1.0, -1.0, 0.5, -0.5]


def _mains(actor):
    if actor.main_params:
        return [m.detach().clone() for m in actor.main_params.main]
    return [p.detach().clone() for p in actor.params]


def test_same_update_as_fp32(dist_env, qwen2_dir, rl_batch):
    """--params-dtype bfloat16 with --fp32-main-params: bf16 weights, the fp32 update."""
    # adam_eps=1 makes the first update ~ lr * grad, so it compares gradients, not their signs
    cfg = dict(hf_checkpoint=str(qwen2_dir), lr=1e-2, adam_eps=1.0, clip_grad=0.0)
    ref, mixed = Actor(ActorConfig(**cfg)), Actor(ActorConfig(**cfg, **MIXED))
    assert all(p.dtype == torch.bfloat16 for p in mixed.model.parameters())
    assert all(m.dtype == torch.float32 for m in mixed.main_params.main)
    before_ref, before_mixed = _mains(ref), _mains(mixed)
    m_ref = ref.train_step([rl_batch(ref, SEQS, ADV)])
    m_mixed = mixed.train_step([rl_batch(mixed, SEQS, ADV)])
    assert m_mixed["train/loss"] == pytest.approx(m_ref["train/loss"], rel=2e-2, abs=1e-3)
    assert m_mixed["train/grad_norm"] == pytest.approx(m_ref["train/grad_norm"], rel=2e-2)
    d_ref = torch.cat([(a - b).flatten() for a, b in zip(_mains(ref), before_ref, strict=True)])
    d_mixed = torch.cat([(a - b).flatten() for a, b in zip(_mains(mixed), before_mixed, strict=True)])
    assert d_ref.norm() > 0
    assert (d_mixed - d_ref).norm() / d_ref.norm() < 0.05
    # the model's bf16 parameters are the rounded main parameters
    for p, m in zip(mixed.params, mixed.main_params.main, strict=True):
        assert torch.equal(p, m.to(torch.bfloat16))


def test_small_updates_survive_in_main_params(dist_env, qwen2_dir, rl_batch):
    # lr 1e-5 is ~100x below bf16's resolution at these weights (~0.1): bf16 weights alone would not move
    mixed = Actor(ActorConfig(hf_checkpoint=str(qwen2_dir), lr=1e-5, clip_grad=0.0, **MIXED))
    before = _mains(mixed)
    mixed.train_step([rl_batch(mixed, SEQS, ADV)])
    moved = torch.cat([(a - b).abs().flatten() for a, b in zip(_mains(mixed), before, strict=True)])
    assert moved.max() == pytest.approx(1e-5, rel=1e-2)  # Adam's first step: lr * sign(grad)
    assert (moved > 0).float().mean() > 0.5


def test_fp32_gradient_accumulation(dist_env, qwen2_dir, rl_batch):
    cfg = ActorConfig(hf_checkpoint=str(qwen2_dir), lr=1e-2, clip_grad=0.0, **MIXED)
    one, two = Actor(cfg), Actor(cfg)
    one.train_step([rl_batch(one, SEQS, ADV)])
    two.train_step([rl_batch(two, SEQS[:2], ADV[:2]), rl_batch(two, SEQS[2:], ADV[2:])])
    g1 = torch.cat([m.grad.flatten() for m in one.main_params.main])  # kept until the next step
    g2 = torch.cat([m.grad.flatten() for m in two.main_params.main])
    assert g1.dtype == torch.float32 and g1.norm() > 0
    assert (g1 - g2).norm() / g1.norm() < 0.02
    assert all(p.grad is None for p in two.params)  # bf16 gradients are folded in and freed


def test_export_is_main_params_and_buckets_match(dist_env, qwen2_dir, rl_batch):
    mixed = Actor(ActorConfig(hf_checkpoint=str(qwen2_dir), lr=1e-2, **MIXED))
    mixed.train_step([rl_batch(mixed, SEQS, ADV)])
    exported = dict(mixed.named_hf_tensors())
    assert all(t.dtype == torch.float32 for t in exported.values())  # the checkpoint path exports fp32 main copies
    main_lm = mixed.main_params.main[[id(p) for p in mixed.params].index(id(mixed.model.output_layer.weight))]
    torch.testing.assert_close(exported["lm_head.weight"], main_lm.detach(), atol=0, rtol=0)
    buckets = list(mixed.hf_tensor_buckets(bucket_bytes=32 * 2**10))
    assert len(buckets) > 1
    names = [n for b in buckets for n, _ in b]
    assert names == list(exported)
    for bucket in buckets:
        assert bucket.flat.dtype == torch.bfloat16 and bucket.flat.dim() == 1
        assert bucket.flat.numel() * 2 <= 32 * 2**10 or len(bucket.names) == 1
        assert sum(t.numel() for t in bucket.tensors) == bucket.flat.numel()
        for name, tensor in bucket:
            assert tensor.untyped_storage().data_ptr() == bucket.flat.untyped_storage().data_ptr()
            # the bf16 model weights are the rounded main weights
            assert torch.equal(tensor, exported[name].to(torch.bfloat16)), name


def test_buckets_equal_per_tensor_export_fp32_model(dist_env, qwen2_dir):
    actor = Actor(ActorConfig(hf_checkpoint=str(qwen2_dir)))
    exported = dict(actor.named_hf_tensors())
    for dtype in (torch.bfloat16, torch.float32):
        pairs = [(n, t) for b in actor.hf_tensor_buckets(dtype=dtype, bucket_bytes=2**20) for n, t in b]
        assert [n for n, _ in pairs] == list(exported)
        for name, tensor in pairs:
            assert tensor.dtype == dtype and torch.equal(tensor, exported[name].to(dtype)), name


def test_config_needs_half_params():
    with pytest.raises(ValueError, match="--fp32-main-params"):
        ActorConfig(hf_checkpoint="x", fp32_main_params=True)
