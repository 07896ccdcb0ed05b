"""RoPE scaling (llama3, linear, dynamic): logits equal transformers' LlamaForCausalLM on the same weights."""

import json

import pytest
import torch
from megatron.core.packed_seq_params import PackedSeqParams
from tidal.actor.bridge import build_gpt_model, load_hf_weights
from tidal.actor.hf_config import parse_hf_config, read_hf_config, to_transformer_config
from tidal.actor.rope_scaling import RopeScaling, parse_rope_scaling, rope_inv_freq
from tidal.batching import pack
from transformers import LlamaConfig, LlamaForCausalLM

# head_dim 16, theta 1e4: wavelengths 6.3 ... 19869, so with original_max_position_embeddings=64 the llama3
# rule keeps some frequencies, smooths some and divides the rest by `factor`.
LLAMA3 = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
ROPES = {
    "llama3": LLAMA3,
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
}
SEQS = [list(range(3, 43)), [7, 1, 99, 23, 5, 64, 2, 8, 100, 31, 4, 77, 12, 90, 45, 3, 18, 66, 120, 11, 9, 55]]


def save_llama(out_dir, rope_parameters):
    torch.manual_seed(4)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rope_parameters=dict(rope_parameters),
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.1)
            if "norm" in name:
                p.add_(1.0)
    model.save_pretrained(out_dir)
    return out_dir


def packed_logits(hf_dir, seqs):
    spec = read_hf_config(hf_dir)
    model = build_gpt_model(spec, to_transformer_config(spec, use_cpu_initialization=True))
    load_hf_weights(model, spec, hf_dir)
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
        logits = model.eval()(batch.tokens[None], batch.position_ids[None], None, packed_seq_params=params)[0]
    return [logits[s:e] for s, e in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)]


@pytest.mark.parametrize("rope", sorted(ROPES))
def test_scaled_rope_logits_match_transformers(dist_env, tmp_path, hf_reference, rope):
    hf_dir = save_llama(tmp_path / rope, ROPES[rope])
    saved = json.loads((hf_dir / "config.json").read_text())
    assert read_hf_config(hf_dir).rope_scaling.rope_type == rope, saved
    ref_logits, _ = hf_reference(hf_dir, SEQS)
    ours = packed_logits(hf_dir, SEQS)
    for mine, theirs in zip(ours, ref_logits, strict=True):
        torch.testing.assert_close(mine, theirs, atol=1e-4, rtol=0)
    if rope != "dynamic":  # dynamic equals default RoPE within max_position_embeddings
        (tmp_path / "plain").mkdir()
        plain = {k: v for k, v in saved.items() if k not in ("rope_parameters", "rope_scaling")}
        (tmp_path / "plain" / "config.json").write_text(json.dumps(plain | {"rope_theta": 10000.0}))
        (tmp_path / "plain" / "model.safetensors").symlink_to(hf_dir / "model.safetensors")
        unscaled = packed_logits(tmp_path / "plain", SEQS)
        assert (unscaled[0] - ours[0]).abs().max() > 1e-2  # the scaling changed the model


def test_llama3_inv_freq_covers_all_three_bands():
    scaling = parse_rope_scaling({"rope_parameters": LLAMA3})
    assert scaling == RopeScaling(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64
    )
    plain, scaled = rope_inv_freq(16, 1e4, None), rope_inv_freq(16, 1e4, scaling)
    ratio = (plain / scaled).tolist()
    assert ratio[0] == 1.0 and ratio[-1] == pytest.approx(8.0)
    assert any(1.0 < r < 8.0 for r in ratio)  # smoothed band


def test_old_style_rope_scaling_key_is_read():
    scaling = parse_rope_scaling({"rope_scaling": {"type": "linear", "factor": 2.0}, "rope_theta": 5e5})
    assert scaling == RopeScaling(rope_type="linear", factor=2.0)
    assert parse_rope_scaling({"rope_theta": 5e5}) is None
    assert parse_rope_scaling({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}) is None


@pytest.mark.parametrize("rope_type", ["yarn", "longrope"])
def test_unsupported_rope_type_is_named(rope_type):
    cfg = {
        "model_type": "llama",
        "vocab_size": 128,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "rope_parameters": {"rope_type": rope_type, "factor": 4.0, "rope_theta": 1e4},
    }
    with pytest.raises(ValueError, match=f"rope_type '{rope_type}' is not supported"):
        parse_hf_config(cfg)


def test_llama3_without_its_parameters_is_refused():
    with pytest.raises(ValueError, match="low_freq_factor"):
        parse_rope_scaling({"rope_parameters": {"rope_type": "llama3", "factor": 8.0}})


def test_dynamic_beyond_max_position_embeddings_is_refused(dist_env, tmp_path):
    hf_dir = save_llama(tmp_path / "dyn", ROPES["dynamic"])
    with pytest.raises(ValueError, match="rope_type 'dynamic' is supported up to max_position_embeddings=256"):
        packed_logits(hf_dir, [list(range(100)) * 3])
