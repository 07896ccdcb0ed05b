"""The fast paths against the code they stand in for: TP=1 log-softmax, fused RoPE arithmetic, LM-head kept."""

import pytest
import torch
from tidal.actor import Actor, ActorConfig, fused
from tidal.actor.logprobs import local_log_probs, vocab_parallel_log_probs
from tidal.batching import pack

SEQS = [[5, 17, 99, 3, 42, 7, 64], [1, 2, 3, 4], [120, 0, 33, 33, 8, 90, 12, 101, 4, 56, 77]]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_local_log_probs_equal_vocab_parallel(dist_env, temperature):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(37, 300, generator=gen, dtype=torch.float64).float() * 3
    targets = torch.randint(0, 300, (37,), generator=gen)
    lp, ent = local_log_probs(logits, targets, temperature=temperature, with_entropy=True)
    ref_lp, ref_ent = vocab_parallel_log_probs(logits / temperature, targets, with_entropy=True)
    torch.testing.assert_close(lp, ref_lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent, ref_ent, atol=1e-5, rtol=0)
    # bf16 logits: the softmax runs in fp32 on the bf16 values, as the fp32 path does on their upcast
    lp16, _ = local_log_probs(logits.bfloat16(), targets)
    ref16, _ = vocab_parallel_log_probs(logits.bfloat16().float(), targets)
    assert lp16.dtype == torch.float32
    torch.testing.assert_close(lp16, ref16, atol=1e-5, rtol=0)


def rope_at_positions(t: torch.Tensor, freqs: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """RoPE of ``t [T, heads, dim]`` at ``position [T]`` from megatron's ``freqs [max_len, 1, 1, dim]`` table.

    The same arithmetic as megatron's ``_apply_rotary_pos_emb_bshd`` (non-interleaved, ``mscale`` 1, full rotary
    dim): ``t * cos + rotate_half(t) * sin`` with cos/sin cast to ``t``'s dtype.
    """
    f = freqs[position].reshape(t.size(0), 1, t.size(-1))
    cos, sin = f.cos().to(t.dtype), f.sin().to(t.dtype)
    x1, x2 = torch.chunk(t, 2, dim=-1)
    return t * cos + torch.cat((-x2, x1), dim=-1) * sin


def test_entropy_without_grad_is_a_metric_only(dist_env):
    logits = torch.randn(5, 40, requires_grad=True)
    _, ent = local_log_probs(logits, torch.zeros(5, dtype=torch.long), with_entropy=True, entropy_grad=False)
    assert not ent.requires_grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_rope_arithmetic_equals_megatron(dtype):
    from megatron.core.models.common.embeddings import rope_utils

    gen = torch.Generator().manual_seed(1)
    t = torch.randn(23, 3, 16, generator=gen).to(dtype)
    inv = 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16))
    angles = torch.outer(torch.arange(64).float(), inv)
    freqs = torch.cat([angles, angles], dim=-1)[:, None, None, :]  # megatron's [max_len, 1, 1, dim] table
    position = torch.tensor([0, 1, 2, 3, 4, 0, 1, 2, *range(15)])
    ref = rope_utils._apply_rotary_pos_emb_bshd(t.unsqueeze(1), freqs[position]).squeeze(1)
    out = rope_at_positions(t, freqs, position)
    assert out.dtype == dtype
    torch.testing.assert_close(out, ref, atol=0, rtol=0)
    # the positions the patch computes from cu_seqlens: each restarts at its sequence's start
    torch.testing.assert_close(fused.positions(torch.tensor([0, 5, 8, 23], dtype=torch.int32), 23, t.device), position)


def test_keeping_lm_head_logits_gives_the_same_step(dist_env, qwen2_dir, rl_batch):
    """--no-recompute-lm-head keeps each LM-head chunk's logits: the head runs once per chunk, not again in
    backward, and the step is the same."""
    cfg = dict(hf_checkpoint=str(qwen2_dir), lr=1.0, adam_eps=1.0, clip_grad=0.0, log_probs_chunk_size=5)
    a, b = Actor(ActorConfig(**cfg)), Actor(ActorConfig(**cfg, recompute_lm_head=False))
    batch = rl_batch(a, SEQS)
    calls = {"a": 0, "b": 0}
    a.model.output_layer.register_forward_hook(lambda *_: calls.__setitem__("a", calls["a"] + 1))
    b.model.output_layer.register_forward_hook(lambda *_: calls.__setitem__("b", calls["b"] + 1))
    ma, mb = a.train_step([batch]), b.train_step([batch])
    chunks = -(-batch.num_tokens // 5)
    assert calls == {"a": 2 * chunks, "b": chunks}, calls
    assert ma["train/grad_norm"] == pytest.approx(mb["train/grad_norm"], rel=1e-6)
    for (name, pa), pb in zip(a.model.named_parameters(), b.model.parameters(), strict=True):
        torch.testing.assert_close(pa, pb, atol=1e-6, rtol=0, msg=name)


def test_reused_export_buffers_are_refilled(dist_env, qwen2_dir, rl_batch):
    actor = Actor(ActorConfig(hf_checkpoint=str(qwen2_dir), lr=1e-2, params_dtype="bfloat16", fp32_main_params=True))
    first = [
        (b.flat.data_ptr(), b.flat.clone()) for b in actor.hf_tensor_buckets(bucket_bytes=2**16, reuse_buffers=True)
    ]
    actor.train_step([rl_batch(actor, SEQS)])
    second = list(actor.hf_tensor_buckets(bucket_bytes=2**16, reuse_buffers=True))
    assert [b.flat.data_ptr() for b in second] == [p for p, _ in first]  # the same buffers, refilled
    assert any(not torch.equal(b.flat, old_flat) for b, (_, old_flat) in zip(second, first, strict=True))
    exported = dict(actor.named_hf_tensors())
    for bucket in second:
        for name, tensor in bucket:
            assert torch.equal(tensor, exported[name].to(torch.bfloat16)), name


def _rope_inputs(dtype, tokens=23, heads=3, dim=16):
    gen = torch.Generator().manual_seed(2)
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    angles = torch.outer(torch.arange(64).float(), inv)
    freqs = torch.cat([angles, angles], dim=-1)[:, None, None, :]
    return torch.randn(tokens, heads, dim, generator=gen).to(dtype), freqs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_table_equals_rope_at_positions(dtype):
    from tidal.actor import fused

    t, freqs = _rope_inputs(dtype)
    cu = torch.tensor([0, 5, 8, 23], dtype=torch.int32)
    position = fused.positions(cu, 23, t.device)
    out = fused.rope_with_table(t, *fused.rope_table(freqs, position))
    # fp32 arithmetic on an fp32 table, rounded once: megatron's rotation of the upcast input
    assert out.dtype == dtype
    torch.testing.assert_close(out, rope_at_positions(t.float(), freqs, position).to(dtype), atol=0, rtol=0)
    # built once per (freqs, cu_seqlens) pair: every layer of a forward reuses it, a new micro-batch rebuilds it
    tables = fused.RopeTables()
    first = tables.get(freqs, cu, 23)
    assert first[0].dtype == torch.float32
    assert tables.get(freqs, cu, 23) is first
    assert fused.RopeTables().get(freqs, cu, 23) is not first  # another model's cache
    again = tables.get(freqs, cu.clone(), 23)
    assert again is not first
    torch.testing.assert_close(again, first, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_rope_qkv_equals_megatron_split_and_rope(dtype):
    from megatron.core.models.common.embeddings import rope_utils
    from tidal.actor import fused

    groups, per_group, dim, tokens = 2, 3, 16, 23
    gen = torch.Generator().manual_seed(3)
    mixed = torch.randn(tokens, groups, (per_group + 2) * dim, generator=gen).to(dtype).requires_grad_()
    _, freqs = _rope_inputs(dtype, tokens, dim=dim)
    position = fused.positions(torch.tensor([0, 9, 23], dtype=torch.int32), tokens, mixed.device)
    bias = torch.randn(groups * (per_group + 2) * dim, generator=gen).to(dtype).requires_grad_()
    q, k, v = fused.split_rope_qkv(mixed, bias, *fused.rope_table(freqs, position), per_group)
    # megatron: add the bias ([T, 1, hp] + [hp]), split the interleaved projection, reshape q, rotate q and k
    biased = (mixed.reshape(tokens, 1, -1) + bias).view(tokens, groups, -1)
    rq, rk, rv = torch.split(biased, [per_group * dim, dim, dim], dim=-1)
    rq = rq.reshape(tokens, groups * per_group, dim)
    # megatron's rotation of the upcast values, rounded once (fused.rope_with_table's arithmetic)
    rope = lambda x: rope_utils._apply_rotary_pos_emb_bshd(x.float().unsqueeze(1), freqs[position]).squeeze(1).to(dtype)  # noqa: E731
    for out, ref in ((q, rope(rq)), (k, rope(rk)), (v, rv)):
        assert out.is_contiguous()
        torch.testing.assert_close(out, ref, atol=0, rtol=0)
    grads = [torch.randn(x.shape, generator=gen).to(dtype) for x in (q, k, v)]
    g_fused = torch.autograd.grad((q, k, v), (mixed, bias), grads)
    g_ref = torch.autograd.grad((rope(rq), rope(rk), rv), (mixed, bias), grads)
    torch.testing.assert_close(g_fused, g_ref, atol=0, rtol=0)
    assert fused.split_rope_qkv(mixed, None, *fused.rope_table(freqs, position), per_group)[2].equal(
        torch.split(mixed, [per_group * dim, dim, dim], dim=-1)[2]
    )


@pytest.mark.parametrize("model", ["qwen2_dir", "qwen3_dir"])  # qwen3: q/k RMSNorm inside the fused pass
def test_packed_self_attention_equals_megatron_self_attention(dist_env, model, request, monkeypatch, rl_batch):
    from megatron.core.transformer.attention import SelfAttention
    from tidal.actor import fused

    calls = []
    split = fused.split_rope_qkv
    monkeypatch.setattr(fused, "split_rope_qkv", lambda *a: calls.append(a[-1]) or split(*a))
    cfg = dict(hf_checkpoint=str(request.getfixturevalue(model)), lr=1.0, adam_eps=1.0, clip_grad=0.0)
    a, b = Actor(ActorConfig(**cfg)), Actor(ActorConfig(**cfg))
    layers = [m for m in b.model.modules() if isinstance(m, fused.PackedSelfAttention)]
    assert len(layers) == sum(isinstance(m, fused.PackedSelfAttention) for m in a.model.modules()) > 0
    for m in layers:
        m.__class__ = SelfAttention  # megatron's own split + per-layer RoPE (compat patch 5)
    plain = pack(SEQS)
    lp_a, lp_b = a.compute_log_probs(plain), b.compute_log_probs(plain)
    assert len(calls) == len(layers)  # the fused path ran once per layer in a, never in b
    assert all((qk_norm is not None) == (model == "qwen3_dir") for qk_norm in calls)
    torch.testing.assert_close(lp_a, lp_b, atol=1e-6, rtol=0)
    batch = rl_batch(a, SEQS)
    ma, mb = a.train_step([batch]), b.train_step([batch])
    assert ma["train/grad_norm"] == pytest.approx(mb["train/grad_norm"], rel=1e-6)
    for (name, pa), pb in zip(a.model.named_parameters(), b.model.parameters(), strict=True):
        torch.testing.assert_close(pa, pb, atol=1e-6, rtol=0, msg=name)
