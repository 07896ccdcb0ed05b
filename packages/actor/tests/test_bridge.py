import json

import pytest
import torch
from megatron.core.packed_seq_params import PackedSeqParams
from safetensors.torch import load_file, save_file
from tidal.actor.bridge import build_gpt_model, load_hf_weights, named_hf_tensors
from tidal.actor.hf_config import parse_hf_config, read_hf_config, to_transformer_config
from tidal.batching import pack

# fp32 on CPU; observed max |diff| is ~1e-6 (often exactly 0), so 1e-4 catches any layout error.
ATOL = 1e-4
SEQS = [[5, 17, 99, 3, 42, 7, 64], [1, 2, 3], [120, 0, 33, 33, 8, 90, 12, 101, 4, 56, 77]]


def build(hf_dir):
    spec = read_hf_config(hf_dir)
    model = build_gpt_model(spec, to_transformer_config(spec, use_cpu_initialization=True))
    load_hf_weights(model, spec, hf_dir)
    return spec, model.eval()


def packed_logits(model, seqs):
    batch = pack(seqs)
    cu = batch.cu_seqlens.to(torch.int32)
    params = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        max_seqlen_q=batch.max_seqlen,
        max_seqlen_kv=batch.max_seqlen,
    )
    with torch.no_grad():
        logits = model(batch.tokens[None], batch.position_ids[None], None, packed_seq_params=params)[0]
    return [logits[s:e] for s, e in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)]


@pytest.mark.parametrize("fixture", ["qwen2_dir", "qwen2_tied_dir", "qwen3_dir"])
def test_logits_match_transformers(dist_env, hf_reference, request, fixture):
    hf_dir = request.getfixturevalue(fixture)
    _, model = build(hf_dir)
    ref_logits, _ = hf_reference(hf_dir, SEQS)
    for ours, ref in zip(packed_logits(model, SEQS), ref_logits, strict=True):
        assert ours.shape == ref.shape
        torch.testing.assert_close(ours, ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("fixture", ["qwen2_dir", "qwen2_tied_dir", "qwen3_dir"])
def test_export_round_trips_hf_tensors(dist_env, request, fixture):
    hf_dir = request.getfixturevalue(fixture)
    spec, model = build(hf_dir)
    original = load_file(hf_dir / "model.safetensors")
    exported = dict(named_hf_tensors(model, spec))
    assert set(exported) == set(original) - ({"lm_head.weight"} if spec.tie_word_embeddings else set())
    for name, tensor in exported.items():
        assert torch.equal(tensor, original[name]), name


def test_unsupported_model_type_names_it():
    with pytest.raises(ValueError, match="'mixtral'"):
        parse_hf_config({"model_type": "mixtral"})


def test_tp_divisibility_error_names_flag(qwen2_dir):
    with pytest.raises(ValueError, match="num_key_value_heads=2 is not divisible by --tensor-model-parallel-size 4"):
        to_transformer_config(read_hf_config(qwen2_dir), tensor_model_parallel_size=4)


def _broken_copy(src, dst, mutate):
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    tensors = load_file(src / "model.safetensors")
    mutate(tensors)
    save_file(tensors, dst / "model.safetensors")
    return dst


def test_missing_tensor_is_named(dist_env, qwen2_dir, tmp_path):
    bad = _broken_copy(qwen2_dir, tmp_path / "bad", lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    spec = read_hf_config(bad)
    model = build_gpt_model(spec, to_transformer_config(spec, use_cpu_initialization=True))
    with pytest.raises(ValueError, match=r"missing tensors \['model.layers.1.mlp.up_proj.weight'\]"):
        load_hf_weights(model, spec, bad)


def test_extra_tensor_is_named(dist_env, qwen2_dir, tmp_path):
    bad = _broken_copy(qwen2_dir, tmp_path / "bad", lambda t: t.update({"model.layers.7.foo": torch.zeros(2)}))
    spec = read_hf_config(bad)
    model = build_gpt_model(spec, to_transformer_config(spec, use_cpu_initialization=True))
    with pytest.raises(ValueError, match=r"unexpected tensors \['model.layers.7.foo'\]"):
        load_hf_weights(model, spec, bad)


def test_wrong_shape_is_named(dist_env, qwen2_dir, tmp_path):
    def shrink(t):
        t["model.layers.0.self_attn.k_proj.weight"] = t["model.layers.0.self_attn.k_proj.weight"][:16].clone()

    bad = _broken_copy(qwen2_dir, tmp_path / "bad", shrink)
    spec = read_hf_config(bad)
    model = build_gpt_model(spec, to_transformer_config(spec, use_cpu_initialization=True))
    with pytest.raises(
        ValueError, match=r"model.layers.0.self_attn.k_proj.weight has shape \(16, 64\), expected \(32, 64\)"
    ):
        load_hf_weights(model, spec, bad)


def test_config_reads_qwen2_facts(qwen2_dir):
    spec = read_hf_config(qwen2_dir)
    raw = json.loads((qwen2_dir / "config.json").read_text())
    assert spec.model_type == "qwen2" and spec.qkv_bias and not spec.qk_norm
    assert spec.head_dim == raw["hidden_size"] // raw["num_attention_heads"]
    assert spec.num_key_value_heads == 2


def test_fused_kernels_is_each_models_own_setting(dist_env, qwen3_dir, monkeypatch):
    """Two models in one process keep their own ``fused_kernels`` and RoPE table cache; megatron's RoPE (compat
    patch 5) sees a layer only while that layer runs."""
    from megatron.core.transformer.attention import SelfAttention
    from tidal.actor import fused

    spec = read_hf_config(qwen3_dir)
    # megatron's own attention forward and its THD RoPE (compat patch 5), the path of layers the fused pass declines
    monkeypatch.setattr(fused.PackedSelfAttention, "_fusable", lambda self, *a: False)
    config = to_transformer_config(spec, use_cpu_initialization=True)
    on, off = build_gpt_model(spec, config, fused_kernels=True), build_gpt_model(spec, config)
    kinds = (fused.PackedSelfAttention, fused.FusedSwiGLUMLP, fused.FusedRMSNorm)

    def flags(model):
        return {(type(m).__name__, m.fused_kernels) for m in model.modules() if isinstance(m, kinds)}

    names = ("PackedSelfAttention", "FusedSwiGLUMLP", "FusedRMSNorm")
    assert flags(on) == {(name, True) for name in names} and flags(off) == {(name, False) for name in names}
    tables = [
        {id(m.rope_tables) for m in model.modules() if isinstance(m, fused.PackedSelfAttention)} for model in (on, off)
    ]
    assert all(len(t) == 1 for t in tables) and tables[0] != tables[1]  # one cache per model
    seen = []
    forward = SelfAttention.forward

    def recording(self, *args, **kwargs):
        running = fused.RUNNING_ATTENTION.get()
        seen.append((running is self, running.fused_kernels))
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(SelfAttention, "forward", recording)
    packed_logits(on.eval(), SEQS)
    packed_logits(off.eval(), SEQS)
    assert seen == [(True, True)] * spec.num_layers + [(True, False)] * spec.num_layers
    assert fused.RUNNING_ATTENTION.get() is None
    fused.set_fused_kernels(on, False)
    assert flags(on) == {(name, False) for name in names}
