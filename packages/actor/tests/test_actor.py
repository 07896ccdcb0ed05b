import math

import pytest
import torch
from tidal.actor import Actor, ActorConfig
from tidal.actor.loss import grpo_advantages
from tidal.actor.offload import host_copy_shapes
from tidal.batching import pack, unpack

SEQS = [[5, 17, 99, 3, 42, 7, 64], [1, 2, 3], [120, 0, 33, 33, 8, 90, 12, 101, 4, 56, 77]]
PROMPT_LEN = 2


@pytest.fixture(scope="module")
def actor(dist_env, qwen2_dir):
    return Actor(ActorConfig(hf_checkpoint=str(qwen2_dir), lr=1e-3, log_probs_chunk_size=5))


def rl_batch(actor, seqs, **kw):
    """A packed RL micro-batch: responses after PROMPT_LEN tokens, old log-probs from the actor itself."""
    masks = [[0] * PROMPT_LEN + [1] * (len(s) - PROMPT_LEN) for s in seqs]
    plain = pack(seqs, loss_masks=masks, **kw)
    old = unpack(actor.compute_log_probs(plain), plain)
    rewards = torch.tensor([float(i % 2) for i in range(len(seqs))])
    adv = grpo_advantages(rewards, 2, normalize_std=False) if len(seqs) % 2 == 0 else rewards - rewards.mean()
    fields = {
        "old_log_probs": [o.tolist() for o in old],
        "advantages": [[float(a)] * len(s) for a, s in zip(adv, seqs, strict=True)],
    }
    return pack(seqs, loss_masks=masks, token_fields=fields, **kw)


def test_log_probs_match_transformers_with_padding(actor, qwen2_dir, hf_reference):
    batch = pack(SEQS, pad_to_multiple_of=8)
    assert batch.num_padding_tokens > 0
    lp = actor.compute_log_probs(batch)
    assert lp.dtype == torch.float32 and lp.shape == (batch.num_tokens,)
    _, ref = hf_reference(qwen2_dir, SEQS)
    for ours, theirs in zip(unpack(lp, batch), ref, strict=True):
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
        assert ours[0] == 0.0


def test_packed_equals_unpacked(actor):
    packed = unpack(actor.compute_log_probs(pack(SEQS)), pack(SEQS))
    for seq, lp in zip(SEQS, packed, strict=True):
        alone = actor.compute_log_probs(pack([seq]))
        torch.testing.assert_close(lp, alone, atol=1e-5, rtol=0)


def test_named_hf_tensors_shapes(actor, qwen2_dir):
    from safetensors.torch import load_file

    original = load_file(qwen2_dir / "model.safetensors")
    exported = dict(actor.named_hf_tensors())
    assert {k: v.shape for k, v in exported.items()} == {k: v.shape for k, v in original.items()}


def test_sharded_state_dict_covers_model(actor):
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    sd = actor.sharded_state_dict()["model"]
    tensors = [v for v in sd.values() if isinstance(v, ShardedTensor | ShardedTensorFactory)]
    assert {t.key for t in tensors} >= {"embedding.word_embeddings.weight", "output_layer.weight"}
    assert sum(t.data.numel() for t in tensors) == sum(p.numel() for p in actor.model.parameters())


def test_train_step_changes_weights_and_reports_metrics(dist_env, qwen2_dir):
    actor = Actor(ActorConfig(hf_checkpoint=str(qwen2_dir), lr=1e-2, entropy_coef=0.01, clip_grad=1.0))
    before = {n: p.detach().clone() for n, p in actor.model.named_parameters()}
    # what reserve_offload_memory pins before the first step (on CUDA) is what an offload after a step moves
    actor._ensure_optimizer_state()
    planned = sorted((tuple(s), str(d)) for s, d in host_copy_shapes(actor._offloadable(), with_host=True))
    batch = rl_batch(actor, [*SEQS, [9, 8, 7, 6, 5]])
    metrics = actor.train_step([batch])
    for key in ("train/loss", "train/pg_loss", "train/pg_clipfrac", "train/ppo_kl", "train/entropy"):
        assert math.isfinite(metrics[key]), key
    assert metrics["train/grad_norm"] > 0 and metrics["train/lr"] == 1e-2 and metrics["train/skipped"] == 0.0
    assert metrics["train/num_loss_tokens"] == float(batch.loss_mask.sum())
    # old == current at the first step: ratio 1, nothing clipped, ppo_kl 0
    assert metrics["train/pg_clipfrac"] == 0.0 and abs(metrics["train/ppo_kl"]) < 1e-5
    changed = [n for n, p in actor.model.named_parameters() if not torch.equal(p, before[n])]
    assert len(changed) == len(before)
    # the step moved the policy towards the positive-advantage sequences
    after = actor.compute_log_probs(batch)
    old = batch.token_fields["old_log_probs"]
    gain = ((after - old) * batch.token_fields["advantages"] * batch.loss_mask).sum()
    assert gain > 0
    # the co-located hand-off: parameters, gradients and both Adam moments take part; on CPU nothing moves
    held = list(actor._offloadable())
    assert len(held) >= 3 * len(actor.params) and all(any(t is h for h in held) for t in actor.params)
    assert sorted((tuple(s), str(d)) for s, d in host_copy_shapes(held, with_host=True)) == planned
    moved = actor.offload()
    assert moved["actor/offload_gb"] == 0.0 and moved["actor/offload_s"] >= 0.0
    assert actor.onload()["actor/onload_gb"] == 0.0
    assert torch.equal(actor.compute_log_probs(batch), after)


def test_grad_accumulation_equals_one_big_batch(dist_env, qwen2_dir):
    seqs = [*SEQS, [9, 8, 7, 6, 5]]
    # adam_eps=1 makes Adam's first update ~ lr * grad (not ~ lr * sign(grad), which flips on rounding noise)
    cfg = ActorConfig(hf_checkpoint=str(qwen2_dir), lr=1.0, adam_eps=1.0, clip_grad=0.0)
    one, two = Actor(cfg), Actor(cfg)
    two_before = two.model.output_layer.weight.detach().clone()
    m1 = one.train_step([rl_batch(one, seqs)])
    m2 = two.train_step([rl_batch(two, seqs[:2]), rl_batch(two, seqs[2:])])
    assert m1["train/loss"] == pytest.approx(m2["train/loss"], abs=1e-6)
    assert m1["train/grad_norm"] == pytest.approx(m2["train/grad_norm"], rel=1e-4)
    for (name, p1), p2 in zip(one.model.named_parameters(), two.model.parameters(), strict=True):
        torch.testing.assert_close(p1, p2, atol=1e-6, rtol=0, msg=name)
    assert not torch.equal(one.model.output_layer.weight, two_before)


def test_recompute_activations_gives_the_same_step(dist_env, qwen2_dir):
    cfg = dict(hf_checkpoint=str(qwen2_dir), lr=1.0, adam_eps=1.0, clip_grad=0.0)
    plain, recompute = Actor(ActorConfig(**cfg)), Actor(ActorConfig(**cfg, recompute_activations=True))
    calls = {"plain": 0, "recompute": 0}
    plain.model.decoder.layers[0].self_attention.register_forward_hook(
        lambda *_: calls.__setitem__("plain", calls["plain"] + 1)
    )
    recompute.model.decoder.layers[0].self_attention.register_forward_hook(
        lambda *_: calls.__setitem__("recompute", calls["recompute"] + 1)
    )
    b1, b2 = rl_batch(plain, SEQS), rl_batch(recompute, SEQS)
    calls.update(plain=0, recompute=0)
    m1, m2 = plain.train_step([b1]), recompute.train_step([b2])
    assert calls == {"plain": 1, "recompute": 2}  # the layer ran again during backward
    assert m1["train/grad_norm"] == pytest.approx(m2["train/grad_norm"], rel=1e-5)
    for (name, p1), p2 in zip(plain.model.named_parameters(), recompute.model.parameters(), strict=True):
        torch.testing.assert_close(p1, p2, atol=1e-6, rtol=0, msg=name)


def test_recompute_num_layers_recomputes_only_the_first_layers(dist_env, qwen2_dir):
    cfg = dict(hf_checkpoint=str(qwen2_dir), lr=1.0, adam_eps=1.0, clip_grad=0.0)
    plain = Actor(ActorConfig(**cfg))
    partial = Actor(ActorConfig(**cfg, recompute_activations=True, recompute_num_layers=1))
    assert len(partial.model.decoder.layers) > 1
    calls = {}
    for i, layer in enumerate(partial.model.decoder.layers):
        layer.self_attention.register_forward_hook(lambda *_, i=i: calls.__setitem__(i, calls.get(i, 0) + 1))
    b1, b2 = rl_batch(plain, SEQS), rl_batch(partial, SEQS)  # (a forward each: counted from here on)
    calls.clear()
    m1, m2 = plain.train_step([b1]), partial.train_step([b2])
    assert calls == {0: 2, **{i: 1 for i in range(1, len(partial.model.decoder.layers))}}
    assert m1["train/grad_norm"] == pytest.approx(m2["train/grad_norm"], rel=1e-5)
    for (name, p1), p2 in zip(plain.model.named_parameters(), partial.model.parameters(), strict=True):
        torch.testing.assert_close(p1, p2, atol=1e-6, rtol=0, msg=name)
    with pytest.raises(ValueError, match="--recompute-num-layers 2 needs --recompute-activations"):
        ActorConfig(hf_checkpoint="x", recompute_num_layers=2)


def test_config_errors_name_the_flag():
    with pytest.raises(ValueError, match="--eps-clip"):
        ActorConfig(hf_checkpoint="x", eps_clip=0.0)
    with pytest.raises(ValueError, match="--kl-loss-type"):
        ActorConfig(hf_checkpoint="x", kl_loss_type="kl")
    with pytest.raises(ValueError, match="--cudnn-attention-min-tokens must be >= 0"):
        ActorConfig(hf_checkpoint="x", cudnn_attention_min_tokens=-1)


def test_the_cudnn_threshold_reaches_every_attention_module(actor, dist_env, qwen2_dir):
    """--cudnn-attention-min-tokens is what each PackedCoreAttention routes by; 0 turns the cuDNN route off."""
    from tidal.actor.attention import PackedCoreAttention

    def thresholds(a):
        return {m.cudnn_min_segment for m in a.model.modules() if isinstance(m, PackedCoreAttention)}

    assert thresholds(actor) == {2048}  # the default
    assert thresholds(Actor(ActorConfig(hf_checkpoint=str(qwen2_dir), cudnn_attention_min_tokens=0))) == {None}
    assert thresholds(Actor(ActorConfig(hf_checkpoint=str(qwen2_dir), cudnn_attention_min_tokens=4096))) == {4096}


def _poisoned(batch, value: float):
    """``batch`` with one loss token's advantage set to ``value`` (a NaN or an Inf reward reaching the loss)."""
    import dataclasses

    advantages = batch.token_fields["advantages"].clone()
    advantages[int(batch.loss_mask.nonzero()[0])] = value
    return dataclasses.replace(batch, token_fields={**batch.token_fields, "advantages": advantages})


@pytest.mark.parametrize("value", [math.nan, math.inf], ids=["nan", "inf"])
def test_a_non_finite_step_stops_the_run_by_default(dist_env, qwen2_dir, value):
    from tidal.actor import ActorError

    actor = Actor(ActorConfig(hf_checkpoint=str(qwen2_dir), lr=1e-2))
    with pytest.raises(ActorError, match=r"^optimizer step 0: the gradient norm is (nan|inf) .*--no-check-for-nan"):
        actor.train_step([_poisoned(rl_batch(actor, SEQS), value)])


@pytest.mark.parametrize("value", [math.nan, math.inf], ids=["nan", "inf"])
def test_a_non_finite_step_is_skipped_and_counted_when_asked(dist_env, qwen2_dir, value):
    """--no-check-for-nan-in-loss-and-grad: the step is skipped (nothing applied) and counted, the run goes on."""
    actor = Actor(ActorConfig(hf_checkpoint=str(qwen2_dir), lr=1e-2, check_for_nan_in_loss_and_grad=False))
    good = rl_batch(actor, SEQS)
    assert actor.train_step([good])["train/skipped_steps"] == 0.0
    weights = {n: p.detach().clone() for n, p in actor.model.named_parameters()}
    for total in (1.0, 2.0):
        metrics = actor.train_step([_poisoned(good, value)])
        assert not math.isfinite(metrics["train/grad_norm"])
        assert metrics["train/skipped"] == 1.0 and metrics["train/skipped_steps"] == total
    assert all(torch.equal(p, weights[n]) for n, p in actor.model.named_parameters())  # nothing was applied
    assert actor.num_steps == 1
    metrics = actor.train_step([good])  # the next finite step trains, and the total stays
    assert metrics["train/skipped"] == 0.0 and metrics["train/skipped_steps"] == 2.0 and actor.num_steps == 2
    assert any(not torch.equal(p, weights[n]) for n, p in actor.model.named_parameters())


def test_optimizer_flags_reach_adamw_and_shape_the_step(dist_env, qwen2_dir):
    """--adam-beta2, --adam-eps and --weight-decay are AdamW's; --lr-warmup-iters ramps the step's learning rate.

    Two actors differing only in weight decay take the same Adam update, so their parameters differ by exactly the
    decoupled decay of the learning rate the warm-up gave: lr x step / warm-up x decay x the initial weight.
    """
    cfg = dict(hf_checkpoint=str(qwen2_dir), lr=1e-2, adam_beta2=0.95, adam_eps=1e-5, lr_warmup_steps=4)
    decayed, plain = Actor(ActorConfig(**cfg, weight_decay=0.5)), Actor(ActorConfig(**cfg))
    for group in decayed.optimizer.param_groups:
        assert (group["betas"], group["eps"], group["weight_decay"]) == ((0.9, 0.95), 1e-5, 0.5)
    assert all(group["weight_decay"] == 0.0 for group in plain.optimizer.param_groups)
    start = {n: p.detach().clone() for n, p in decayed.model.named_parameters()}
    batch = rl_batch(decayed, SEQS)
    for step, expected_lr in enumerate((2.5e-3, 5e-3)):
        m1, m2 = decayed.train_step([batch]), plain.train_step([batch])
        assert m1["train/lr"] == m2["train/lr"] == pytest.approx(expected_lr)
        assert [g["lr"] for g in decayed.optimizer.param_groups] == [pytest.approx(expected_lr)] * len(
            decayed.optimizer.param_groups
        )
        if step == 0:
            for (name, p1), p2 in zip(decayed.model.named_parameters(), plain.model.parameters(), strict=True):
                torch.testing.assert_close(p2 - p1, expected_lr * 0.5 * start[name], atol=1e-7, rtol=1e-3, msg=name)


def test_clip_grad_bounds_the_gradient_the_step_applies(dist_env, qwen2_dir):
    """--clip-grad scales the gradient to that norm before the update (0: no clipping); the norm is logged unclipped.

    With adam_eps=1 Adam's first update is ~ lr x gradient, so a gradient clipped to a tenth of its norm moves the
    weights a tenth as far.
    """
    cfg = dict(hf_checkpoint=str(qwen2_dir), lr=1.0, adam_eps=1.0)
    free = Actor(ActorConfig(**cfg, clip_grad=0.0))
    start = [p.detach().clone() for p in free.model.parameters()]
    batch = rl_batch(free, SEQS)
    norm = free.train_step([batch])["train/grad_norm"]
    clipped = Actor(ActorConfig(**cfg, clip_grad=norm / 10))
    assert clipped.train_step([batch])["train/grad_norm"] == pytest.approx(norm, rel=1e-5)

    def moved(actor):
        pairs = zip(actor.model.parameters(), start, strict=True)
        return math.sqrt(sum(float(((p.detach() - s) ** 2).sum()) for p, s in pairs))

    assert moved(clipped) == pytest.approx(moved(free) / 10, rel=0.05)


def test_bf16_autocast_is_a_cuda_option_and_says_so_on_cpu(dist_env, qwen2_dir, caplog):
    """--bf16 autocasts forward and backward on CUDA; on a CPU it warns that it has no effect, and the memory plan
    counts its activations at 2 bytes."""
    from tidal.actor import MemoryInputs

    actor = Actor(ActorConfig(hf_checkpoint=str(qwen2_dir), bf16=True))
    assert actor._autocast == torch.cuda.is_available()
    if not torch.cuda.is_available():
        assert "--bf16 has no effect on CPU" in caplog.text
    from tidal.actor.memory_plan import _activation_bytes

    tokens = {"train_tokens": 64, "logprob_tokens": 64, "longest_sequence": 64}
    assert _activation_bytes(MemoryInputs.from_actor_config(actor.cfg, **tokens)) == 2
    assert _activation_bytes(MemoryInputs.from_actor_config(ActorConfig(hf_checkpoint="x"), **tokens)) == 4
