"""Qwen3-MoE in the actor: config mapping, refusals, parity with transformers (fp32 logits, log-probs to 4k
positions, gradients) and the export round trip."""

import sys
from pathlib import Path

import pytest
import torch
from megatron.core.packed_seq_params import PackedSeqParams
from safetensors.torch import load_file
from tidal.actor import Actor, ActorConfig
from tidal.actor.bridge import build_gpt_model, load_hf_weights, named_hf_tensors
from tidal.actor.hf_config import parse_hf_config, read_hf_config, to_transformer_config
from tidal.actor.megatron_holds import drop_dispatch_graphs
from tidal.batching import pack

sys.path.insert(0, str(Path(__file__).parent))
try:
    from moe_models import TINY_MOE, hf_log_probs, save_tiny_moe
finally:
    sys.path.pop(0)

SEQS = [[5, 17, 99, 3, 42, 7, 64], [1, 2, 3], [120, 0, 33, 33, 8, 90, 12, 101, 4, 56, 77]]


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> Path:
    """norm_topk_prob true, layer 1 dense (mlp_only_layers)."""
    return save_tiny_moe(tmp_path_factory.mktemp("moe"), norm_topk_prob=True, mlp_only_layers=[1])


@pytest.fixture(scope="module")
def moe_plain_dir(tmp_path_factory) -> Path:
    """norm_topk_prob false (softmax over all experts, top-k not renormalised), every layer MoE."""
    return save_tiny_moe(tmp_path_factory.mktemp("moe_plain"), seed=1, norm_topk_prob=False)


def _config(**overrides) -> dict:
    return {"model_type": "qwen3_moe", **TINY_MOE, "num_experts": 8, **overrides}


def test_config_maps_router_and_layer_pattern():
    raw = _config(num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=[3], norm_topk_prob=True)
    spec = parse_hf_config(raw)
    assert spec.moe.layers == (False, True, False, False, False, True)  # every 2nd layer, minus layer 3
    assert spec.qk_norm and spec.head_dim == 16 and spec.num_key_value_heads == 2
    cfg = to_transformer_config(spec, expert_model_parallel_size=2, moe_aux_loss_coeff=0.01)
    assert cfg.moe_layer_freq == [0, 1, 0, 0, 0, 1] and cfg.num_moe_experts == 8 and cfg.moe_router_topk == 2
    assert cfg.moe_ffn_hidden_size == 32 and cfg.ffn_hidden_size == 96  # experts' and the dense layers' sizes
    assert not cfg.moe_router_pre_softmax  # renormalised top-k = softmax over the top-k logits
    assert cfg.expert_model_parallel_size == 2 and cfg.moe_router_load_balancing_type == "aux_loss"
    assert cfg.moe_aux_loss_coeff == 0.01 and cfg.moe_router_dtype == "fp32"
    assert cfg.moe_expert_capacity_factor is None  # dropless, as transformers
    plain = to_transformer_config(parse_hf_config(_config(norm_topk_prob=False)))
    assert plain.moe_router_pre_softmax and plain.moe_router_load_balancing_type == "none"
    # the checkpoint's transformers-5 spelling of the expert count too
    assert parse_hf_config(_config(num_experts=None, num_local_experts=4, num_experts_per_tok=1)).moe.num_experts == 4


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"model_type": "mixtral"}, r"model_type 'mixtral' is a mixture-of-experts architecture .* qwen3_moe"),
        ({"model_type": "qwen2_moe"}, r"model_type 'qwen2_moe' is a mixture-of-experts"),
        ({"shared_expert_intermediate_size": 64}, "shared_expert_intermediate_size=64 .* shared experts"),
        ({"n_group": 4, "topk_group": 2}, "n_group=4 .* grouped top-k"),
        ({"scoring_func": "sigmoid"}, "scoring_func='sigmoid' .* softmax router"),
        ({"routed_scaling_factor": 2.5}, "routed_scaling_factor=2.5"),
        ({"num_experts_per_tok": 9}, "num_experts_per_tok=9"),
    ],
)
def test_unsupported_moe_variants_are_refused_by_name(overrides, match):
    with pytest.raises(ValueError, match=match):
        parse_hf_config(_config(**overrides))


def test_parallel_sizes_are_checked_against_the_experts():
    spec = parse_hf_config(_config())
    with pytest.raises(ValueError, match="num_experts=8 is not divisible by --expert-model-parallel-size 3"):
        to_transformer_config(spec, expert_model_parallel_size=3)
    with pytest.raises(ValueError, match="--tensor-model-parallel-size 2 with a mixture-of-experts model"):
        to_transformer_config(spec, tensor_model_parallel_size=2)
    with pytest.raises(ValueError, match="--context-parallel-size 2 with a mixture-of-experts model"):
        to_transformer_config(spec, context_parallel_size=2)
    with pytest.raises(ValueError, match="--moe-router-dtype must be one of"):
        to_transformer_config(spec, moe_router_dtype="bf16")
    dense = parse_hf_config({**_config(), "model_type": "qwen3"})
    with pytest.raises(ValueError, match="--expert-model-parallel-size 2 needs a mixture-of-experts model"):
        to_transformer_config(dense, expert_model_parallel_size=2)


def _build(hf_dir):
    spec = read_hf_config(hf_dir)
    model = build_gpt_model(spec, to_transformer_config(spec, use_cpu_initialization=True))
    load_hf_weights(model, spec, hf_dir)
    return spec, model


def _packed_logits(model, seqs):
    batch = pack(seqs)
    cu = batch.cu_seqlens.to(torch.int32)
    longest = batch.max_seqlen
    params = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest, max_seqlen_kv=longest
    )
    logits = model(batch.tokens[None], batch.position_ids[None], None, packed_seq_params=params)[0]
    return [logits[s:e] for s, e in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)]


@pytest.mark.parametrize("fixture", ["moe_dir", "moe_plain_dir"])
def test_logits_and_export_match_transformers(dist_env, hf_reference, request, fixture):
    hf_dir = request.getfixturevalue(fixture)
    spec, model = _build(hf_dir)
    ref_logits, _ = hf_reference(hf_dir, SEQS)
    with torch.no_grad():
        ours = _packed_logits(model.eval(), SEQS)
    for got, ref in zip(ours, ref_logits, strict=True):
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
    # export: every HF tensor back under its HF name (per-expert gate/up/down, the router as mlp.gate), bit-exact
    original = load_file(hf_dir / "model.safetensors")
    exported = dict(named_hf_tensors(model, spec))
    assert set(exported) == set(original)
    assert all(torch.equal(t, original[n]) for n, t in exported.items())
    assert "model.layers.0.mlp.experts.7.down_proj.weight" in exported and "model.layers.0.mlp.gate.weight" in exported


def test_weight_sync_buckets_equal_the_export(dist_env, moe_dir):
    actor = Actor(ActorConfig(hf_checkpoint=str(moe_dir)))
    exported = dict(actor.named_hf_tensors())
    buckets = [(n, t) for b in actor.hf_tensor_buckets(dtype=torch.float32, bucket_bytes=2**14) for n, t in b]
    assert [n for n, _ in buckets] == list(exported)
    assert all(torch.equal(t, exported[n]) for n, t in buckets)


def test_long_packed_log_probs_match_transformers_fp32(dist_env, tmp_path):
    """fp32 log-probs at 4k positions (a 3.9k sequence packed beside a short one, rope_theta 1e6) to 1e-5."""

    path = save_tiny_moe(tmp_path / "long", seed=3, norm_topk_prob=True, mlp_only_layers=[1])
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 128, (n,), generator=gen).tolist() for n in (3900, 37)]
    ref = hf_log_probs(path, seqs)
    ours = Actor(ActorConfig(hf_checkpoint=str(path))).compute_log_probs(pack(seqs))[: sum(map(len, seqs))]
    diff = (ours - ref).abs()
    assert diff.max() < 1e-5, float(diff.max())
    assert diff[3000:3900].max() < 1e-5  # the far positions too


def _hf_named_grads(hf_model) -> dict[str, torch.Tensor]:
    """transformers' gradients under the checkpoint's names (its fused experts split back per expert)."""
    out = {}
    for name, p in hf_model.named_parameters():
        if name.endswith("mlp.experts.gate_up_proj"):
            prefix = name.removesuffix("gate_up_proj")
            for e, g in enumerate(p.grad):
                gate, up = g.chunk(2, dim=0)
                out[f"{prefix}{e}.gate_proj.weight"], out[f"{prefix}{e}.up_proj.weight"] = gate, up
        elif name.endswith("mlp.experts.down_proj"):
            prefix = name.removesuffix("down_proj")
            out |= {f"{prefix}{e}.down_proj.weight": g for e, g in enumerate(p.grad)}
        else:
            out[name] = p.grad
    return out


def test_gradients_match_transformers(dist_env, moe_dir):
    """Every parameter's gradient of a weighted log-prob loss (router and experts included) equals transformers'."""
    from transformers import AutoModelForCausalLM

    gen = torch.Generator().manual_seed(5)
    seqs = [torch.randint(0, 128, (n,), generator=gen).tolist() for n in (61, 5, 40)]
    weights = [torch.linspace(-1.0, 1.0, len(s) - 1) for s in seqs]
    hf = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32)
    hf.train()
    for seq, w in zip(seqs, weights, strict=True):
        ids = torch.tensor([seq])
        lp = torch.log_softmax(hf(ids).logits[0], -1)[:-1].gather(-1, ids[0, 1:, None]).squeeze(-1)
        (lp * w).sum().backward()
    want = _hf_named_grads(hf)

    spec, model = _build(moe_dir)
    model.train()
    loss = torch.zeros(())
    for logits, seq, w in zip(_packed_logits(model, seqs), seqs, weights, strict=True):
        ids = torch.tensor(seq)
        lp = torch.log_softmax(logits, -1)[:-1].gather(-1, ids[1:, None]).squeeze(-1)
        loss = loss + (lp * w).sum()
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    got = dict(named_hf_tensors(model, spec, params=grads))
    assert set(got) == set(want)
    for name, g in got.items():
        ref = want[name]
        assert ref.abs().max() > 0, name  # every expert received tokens: its gradient is tested
        torch.testing.assert_close(g, ref, atol=1e-6 + 1e-5 * float(ref.abs().max()), rtol=1e-5, msg=name)


def test_grouped_gemm_path_equals_the_per_expert_loop(monkeypatch):
    """GroupedExperts' CUDA path (one grouped GEMM per projection) computes what its per-expert loop does; the
    forward runs on the CPU too (torch's CPU grouped_mm has no backward, so the CPU path is the loop)."""
    from megatron.core.transformer.transformer_config import TransformerConfig
    from tidal.actor import moe_experts

    config = TransformerConfig(
        num_layers=1, hidden_size=64, num_attention_heads=4, num_moe_experts=4, moe_ffn_hidden_size=32,
        use_cpu_initialization=True, perform_initialization=False, add_bias_linear=False,
    )  # fmt: skip
    experts = moe_experts.GroupedExperts(4, config)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        experts.weight1.copy_(torch.randn(experts.weight1.shape, generator=gen))
        experts.weight2.copy_(torch.randn(experts.weight2.shape, generator=gen))
    x, probs = torch.randn(19, 64, generator=gen), torch.rand(19, generator=gen)
    counts = torch.tensor([5, 0, 9, 5])  # an expert without tokens too
    with torch.no_grad():
        loop, _ = experts(x, counts, probs)
        monkeypatch.setattr(moe_experts, "grouped_gemm_available", lambda *a: True)
        grouped, _ = experts(x, counts, probs)
    torch.testing.assert_close(grouped, loop, atol=1e-4, rtol=1e-5)
    # the loop is SwiGLU per expert, scaled by the routing probability: expert 2's first token by hand
    w1, w2 = experts.weight1[2], experts.weight2[2]
    gate, up = (w1 @ x[5]).chunk(2)
    torch.testing.assert_close(loop[5], w2 @ (torch.nn.functional.silu(gate) * up * probs[5]), atol=1e-4, rtol=1e-5)


def test_checkpoint_resumes_identically(dist_env, moe_dir, tmp_path, rl_batch):
    """Megatron's distributed checkpoint of an MoE actor (stacked experts, router, AdamW state) resumes exactly."""
    from tidal.ckpt import load_checkpoint, save_checkpoint

    cfg = ActorConfig(hf_checkpoint=str(moe_dir), lr=1e-2, moe_aux_loss_coeff=0.01)
    a = Actor(cfg)
    metrics = a.train_step([rl_batch(a, SEQS)])
    assert metrics["train/moe_load_balancing_loss"] >= 1.0  # 1: perfectly balanced, per MoE layer
    save_checkpoint(tmp_path / "ckpt", 1, a.sharded_state_dict())
    b = Actor(cfg)
    state, _ = load_checkpoint(tmp_path / "ckpt", b.sharded_state_dict())
    b.load_state_dict(state)
    for (name, pa), pb in zip(a.model.named_parameters(), b.model.parameters(), strict=True):
        assert torch.equal(pa, pb), name
    a.train_step([rl_batch(a, SEQS)]), b.train_step([rl_batch(b, SEQS)])
    for (name, pa), pb in zip(a.model.named_parameters(), b.model.parameters(), strict=True):
        assert torch.equal(pa, pb), name


def test_recompute_gives_the_same_step(dist_env, moe_dir, rl_batch):
    """Layer recompute re-runs the router and the all-to-all dispatch in backward: the same step, the same metric."""
    cfg = dict(hf_checkpoint=str(moe_dir), lr=0.1, adam_eps=1.0, clip_grad=0.0, moe_aux_loss_coeff=0.01)
    plain, again = Actor(ActorConfig(**cfg)), Actor(ActorConfig(**cfg, recompute_activations=True))
    m1 = plain.train_step([rl_batch(plain, SEQS)])
    m2 = again.train_step([rl_batch(again, SEQS)])
    for key in ("train/loss", "train/grad_norm", "train/moe_load_balancing_loss"):
        assert m1[key] == pytest.approx(m2[key], rel=1e-6), key
    for (name, a), b in zip(plain.model.named_parameters(), again.model.parameters(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-7, rtol=0, msg=name)
    # the recomputed forward's graph, never back-propagated, is not kept past the step by a token dispatcher
    assert _dispatch_graphs(again) == [] and _dispatch_graphs(plain) == []
    # megatron-core's dispatcher keeps its last routing probabilities with their graph (calling forward directly
    # skips tidal's hook): when this fails, upstream stopped doing so and tidal.actor.megatron_holds can go
    layer = next(m for m in again.model.modules() if getattr(m, "token_dispatcher", None) is not None)
    hidden = torch.randn(5, 1, TINY_MOE["hidden_size"], requires_grad=True)
    layer.forward(hidden)
    assert "probs" in _dispatch_graphs(again), "megatron-core no longer keeps the dispatch's graph"
    assert drop_dispatch_graphs(again.model) >= 1 and _dispatch_graphs(again) == []
    layer(hidden)  # through the hook
    assert _dispatch_graphs(again) == []


def _dispatch_graphs(actor) -> list[str]:
    """Attributes of the actor's MoE token dispatchers that hold a tensor with an autograd graph."""
    return [
        name
        for module in actor.model.modules()
        if (dispatcher := getattr(module, "token_dispatcher", None)) is not None
        for name, value in vars(dispatcher).items()
        if isinstance(value, torch.Tensor) and value.grad_fn is not None
    ]


def test_expert_load_metric_counts_transformers_routing(dist_env, moe_plain_dir, rl_batch):
    """train/moe_expert_load_max: the busiest expert's token share over the even share, from the same routing as
    transformers' router on the step's tokens (the weights before the step)."""
    from transformers import AutoModelForCausalLM

    actor = Actor(ActorConfig(hf_checkpoint=str(moe_plain_dir), lr=1e-2))
    metrics = actor.train_step([rl_batch(actor, SEQS)])
    hf = AutoModelForCausalLM.from_pretrained(moe_plain_dir, dtype=torch.float32).eval()
    counts = torch.zeros(TINY_MOE["num_hidden_layers"], TINY_MOE["num_experts"])
    with torch.no_grad():
        for seq in SEQS:
            logits = hf(torch.tensor([seq]), output_router_logits=True).router_logits
            for layer, router in enumerate(logits):
                top = router.topk(TINY_MOE["num_experts_per_tok"], dim=-1).indices.flatten()
                counts[layer] += torch.bincount(top, minlength=TINY_MOE["num_experts"]).float()
    want = float((counts.max(dim=1).values / counts.mean(dim=1)).mean())
    assert metrics["train/moe_expert_load_max"] == pytest.approx(want, rel=1e-6)
    assert want > 1.0
    assert "train/moe_load_balancing_loss" not in metrics  # no balance loss without --moe-aux-loss-coeff


def test_the_balance_loss_coefficient_scales_its_pull_on_the_routers(dist_env, moe_plain_dir, rl_batch):
    """--moe-aux-loss-coeff c adds c x the balance term's gradient: from the same weights and batch, the routers end
    the step away from where the step without it leaves them, ten times farther at 0.1 than at 0.01 (adam_eps 1
    keeps a first Adam step near-linear in small gradients)."""
    cfg = dict(hf_checkpoint=str(moe_plain_dir), lr=0.1, adam_eps=1.0, clip_grad=0.0)

    def routers_after_a_step(coeff: float) -> tuple[dict, torch.Tensor]:
        actor = Actor(ActorConfig(**cfg, moe_aux_loss_coeff=coeff))
        metrics = actor.train_step([rl_batch(actor, SEQS)])
        routers = [p.detach().flatten() for n, p in actor.model.named_parameters() if ".router." in n]
        assert len(routers) == TINY_MOE["num_hidden_layers"]
        return metrics, torch.cat(routers)

    (m0, r0), (m1, r1), (m2, r2) = (routers_after_a_step(c) for c in (0.0, 0.01, 0.1))
    assert "train/moe_load_balancing_loss" not in m0
    assert m1["train/moe_load_balancing_loss"] == pytest.approx(m2["train/moe_load_balancing_loss"], rel=1e-6)
    near, far = float((r1 - r0).norm()), float((r2 - r0).norm())
    assert near > 0 and far / near == pytest.approx(10.0, rel=0.2), (near, far)
