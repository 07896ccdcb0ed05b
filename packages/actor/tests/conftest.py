import socket
import sys
from pathlib import Path

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

TINY = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def save_tiny_model(out_dir: Path, *, model_type: str = "qwen2", tie: bool = False, seed: int = 0) -> Path:
    """A tiny random HF model saved with save_pretrained; weights ~N(0, 0.1) so logits are far from uniform."""
    torch.manual_seed(seed)
    if model_type == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**TINY, tie_word_embeddings=tie))
    else:
        model = Qwen3ForCausalLM(Qwen3Config(**TINY, head_dim=32, tie_word_embeddings=tie))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.1)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(1.0)
    model.save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="module")
def dist_env():
    """World size 1 over gloo with Megatron's parallel state (TP=1), for one test module's single-process tests.

    Module-scoped and torn down afterwards: a default process group left in the pytest process would be inherited
    by every process that later tests fork (tidal-ckpt's multi-rank tests), which then cannot create their own.
    """
    from tidal.actor import destroy_distributed, init_distributed

    init_distributed(rank=0, world_size=1, master_addr="127.0.0.1", master_port=free_port(), seed=1234)
    yield
    destroy_distributed()


@pytest.fixture(scope="session")
def qwen2_dir(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("qwen2"))


@pytest.fixture(scope="session")
def qwen2_tied_dir(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("qwen2_tied"), tie=True, seed=1)


@pytest.fixture(scope="session")
def qwen3_dir(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("qwen3"), model_type="qwen3", seed=2)


def _hf_token_log_probs(hf_dir: Path, sequences: list[list[int]]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """transformers' own logits and per-token log-probs (tidal convention) for each sequence alone."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    logits_out, lps = [], []
    with torch.no_grad():
        for seq in sequences:
            ids = torch.tensor([seq])
            logits = model(ids).logits[0].float()
            lp = torch.log_softmax(logits, dim=-1)[:-1].gather(-1, ids[0, 1:, None]).squeeze(-1)
            logits_out.append(logits)
            lps.append(torch.cat([torch.zeros(1), lp]))
    return logits_out, lps


@pytest.fixture(scope="session")
def hf_reference():
    """``fn(hf_dir, sequences) -> (logits per sequence, tidal-convention log-probs per sequence)`` from transformers."""
    return _hf_token_log_probs


@pytest.fixture(scope="session")
def rl_batch():
    """``rl_batch(actor, seqs, advantages=(1.0, -1.0, 0.5), **pack_kw)`` from ``rl_batches.py`` (shared with the
    worker scripts)."""
    sys.path.insert(0, str(Path(__file__).parent))
    try:
        from rl_batches import rl_batch
    finally:
        sys.path.pop(0)
    return rl_batch
