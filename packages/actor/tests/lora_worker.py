"""One rank of the LoRA parallel tests (run as a script by test_lora.py; not collected by pytest).

Usage: python lora_worker.py RANK WORLD PORT HF_DIR OUT_FILE
The same processes run TP=WORLD, then PP=WORLD: a LoRA actor with non-zero adapters (every tensor drawn from a
generator seeded by its name, so every layout holds the same adapters), its log-probs with and without the
adapters, the merged HF export, one clipped train step's adapter gradients (before clipping) and the log-probs after
it. torch.saves both parts to OUT_FILE. ``lora_part`` at world size 1 is the single-process reference.
"""

import sys
import zlib

import torch
from rl_batches import rl_batch  # same folder: on sys.path as a script and when the tests import it
from tidal.actor import Actor, ActorConfig, init_distributed
from tidal.batching import pack

SEQS = [[5, 17, 99, 3, 42, 7, 64], [1, 2, 3], [120, 0, 33, 33, 8, 90, 12, 101, 4, 56, 77], [9, 8, 7, 6, 5]]
# k_proj and gate_proj left out: their rows of the fused layers get zeros
TARGETS = ("q_proj", "v_proj", "o_proj", "up_proj", "down_proj")
CFG = dict(lr=1e-2, clip_grad=0.5, entropy_coef=0.01, log_probs_chunk_size=7, lora_rank=4, lora_alpha=8.0)


def seeded_adapters(names) -> dict[str, torch.Tensor]:
    """Full adapter tensors of these names and shapes, each drawn from a generator seeded by its name."""
    out = {}
    for name, shape in names.items():
        gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        out[name] = 0.2 * torch.randn(shape, generator=gen)
    return out


def lora_part(rank: int, world: int, port: int, tp: int, pp: int, hf_dir: str) -> dict:
    init_distributed(
        rank=rank, world_size=world, master_addr="127.0.0.1", master_port=port,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
    )  # fmt: skip
    actor = Actor(ActorConfig(hf_checkpoint=hf_dir, lora_target_modules=TARGETS, **CFG))
    probe = pack(SEQS)
    result = {"init_log_probs": actor.compute_log_probs(probe)}
    actor.lora.load_adapter_tensors(seeded_adapters({p.lora_hf_name: p.lora_full_shape for p in actor.params}))
    result["log_probs"] = actor.compute_log_probs(probe)
    from tidal.actor.lora_peft import gather_adapter_tensors

    result["gathered"] = gather_adapter_tensors(actor.lora)  # --save-hf's PEFT folder: every stage's, on rank 0
    with actor.lora.disabled():
        result["base_log_probs"] = actor.compute_log_probs(probe)
    result["export"] = dict(actor.named_hf_tensors())
    result["buckets"] = {n: t.clone() for b in actor.hf_tensor_buckets(bucket_bytes=16 * 2**10) for n, t in b}
    result["trainable"] = sorted(p.lora_hf_name for p in actor.params)
    captured = {}
    for p in actor.params:
        p.register_post_accumulate_grad_hook(lambda p: captured.__setitem__(p, p.grad.detach().clone()))
    mbs = [rl_batch(actor, [s], [a], pad_to_multiple_of=4) for s, a in zip(SEQS, [1.0, -1.0, 0.5, -0.5], strict=True)]
    result["metrics"] = actor.train_step(mbs)
    for p in actor.params:
        p.grad = captured[p]
    result["grads"] = actor.lora.adapter_tensors(grads=True)
    for p in actor.params:
        p.grad = None
    result["log_probs_after"] = actor.compute_log_probs(probe)
    return result


if __name__ == "__main__":
    rank, world, port = (int(x) for x in sys.argv[1:4])
    parts = {
        "tp": lora_part(rank, world, port, world, 1, sys.argv[4]),
        "pp": lora_part(rank, world, port, 1, world, sys.argv[4]),
    }
    torch.save(parts, sys.argv[5])
