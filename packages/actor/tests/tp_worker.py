"""One rank of the multi-process tests (run as a script by test_parallel.py; not collected by pytest).

Usage: python tp_worker.py RANK WORLD PORT TP HF_DIR OUT_FILE
Builds the actor, computes log-probs of a fixed packed batch, exports HF tensors, runs one train
step on this rank's share of the micro-batches, and torch.saves what it saw to OUT_FILE.
"""

import sys

import torch
from rl_batches import rl_batch  # same folder: on sys.path as a script and when the tests import it
from safetensors.torch import load_file
from tidal.actor import Actor, ActorConfig, init_distributed
from tidal.actor.agreement import agreement_metrics, agreement_sums, all_reduce_sums, combine_sums
from tidal.batching import pack

SEQS = [[5, 17, 99, 3, 42, 7, 64], [1, 2, 3], [120, 0, 33, 33, 8, 90, 12, 101, 4, 56, 77], [9, 8, 7, 6, 5]]
AGREEMENT_GAPS = [0.1, -0.9, 0.3, -0.05]  # the largest on DP rank 1 of 2
CFG = dict(lr=1e-2, clip_grad=0.5, entropy_coef=0.01, log_probs_chunk_size=7)


def run(rank: int, world: int, port: int, tp: int, hf_dir: str) -> dict:
    init_distributed(
        rank=rank, world_size=world, master_addr="127.0.0.1", master_port=port, tensor_model_parallel_size=tp
    )
    actor = Actor(ActorConfig(hf_checkpoint=hf_dir, **CFG))
    probe = pack(SEQS)
    result = {"log_probs": actor.compute_log_probs(probe)}
    original = load_file(f"{hf_dir}/model.safetensors")
    exported = dict(actor.named_hf_tensors())
    result["export_equal"] = set(exported) == set(original) and all(
        torch.equal(t, original[n]) for n, t in exported.items()
    )
    buckets = [(n, t) for b in actor.hf_tensor_buckets(bucket_bytes=64 * 2**10) for n, t in b]
    result["buckets_equal"] = [n for n, _ in buckets] == list(exported) and all(
        torch.equal(t, exported[n].to(torch.bfloat16)) for n, t in buckets
    )
    advantages = [1.0, -1.0, 0.5, -0.5]
    dp, dp_rank = world // tp, rank // tp
    mbs = [rl_batch(actor, [s], [a], pad_to_multiple_of=4) for s, a in zip(SEQS, advantages, strict=True)]
    result["metrics"] = actor.train_step(mbs[dp_rank::dp])
    result["log_probs_after"] = actor.compute_log_probs(probe)
    result["agreement"] = agreement_of(dp_rank, dp, device=actor.device)
    return result


def agreement_of(dp_rank: int, dp: int, *, device: torch.device) -> dict[str, float]:
    """Engine-actor agreement of this DP rank's sequences (engine off by AGREEMENT_GAPS), reduced over DP."""
    parts = [
        agreement_sums(torch.zeros(len(s)), torch.full((len(s),), gap), torch.ones(len(s)))
        for s, gap in zip(SEQS, AGREEMENT_GAPS, strict=True)
    ]
    return agreement_metrics(all_reduce_sums(combine_sums(parts[dp_rank::dp]), device=device))


if __name__ == "__main__":
    rank, world, port, tp = (int(x) for x in sys.argv[1:5])
    torch.save(run(rank, world, port, tp, sys.argv[5]), sys.argv[6])
