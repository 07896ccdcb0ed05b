"""CP=2 (with DP=2 and with TP=2) over gloo against one process, and a vocabulary that does not split over TP=2.

One spawn of four real processes runs every part (cp_worker.py); the single-process reference runs the
same code in this process.
"""

import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

WORKER = Path(__file__).with_name("cp_worker.py")
ODD_VOCAB = 131  # not divisible by TP=2: padded to 256 rows
HIDDEN = 64


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _import_worker():
    sys.path.insert(0, str(WORKER.parent))
    try:
        import cp_worker
    finally:
        sys.path.pop(0)
    return cp_worker


@pytest.fixture(scope="module")
def odd_vocab_dir(tmp_path_factory) -> Path:
    torch.manual_seed(3)
    config = Qwen2Config(
        vocab_size=ODD_VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.1)
            if "norm" in name:
                p.add_(1.0)
    out = tmp_path_factory.mktemp("odd_vocab")
    model.save_pretrained(out)
    return out


def spawn(tmp: Path, worker: Path, world: int, args: list[str]) -> list[dict]:
    """``world`` real processes of ``worker RANK WORLD PORT *args OUT`` over gloo; their torch.saved results."""
    port, procs = free_port(), []
    for rank in range(world):
        log = open(tmp / f"rank{rank}.log", "w")  # noqa: SIM115
        cmd = [sys.executable, str(worker), str(rank), str(world), str(port), *args, str(tmp / f"rank{rank}.pt")]
        procs.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), log))
    try:
        for rank, (proc, log) in enumerate(procs):
            rc = proc.wait(timeout=300)
            log.close()
            assert rc == 0, f"rank {rank} exited {rc}:\n{(tmp / f'rank{rank}.log').read_text()[-3000:]}"
    finally:
        for proc, _ in procs:
            if proc.poll() is None:
                proc.kill()
    return [torch.load(tmp / f"rank{rank}.pt", weights_only=False) for rank in range(world)]


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory, qwen2_dir, odd_vocab_dir):
    """cp_worker.py on four real processes over gloo: DP=2 x CP=2, TP=2 x CP=2, then TP=2 x DP=2 (odd vocabulary)."""
    return spawn(tmp_path_factory.mktemp("cp2x2"), WORKER, 4, [str(qwen2_dir), str(odd_vocab_dir)])


@pytest.fixture(scope="module")
def single_cp(dist_env, qwen2_dir):
    return _import_worker().cp_part(0, 1, 0, 1, str(qwen2_dir))  # process group already up: port unused


def assert_matches_single(result: dict, single: dict, *, weights_atol: float = 2e-6) -> None:
    """Log-probs, loss, grad norm, updated weights and the next log-probs equal the single-process run's."""
    torch.testing.assert_close(result["log_probs"], single["log_probs"], atol=1e-5, rtol=0)
    for key in ("train/loss", "train/pg_loss", "train/entropy", "train/grad_norm", "train/num_loss_tokens"):
        assert result["metrics"][key] == pytest.approx(single["metrics"][key], rel=1e-5, abs=1e-7), key
    # the updated weights (after clipping and the Adam step) equal the single-process ones
    assert set(result["weights"]) == set(single["weights"])
    for name, tensor in result["weights"].items():
        torch.testing.assert_close(tensor, single["weights"][name], atol=weights_atol, rtol=0, msg=name)
    torch.testing.assert_close(result["log_probs_after"], single["log_probs_after"], atol=1e-4, rtol=0)


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() < 4, reason="NCCL needs one GPU per rank")
@pytest.mark.parametrize("layout", ["dp2cp2", "tp2cp2"])
def test_cp2_layouts_match_single_process(four_ranks, single_cp, qwen2_dir, hf_reference, layout):
    """DP=2 x CP=2 and TP=2 x CP=2 (one spawn of four processes) against one process on the same data.

    With DP=2 each DP rank trains on one of the two micro-batches; the step's loss and update cover both.
    """
    worker = _import_worker()
    _, ref = hf_reference(qwen2_dir, worker.SEQS)
    n = sum(len(s) for s in worker.SEQS)
    for result in (r[layout] for r in four_ranks):
        torch.testing.assert_close(result["log_probs"][:n], torch.cat(ref), atol=1e-4, rtol=0)
        assert_matches_single(result, single_cp)
    assert single_cp["metrics"]["train/grad_norm"] > 0.5  # clipping was active
    assert not torch.allclose(single_cp["log_probs_after"], single_cp["log_probs"], atol=1e-3)


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() < 4, reason="NCCL needs one GPU per rank")
def test_odd_vocab_at_tp2_matches_transformers(four_ranks, odd_vocab_dir, hf_reference):
    from safetensors.torch import load_file

    worker = _import_worker()
    _, ref = hf_reference(odd_vocab_dir, worker.VOCAB_SEQS)
    original = load_file(odd_vocab_dir / "model.safetensors")
    for rank, result in enumerate(r["vocab"] for r in four_ranks):
        assert result["local_vocab_rows"] == 128, rank  # 131 padded to 256 = 2 x 128
        torch.testing.assert_close(result["log_probs"], torch.cat(ref), atol=1e-4, rtol=0)
        assert set(result["export"]) == set(original)
        for name, tensor in result["export"].items():
            assert torch.equal(tensor, original[name]), name
        assert result["export_after"]["model.embed_tokens.weight"] == (ODD_VOCAB, HIDDEN)
        assert result["export_after"]["lm_head.weight"] == (ODD_VOCAB, HIDDEN)
        assert result["padded_rows_abs_max"] == 0.0  # padded rows get no gradient
        assert result["metrics"]["train/grad_norm"] > 0


def test_zigzag_segments_layout_and_error():
    from tidal.actor.cp_attention import zigzag_segments

    assert zigzag_segments(torch.tensor([0, 8, 12]), 2) == [(0, 2), (4, 1)]
    with pytest.raises(ValueError, match="not a multiple of 2 x --context-parallel-size 2"):
        zigzag_segments(torch.tensor([0, 6]), 2)


@pytest.mark.parametrize(("cp", "lengths"), [(2, [7, 3, 11, 5, 16]), (3, [13, 1, 6]), (4, [40])])
def test_zigzag_attention_equals_packed_attention(cp, lengths):
    """Every rank's local attention, fed all ranks' K/V, reassembles the unsplit packed attention (no processes)."""
    from tidal.actor.attention import packed_causal_attention
    from tidal.actor.cp_attention import zigzag_attention
    from tidal.batching import gather_from_context_parallel, pack, split_for_context_parallel

    torch.manual_seed(0)
    batch = pack([[1] * n for n in lengths])
    q, k, v = (torch.randn(batch.num_tokens, h, 8) for h in (4, 2, 2))
    expected = packed_causal_attention(q, k, v, batch.cu_seqlens, batch.max_seqlen, scale=0.3)
    shards = [split_for_context_parallel(batch, cp_size=cp, cp_rank=r) for r in range(cp)]

    def local(x, shard):
        real = (shard.source_index >= 0)[:, None, None]
        return torch.where(real, x[shard.source_index.clamp(min=0)], torch.zeros(()))

    gathered_k = torch.stack([local(k, s) for s in shards])
    gathered_v = torch.stack([local(v, s) for s in shards])
    outs = [
        zigzag_attention(local(q, s), gathered_k, gathered_v, s.cu_seqlens_padded, cp_rank=r, scale=0.3)
        for r, s in enumerate(shards)
    ]
    torch.testing.assert_close(gather_from_context_parallel(outs, batch), expected, atol=1e-5, rtol=1e-5)
