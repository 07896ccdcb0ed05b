"""Tiny random Qwen3-MoE checkpoints built with transformers (no download), for the MoE tests and their workers."""

from pathlib import Path

import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

TINY_MOE = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,  # the dense layers' (mlp_only_layers)
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_experts=8,
    num_experts_per_tok=2,
    max_position_embeddings=4096,
    rope_theta=1e6,
    tie_word_embeddings=False,
)


def save_tiny_moe(out_dir: Path, *, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides) -> Path:
    """A random qwen3_moe saved with save_pretrained; weights ~N(0, 0.1) (router N(0, 1): decisive routing)."""
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**(TINY_MOE | overrides)))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.1)
            elif "embed" in name or "mlp.gate." in name:
                p.normal_(0.0, 1.0)
            else:
                p.normal_(0.0, 0.1)
    model.to(dtype).save_pretrained(out_dir)
    return out_dir
