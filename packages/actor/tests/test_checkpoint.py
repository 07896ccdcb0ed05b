"""Actor state through tidal.ckpt's real dist_checkpointing save/load (model + AdamW state)."""

import torch
from tidal.actor import Actor, ActorConfig
from tidal.batching import pack
from tidal.ckpt import load_checkpoint, save_checkpoint

SEQS = [[5, 17, 99, 3, 42, 7, 64], [1, 2, 3, 4], [120, 0, 33, 33, 8, 90]]


def test_save_load_resumes_identically(dist_env, qwen2_dir, tmp_path, rl_batch):
    cfg = ActorConfig(hf_checkpoint=str(qwen2_dir), lr=1e-2, lr_warmup_steps=3)
    a = Actor(cfg)
    a.train_step([rl_batch(a, SEQS)])
    save_checkpoint(tmp_path / "ckpt", 1, a.sharded_state_dict())

    b = Actor(cfg)  # fresh weights from HF, fresh optimizer
    assert not torch.equal(a.model.output_layer.weight, b.model.output_layer.weight)
    state, _ = load_checkpoint(tmp_path / "ckpt", b.sharded_state_dict())
    b.load_state_dict(state)
    assert b.num_steps == 1
    for (name, pa), pb in zip(a.model.named_parameters(), b.model.parameters(), strict=True):
        assert torch.equal(pa, pb), name

    # the next step (Adam moments, step count and warm-up lr included) is identical
    ma, mb = a.train_step([rl_batch(a, SEQS)]), b.train_step([rl_batch(b, SEQS)])
    assert ma["train/lr"] == mb["train/lr"] == 2 * 1e-2 / 3
    for (name, pa), pb in zip(a.model.named_parameters(), b.model.parameters(), strict=True):
        torch.testing.assert_close(pa, pb, atol=0, rtol=0, msg=name)


def test_model_only_load(dist_env, qwen2_dir, tmp_path, rl_batch):
    cfg = ActorConfig(hf_checkpoint=str(qwen2_dir), lr=1e-2)
    a = Actor(cfg)
    a.train_step([rl_batch(a, SEQS)])
    save_checkpoint(tmp_path / "ckpt", 3, a.sharded_state_dict(with_optimizer=False))
    b = Actor(cfg)
    state, _ = load_checkpoint(tmp_path / "ckpt", b.sharded_state_dict(with_optimizer=False))
    b.load_state_dict(state)
    assert b.num_steps == 0
    torch.testing.assert_close(a.compute_log_probs(pack(SEQS)), b.compute_log_probs(pack(SEQS)), atol=0, rtol=0)


def test_fp32_main_params_resume_identically(dist_env, qwen2_dir, tmp_path, rl_batch):
    cfg = ActorConfig(hf_checkpoint=str(qwen2_dir), lr=1e-5, params_dtype="bfloat16", fp32_main_params=True)
    a = Actor(cfg)
    a.train_step([rl_batch(a, SEQS)])
    save_checkpoint(tmp_path / "ckpt", 1, a.sharded_state_dict())
    b = Actor(cfg)
    state, _ = load_checkpoint(tmp_path / "ckpt", b.sharded_state_dict())
    b.load_state_dict(state)
    # the fp32 main weights (not just their bf16 rounding) come back
    for ma, mb in zip(a.main_params.main, b.main_params.main, strict=True):
        assert torch.equal(ma, mb)
    a.train_step([rl_batch(a, SEQS)]), b.train_step([rl_batch(b, SEQS)])
    for ma, mb in zip(a.main_params.main, b.main_params.main, strict=True):
        assert torch.equal(ma, mb)
    for pa, pb in zip(a.model.parameters(), b.model.parameters(), strict=True):
        assert pa.dtype == torch.bfloat16 and torch.equal(pa, pb)
