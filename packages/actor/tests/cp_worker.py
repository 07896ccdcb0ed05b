"""One rank of the context-parallel and vocab-padding tests (run as a script by test_context_parallel.py).

Usage: python cp_worker.py RANK 4 PORT CP_HF_DIR VOCAB_HF_DIR OUT_FILE
The same four processes run, one after the other: the CP part at DP=2 x CP=2 and at TP=2 x CP=2 (log-probs
of a packed batch, one train step over two micro-batches, the weights after it; with DP=2 each DP rank
trains on one micro-batch), then the vocabulary part at TP=2 x DP=2 (an HF model whose vocabulary does
not split over TP: log-probs, export, and the padded rows after a train step). torch.saves all three
to OUT_FILE.
"""

import sys

import torch
from megatron.core import parallel_state
from rl_batches import rl_batch  # same folder: on sys.path as a script and when the tests import it
from tidal.actor import Actor, ActorConfig, init_distributed
from tidal.batching import pack

# lengths 7, 3 (shorter than 2 * cp), 11, 5, 16: every zigzag case (padding inside chunks, empty chunks)
SEQS = [
    [5, 17, 99, 3, 42, 7, 64],
    [1, 2, 3],
    [120, 0, 33, 33, 8, 90, 12, 101, 4, 56, 77],
    [9, 8, 7, 6, 5],
    [11, 22, 33, 44, 55, 66, 77, 88, 99, 110, 121, 2, 4, 6, 8, 10],
]
# adam_eps=1 makes Adam's first update ~ lr * grad (not ~ lr * sign(grad), which flips on rounding noise)
CP_CFG = dict(lr=1.0, adam_eps=1.0, clip_grad=0.5, entropy_coef=0.01, log_probs_chunk_size=7)
VOCAB_SEQS = [[130, 5, 129, 64, 128, 3], [1, 130, 2, 127, 126, 0, 128]]


def cp_part(rank: int, world: int, port: int, cp: int, hf_dir: str, tp: int = 1) -> dict:
    """CP = ``cp`` x TP = ``tp`` x DP = ``world / (cp * tp)``; each DP rank trains on its share of the micro-batches."""
    init_distributed(
        rank=rank,
        world_size=world,
        master_addr="127.0.0.1",
        master_port=port,
        tensor_model_parallel_size=tp,
        context_parallel_size=cp,
    )
    actor = Actor(ActorConfig(hf_checkpoint=hf_dir, **CP_CFG))
    probe = pack(SEQS, pad_to_multiple_of=8)
    result = {"log_probs": actor.compute_log_probs(probe)}
    advantages = [1.0, -1.0, 0.5, -0.5, 0.8]
    mbs = [rl_batch(actor, SEQS[:2], advantages[:2]), rl_batch(actor, SEQS[2:], advantages[2:], pad_to_multiple_of=4)]
    dp_rank, dp = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    result["metrics"] = actor.train_step(mbs[dp_rank::dp])
    result["weights"] = dict(actor.named_hf_tensors())
    result["log_probs_after"] = actor.compute_log_probs(probe)
    return result


def vocab_part(rank: int, world: int, port: int, hf_dir: str, tp: int) -> dict:
    init_distributed(
        rank=rank, world_size=world, master_addr="127.0.0.1", master_port=port, tensor_model_parallel_size=tp
    )
    actor = Actor(ActorConfig(hf_checkpoint=hf_dir, lr=1e-2, entropy_coef=0.01, log_probs_chunk_size=5))
    probe = pack(VOCAB_SEQS)
    result = {
        "log_probs": actor.compute_log_probs(probe),
        "export": {n: t.clone() for n, t in actor.named_hf_tensors()},
    }
    result["local_vocab_rows"] = actor.model.embedding.word_embeddings.weight.shape[0]
    result["metrics"] = actor.train_step([rl_batch(actor, VOCAB_SEQS, [1.0, -1.0])])
    result["export_after"] = {n: tuple(t.shape) for n, t in actor.named_hf_tensors()}
    vocab = actor.spec.vocab_size
    local = result["local_vocab_rows"]
    real = max(0, min(local, vocab - parallel_state.get_tensor_model_parallel_rank() * local))
    padded = [actor.model.embedding.word_embeddings.weight[real:], actor.model.output_layer.weight[real:]]
    result["padded_rows_abs_max"] = float(
        torch.cat([p.detach().flatten() for p in padded] + [torch.zeros(1)]).abs().max()
    )
    return result


if __name__ == "__main__":
    rank, world, port = (int(x) for x in sys.argv[1:4])
    out = {
        "dp2cp2": cp_part(rank, world, port, 2, sys.argv[4], tp=1),
        "tp2cp2": cp_part(rank, world, port, 2, sys.argv[4], tp=2),
        "vocab": vocab_part(rank, world, port, sys.argv[5], tp=2),
    }
    torch.save(out, sys.argv[6])
