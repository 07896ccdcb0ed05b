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
    _randomize(model)
    model.to(dtype).save_pretrained(out_dir)
    return out_dir


def _randomize(model: torch.nn.Module) -> None:
    """Norms ~N(1, 0.1), embeddings and routers ~N(0, 1) (decisive routing), every other weight ~N(0, 0.1)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.1)
            elif "embed" in name or "mlp.gate." in name:
                p.normal_(0.0, 1.0)
            else:
                p.normal_(0.0, 0.1)


TINY_GLM = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,  # the first_k_dense_replace layers'
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    n_group=2,  # grouped top-k: the best of 2 groups of 4 experts, then the top 2 in it
    topk_group=1,
    routed_scaling_factor=2.5,
    first_k_dense_replace=1,
    partial_rotary_factor=0.5,
    use_qk_norm=True,
    attention_bias=True,
    max_position_embeddings=4096,
    rope_theta=1e6,
    tie_word_embeddings=False,
)


def save_tiny_glm(out_dir: Path, *, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides) -> Path:
    """A random glm4_moe (GLM-4.5) saved with save_pretrained; weights as ``save_tiny_moe``'s, the routers'
    score-correction biases ~N(0, 0.3) (they change which experts are chosen)."""
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

    torch.manual_seed(seed)
    model = Glm4MoeForCausalLM(Glm4MoeConfig(**(TINY_GLM | overrides)))
    _randomize(model)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.3)
    model.to(dtype).save_pretrained(out_dir)
    return out_dir


def hf_log_probs(path: Path, seqs: list[list[int]]) -> torch.Tensor:
    """transformers' fp32 log-probs of each sequence run alone (0 at each first position), concatenated."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ref = []
    with torch.no_grad():
        for seq in seqs:
            ids = torch.tensor([seq])
            lp = torch.log_softmax(hf(ids).logits[0], -1)[:-1].gather(-1, ids[0, 1:, None]).squeeze(-1)
            ref.append(torch.cat([torch.zeros(1), lp]))
    return torch.cat(ref)
