"""``train --lora-rank --load``: a LoRA run's checkpoint on another base or other target modules is refused by
``parse_job``, one line, before anything starts (the adapters' shapes read from the checkpoint's metadata and the
base's safetensors headers)."""

import json
import socket
from pathlib import Path

import pytest
import torch
from tidal.train.cli import parse_job


def _tiny(out: Path, head_dim: int) -> Path:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim)  # fmt: skip
    Qwen3ForCausalLM(cfg).save_pretrained(out)
    (out / "tokenizer.json").write_text("{}")
    return out


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """A tiny base, another of wider heads, and the Megatron checkpoint of a rank-4 q/v LoRA actor on the first."""
    from tidal.actor import Actor, ActorConfig, destroy_distributed, init_distributed
    from tidal.ckpt import save_checkpoint

    root = tmp_path_factory.mktemp("lora_load")
    base = _tiny(root / "base", 16)
    _tiny(root / "other", 32)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    init_distributed(rank=0, world_size=1, master_addr="127.0.0.1", master_port=port)
    try:
        actor = Actor(ActorConfig(hf_checkpoint=str(base), lora_rank=4, lora_target_modules=("q_proj", "v_proj")))
        save_checkpoint(root / "ckpt", 1, actor.sharded_state_dict())
    finally:
        destroy_distributed()
    (root / "data.jsonl").write_text(json.dumps({"prompt": "1+1=", "label": "2"}) + "\n")
    return root


def test_a_lora_checkpoint_goes_only_on_its_base_with_its_targets(lora_run):
    argv = ["--recipe", "base", "--prompt-data", str(lora_run / "data.jsonl"), "--rollout-batch-size", "4",
            "--lora-rank", "4", "--load", str(lora_run / "ckpt")]  # fmt: skip
    assert parse_job([*argv, "--hf-checkpoint", str(lora_run / "base"), "--lora-target-modules", "q", "v"]).ckpt.load
    with pytest.raises(ValueError, match=r"--load .*ckpt: the adapter does not fit model\.layers\.0\.self_attn\.q_proj"
                       r"\.weight \(128, 64\): lora_A \(4, 64\), lora_B \(64, 4\) .*give the base it was trained on "
                       "as --hf-checkpoint") as err:  # fmt: skip
        parse_job([*argv, "--hf-checkpoint", str(lora_run / "other"), "--lora-target-modules", "q", "v"])
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match=r"--load .*ckpt holds no adapter for model\.layers\.0\.mlp\.down_proj\.weight"
                       r" \(10 of the 14 weights --lora-target-modules all-linear selects"):  # fmt: skip
        parse_job([*argv, "--hf-checkpoint", str(lora_run / "base")])
