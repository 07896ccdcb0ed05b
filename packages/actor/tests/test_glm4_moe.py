"""GLM-4.5 (glm4_moe) in the actor: config mapping, refusals, fp32 parity with transformers (logits, long packed
log-probs, gradients, with grouped biased sigmoid routing, a routed scaling factor, a shared expert, a dense first
layer, partial RoPE, q/k norm and attention bias), the export round trip and the weight-sync buckets."""

import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tidal.actor import Actor, ActorConfig
from tidal.actor.bridge import named_hf_tensors
from tidal.actor.hf_config import parse_hf_config, to_transformer_config
from tidal.batching import pack

sys.path.insert(0, str(Path(__file__).parent))
try:
    from moe_models import TINY_GLM, hf_log_probs, save_tiny_glm
    from test_moe import _build, _hf_named_grads, _packed_logits
finally:
    sys.path.pop(0)


@pytest.fixture(scope="module")
def glm_dir(tmp_path_factory) -> Path:
    return save_tiny_glm(tmp_path_factory.mktemp("glm"))


def _config(**overrides) -> dict:
    return {"model_type": "glm4_moe", "architectures": ["Glm4MoeForCausalLM"], **TINY_GLM, **overrides}


def test_config_maps_routing_shared_expert_dense_layers_and_partial_rope():
    spec = parse_hf_config(_config())
    assert spec.moe.layers == (False, True, True) and spec.rotary_dim == 8 and spec.qk_norm and spec.qkv_bias
    cfg = to_transformer_config(spec)
    assert cfg.moe_router_score_function == "sigmoid" and cfg.moe_router_enable_expert_bias
    assert cfg.moe_router_bias_update_rate == 0.0  # frozen
    assert (cfg.moe_router_num_groups, cfg.moe_router_group_topk, cfg.moe_router_topk) == (2, 1, 2)
    assert cfg.moe_router_topk_scaling_factor == 2.5 and cfg.moe_shared_expert_intermediate_size == 32
    assert cfg.moe_layer_freq == [0, 1, 1] and cfg.add_qkv_bias and cfg.qk_layernorm
    plain = parse_hf_config(_config(n_group=1, topk_group=1, routed_scaling_factor=1.0, use_qk_norm=False))
    assert plain.moe.num_groups is None and plain.moe.scaling_factor is None and not plain.qk_norm


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"norm_topk_prob": False}, r"norm_topk_prob=False, num_experts_per_tok=2: megatron-core's sigmoid router"),
        ({"num_experts_per_tok": 4, "topk_group": 1}, r"HF scores a group by its 2 best experts"),
        ({"n_group": 3}, r"n_group must divide n_routed_experts"),
        ({"n_shared_experts": 0}, r"n_shared_experts=0"),
        ({"partial_rotary_factor": 0.3}, r"partial_rotary_factor=0.3 of head_dim 16 must rotate an even number"),
    ],
)
def test_settings_megatron_computes_differently_are_refused_by_name(overrides, match):
    with pytest.raises(ValueError, match=match):
        parse_hf_config(_config(**overrides) | {"rope_parameters": {"partial_rotary_factor": overrides.get(
            "partial_rotary_factor", 0.5), "rope_theta": 1e6, "rope_type": "default"}})  # fmt: skip


def test_long_packed_log_probs_and_weight_sync_match_transformers_fp32(dist_env, glm_dir):
    """fp32 log-probs of a 700-token sequence packed beside a short one, to 1e-5; the sync buckets equal the export."""

    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 128, (n,), generator=gen).tolist() for n in (700, 37)]
    ref = hf_log_probs(glm_dir, seqs)
    actor = Actor(ActorConfig(hf_checkpoint=str(glm_dir)))
    ours = actor.compute_log_probs(pack(seqs))[: sum(map(len, seqs))]
    diff = (ours - ref).abs()
    assert diff.max() < 1e-5, float(diff.max())
    exported = dict(actor.named_hf_tensors())
    buckets = [(n, t) for b in actor.hf_tensor_buckets(dtype=torch.float32, bucket_bytes=2**14) for n, t in b]
    assert [n for n, _ in buckets] == list(exported)
    assert all(torch.equal(t, exported[n]) for n, t in buckets)
    # in bf16 the biases stay float32, in a last bucket of their own: the engine routes with the actor's bias
    bf16 = [b for b in actor.hf_tensor_buckets(dtype=torch.bfloat16, bucket_bytes=2**14)]
    assert sorted(n for b in bf16 for n, _ in b) == sorted(exported)
    assert [n for n, _ in bf16[-1]] == [n for n in exported if n.endswith("e_score_correction_bias")]
    assert bf16[-1].flat.dtype == torch.float32 and all(b.flat.dtype == torch.bfloat16 for b in bf16[:-1])
    assert all(torch.equal(t, exported[n]) for n, t in bf16[-1])


def test_logits_gradients_and_export_match_transformers(dist_env, glm_dir):
    """fp32 logits and every parameter's gradient of a weighted log-prob loss equal transformers'; the bias is a
    buffer (no gradient); the export gives every HF tensor back bit-exact, the bias in float32."""
    from transformers import AutoModelForCausalLM

    gen = torch.Generator().manual_seed(5)
    seqs = [torch.randint(0, 128, (n,), generator=gen).tolist() for n in (61, 5, 40)]
    weights = [torch.linspace(-1.0, 1.0, len(s) - 1) for s in seqs]
    hf = AutoModelForCausalLM.from_pretrained(glm_dir, dtype=torch.float32)
    hf.train()
    ref_logits = []
    for seq, w in zip(seqs, weights, strict=True):
        ids = torch.tensor([seq])
        ref_logits.append(hf(ids).logits[0])
        lp = torch.log_softmax(ref_logits[-1], -1)[:-1].gather(-1, ids[0, 1:, None]).squeeze(-1)
        (lp * w).sum().backward()
    want = _hf_named_grads(hf)

    spec, model = _build(glm_dir)
    model.train()
    loss = torch.zeros(())
    for logits, ref, seq, w in zip(_packed_logits(model, seqs), ref_logits, seqs, weights, strict=True):
        torch.testing.assert_close(logits, ref.detach(), atol=1e-5, rtol=0)
        ids = torch.tensor(seq)
        lp = torch.log_softmax(logits, -1)[:-1].gather(-1, ids[1:, None]).squeeze(-1)
        loss = loss + (lp * w).sum()
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    got = {n: g for n, g in named_hf_tensors(model, spec, params=grads) if not n.endswith("correction_bias")}
    assert set(got) == set(want)
    for name, g in got.items():
        ref = want[name]
        torch.testing.assert_close(g, ref, atol=1e-6 + 1e-5 * float(ref.abs().max()), rtol=1e-5, msg=name)
    assert not any(n.endswith("expert_bias") for n, _ in model.named_parameters())
    original = load_file(glm_dir / "model.safetensors")
    exported = dict(named_hf_tensors(model, spec))
    assert set(exported) == set(original)
    assert all(torch.equal(t, original[n]) for n, t in exported.items())
    bias = "model.layers.2.mlp.gate.e_score_correction_bias"
    assert exported[bias].dtype == torch.float32 and exported[bias].abs().min() > 0


def test_memory_plan_shape_counts_the_shared_expert_and_dense_layers(dist_env, glm_dir):
    from tidal.actor.memory_plan import MemoryInputs, ModelShape, plan_memory
    from tidal.ckpt import read_hf_config_json
    from transformers import AutoModelForCausalLM

    shape = ModelShape.from_hf_config(read_hf_config_json(glm_dir))
    assert (shape.num_moe_layers, shape.num_experts, shape.shared_ffn_hidden_size) == (2, 8, 32) and shape.qk_norm
    hf = AutoModelForCausalLM.from_pretrained(glm_dir)
    assert shape.num_params() == sum(p.numel() for p in hf.parameters())
    actor = Actor(ActorConfig(hf_checkpoint=str(glm_dir), lr=1e-3))
    inputs = MemoryInputs.from_actor_config(actor.cfg, train_tokens=256, logprob_tokens=256, longest_sequence=64)
    rows = dict(plan_memory(shape, inputs).rows)
    assert rows["parameters (float32)"] == sum(p.numel() * p.element_size() for p in actor.params)
