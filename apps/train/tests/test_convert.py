"""``train convert``: HF -> Megatron torch_dist -> HF is bit-exact at TP 1 and across TP sizes; bad flags fail.

The conversions run in worker processes started by ``convert_main``; this process never initialises
torch.distributed.
"""

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tidal.train.convert import convert_main

TIMEOUT_S = 300


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    """A tiny random Qwen2 (untied, q/k/v biases), weights ~N(0, 0.1) and distinct norms so any mix-up shows."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    model = Qwen2ForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.1).add_(1.0 if "norm" in name else 0.0)
    out = tmp_path_factory.mktemp("hf")
    model.save_pretrained(out)
    return out


def hf_tensors(path: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(path.glob("*.safetensors")):
        tensors |= load_file(file)
    return tensors


def assert_bit_exact(original: Path, converted: Path) -> None:
    a, b = hf_tensors(original), hf_tensors(converted)
    assert sorted(a) == sorted(b)
    for name, tensor in a.items():
        assert b[name].dtype == tensor.dtype, name
        assert torch.equal(b[name], tensor), name
    assert json.loads((converted / "config.json").read_text()) == json.loads((original / "config.json").read_text())
    assert (converted / "generation_config.json").is_file()


def convert_all(argvs: list[list[str]]) -> list[int]:
    """Run conversions side by side (each starts its own worker processes): worker start-up is most of the time."""
    with ThreadPoolExecutor(len(argvs)) as pool:
        return list(pool.map(lambda argv: convert_main(argv, timeout_s=TIMEOUT_S), argvs))


def test_round_trip_is_bit_exact_at_tp1_and_from_tp2_to_tp1(hf_dir, tmp_path):
    tps = (1, 2)
    hf = str(hf_dir)
    to_megatron = [
        ["--hf-checkpoint", hf, "--save", str(tmp_path / f"tp{tp}"), "--tensor-model-parallel-size", str(tp)]
        for tp in tps
    ]
    assert convert_all(to_megatron) == [0, 0]
    for tp in tps:
        assert (tmp_path / f"tp{tp}" / "latest_checkpointed_iteration.txt").read_text().strip() == "0"
        assert (tmp_path / f"tp{tp}" / "iter_0000000" / "metadata.json").is_file()
    # back at TP 1: for the TP 2 checkpoint a resharded load of what two ranks saved
    to_hf = [
        ["--load", str(tmp_path / f"tp{tp}"), "--hf-checkpoint", hf, "--save-hf", str(tmp_path / f"hf{tp}")]
        for tp in tps
    ]
    assert convert_all(to_hf) == [0, 0]
    for tp in tps:
        assert_bit_exact(hf_dir, tmp_path / f"hf{tp}")
    assert not torch.distributed.is_initialized()


def bad_flags(hf_dir: Path, tmp: Path) -> list[tuple[list[str], str]]:
    empty, stale = tmp / "empty", tmp / "stale"
    empty.mkdir()
    (stale / "iter_0000050").mkdir(parents=True)  # an interrupted save: no metadata.json, no tracker
    hf, a, b = str(hf_dir), str(tmp / "a"), str(tmp / "b")
    return [
        (["--hf-checkpoint", hf], "give --save OUT"),
        (["--save", a], "--hf-checkpoint is required"),
        (["--load", a, "--hf-checkpoint", hf], "--save-hf OUT is required with --load"),
        (["--hf-checkpoint", hf, "--save", a, "--save-hf", b], "--save (HF"),
        (["--hf-checkpoint", str(empty), "--save", a], f"--hf-checkpoint {empty} has no config.json"),
        (["--hf-checkpoint", hf, "--save", a, "--tensor-model-parallel-size", "3"], "--tensor-model-parallel-size 3"),
        (["--hf-checkpoint", hf, "--save", a, "--tensor-model-parallel-size", "x"], "invalid int"),
        (["--hf-checkpoint", hf, "--save", a, "--ckpt-step", "3"], "--ckpt-step only applies"),
        (["--hf-checkpoint", hf, "--save", a, "--bogus"], "unknown argument --bogus"),
        (["--load", str(tmp / "nope"), "--hf-checkpoint", hf, "--save-hf", b], "--load"),
        # a bad --load names what it found and the flag to use instead (tidal.ckpt's messages)
        (["--load", hf, "--hf-checkpoint", hf, "--save-hf", b], "Pass it as --hf-checkpoint"),
        (["--load", str(empty), "--hf-checkpoint", hf, "--save-hf", b], f"--load {empty} holds no checkpoint"),
        (["--load", str(stale), "--hf-checkpoint", hf, "--save-hf", b], f"--load {stale} holds no checkpoint"),
        (["--load", str(stale), "--ckpt-step", "50", "--hf-checkpoint", hf, "--save-hf", b], "incomplete"),
    ]


def test_bad_flags_fail_with_one_line_naming_the_flag(hf_dir, tmp_path, capsys):
    for argv, message in bad_flags(hf_dir, tmp_path):
        assert convert_main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert err.startswith("train convert: error: "), err
        assert message in err, (argv, err)
        assert "\n" not in err, err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def _tiny_glm(hf: Path) -> Path:
    """A GLM-4.5 (shared expert, float32 score-correction biases, a dense first layer, grouped routing)."""
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

    torch.manual_seed(2)
    cfg = Glm4MoeConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, n_routed_experts=4, num_experts_per_tok=2,
        n_shared_experts=1, n_group=2, topk_group=1, first_k_dense_replace=1, use_qk_norm=True, attention_bias=True,
    )  # fmt: skip
    model = Glm4MoeForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.1).add_(1.0 if "norm" in name else 0.0)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.3)
    model.save_pretrained(hf)
    return hf


def test_moe_round_trip_is_bit_exact(tmp_path):
    """A Qwen3-MoE (every expert's gate/up/down, the router, a dense layer) and a GLM-4.5 (its shared expert and
    float32 score-correction bias too) through Megatron and back, side by side."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(1)
    cfg = Qwen3MoeConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
        mlp_only_layers=[1], norm_topk_prob=True,
    )  # fmt: skip
    model = Qwen3MoeForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.1).add_(1.0 if "norm" in name else 0.0)
    hf = tmp_path / "hf"
    model.save_pretrained(hf)
    glm = _tiny_glm(tmp_path / "glm")
    to_megatron = [["--hf-checkpoint", str(d), "--save", str(tmp_path / f"{d.name}_mg")] for d in (hf, glm)]
    assert convert_all(to_megatron) == [0, 0]
    back = [
        [
            "--load",
            str(tmp_path / f"{d.name}_mg"),
            "--hf-checkpoint",
            str(d),
            "--save-hf",
            str(tmp_path / f"{d.name}_back"),
        ]
        for d in (hf, glm)
    ]
    assert convert_all(back) == [0, 0]
    assert_bit_exact(hf, tmp_path / "hf_back")
    assert "model.layers.2.mlp.experts.3.down_proj.weight" in hf_tensors(tmp_path / "hf_back")
    assert_bit_exact(glm, tmp_path / "glm_back")
    bias = hf_tensors(tmp_path / "glm_back")["model.layers.1.mlp.gate.e_score_correction_bias"]
    assert bias.dtype == torch.float32 and bias.abs().min() > 0


def test_a_peft_lora_folder_merges_into_the_base_and_sglang_reads_its_config(hf_dir, tmp_path, capsys):
    from sglang.srt.lora.lora_config import LoRAConfig
    from tidal.actor import write_peft_adapter

    base = hf_tensors(hf_dir)
    q, down = "model.layers.1.self_attn.q_proj.weight", "model.layers.0.mlp.down_proj.weight"
    torch.manual_seed(1)
    adapters = {}
    for name in (q, down):
        out_f, in_f = base[name].shape
        stem = name.removesuffix(".weight")
        adapters |= {f"{stem}.lora_A.weight": torch.randn(8, in_f), f"{stem}.lora_B.weight": torch.randn(out_f, 8)}
    config = {"peft_type": "LORA", "r": 8, "lora_alpha": 4.0, "target_modules": ["q_proj", "down_proj"]}
    adapter = write_peft_adapter(tmp_path / "adapter", adapters, config)
    served = LoRAConfig(str(adapter))  # how an SGLang server reads a LoRA adapter folder
    assert (served.r, served.lora_alpha, served.target_modules) == (8, 4.0, ["q_proj", "down_proj"])

    out = tmp_path / "merged"
    argv = ["--hf-checkpoint", str(hf_dir), "--lora-adapter", str(adapter), "--save-hf", str(out)]
    assert convert_main(argv, timeout_s=TIMEOUT_S) == 0
    merged = hf_tensors(out)
    assert sorted(merged) == sorted(base)
    for name, tensor in base.items():
        if name in (q, down):
            stem = name.removesuffix(".weight")
            delta = 0.5 * adapters[f"{stem}.lora_B.weight"] @ adapters[f"{stem}.lora_A.weight"]
            torch.testing.assert_close(merged[name], (tensor.float() + delta).to(tensor.dtype))
        else:
            assert torch.equal(merged[name], tensor), name
    assert (out / "config.json").is_file()

    # an adapter of another base: one line, exit 2, nothing written
    adapters[f"{q.removesuffix('.weight')}.lora_A.weight"] = torch.randn(8, 7)
    write_peft_adapter(tmp_path / "wrong", adapters, config)
    capsys.readouterr()
    wrong = [
        "--hf-checkpoint",
        str(hf_dir),
        "--lora-adapter",
        str(tmp_path / "wrong"),
        "--save-hf",
        str(tmp_path / "x"),
    ]
    assert convert_main(wrong, timeout_s=TIMEOUT_S) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"does not fit {q} (64, 64): lora_A (8, 7)" in err, err
    assert not (tmp_path / "x").exists()
