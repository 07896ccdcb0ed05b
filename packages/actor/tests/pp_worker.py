"""One rank of the pipeline-parallel tests (run as a script by test_pipeline.py; not collected by pytest).

Usage: python pp_worker.py RANK WORLD PORT HF_DIR TIED_HF_DIR CKPT_IN CKPT_OUT [TP] OUT_FILE
The same processes run, one after the other, at TP (default 1) x PP = WORLD: HF_DIR (log-probs, HF export and
buckets, two clipped train steps, the weights and log-probs after them, a Megatron checkpoint saved to CKPT_OUT),
the tied model TIED_HF_DIR (the same checks, one step), and the weights of CKPT_IN (saved by one process) loaded.
torch.saves all three to OUT_FILE. ``pp_part`` at world size 1 is the single-process reference.
"""

import sys

import torch
from rl_batches import rl_batch  # same folder: on sys.path as a script and when the tests import it
from safetensors.torch import load_file
from tidal.actor import Actor, ActorConfig, init_distributed
from tidal.batching import pack
from tidal.ckpt import load_checkpoint, save_checkpoint

SEQS = [[5, 17, 99, 3, 42, 7, 64], [1, 2, 3], [120, 0, 33, 33, 8, 90, 12, 101, 4, 56, 77], [9, 8, 7, 6, 5]]
# adam_eps=1 makes Adam's first update ~ lr * grad (not ~ lr * sign(grad), which flips on rounding noise)
CFG = dict(lr=1.0, adam_eps=1.0, clip_grad=0.5, entropy_coef=0.01, log_probs_chunk_size=7)


def exports(actor, hf_dir: str) -> dict:
    """The HF export equals the HF checkpoint (before training); the bf16 buckets equal the export."""
    original = load_file(f"{hf_dir}/model.safetensors")
    exported = {n: t.clone() for n, t in actor.named_hf_tensors()}
    buckets = [(n, t.clone()) for b in actor.hf_tensor_buckets(bucket_bytes=16 * 2**10) for n, t in b]
    reused = [(n, t.clone()) for b in actor.hf_tensor_buckets(bucket_bytes=10**9, reuse_buffers=True) for n, t in b]
    staged = [(n, t.clone()) for b in actor.hf_tensor_buckets(bucket_bytes=16 * 2**10, stage_only=True) for n, t in b]
    return {
        "export_names": list(exported),
        "stage_names": [n for n, _ in staged],  # this stage's own tensors alone, nothing from the other stage
        "stage_equal": all(torch.equal(t, exported[n].to(torch.bfloat16)) for n, t in staged),
        "export_equal": set(exported) == set(original)
        and all(torch.equal(t, original[n]) for n, t in exported.items()),
        "buckets_equal": all(
            [n for n, _ in b] == list(exported) and all(torch.equal(t, exported[n].to(torch.bfloat16)) for n, t in b)
            for b in (buckets, reused)
        ),
    }


def _init(rank: int, world: int, port: int, tp: int) -> None:
    init_distributed(
        rank=rank,
        world_size=world,
        master_addr="127.0.0.1",
        master_port=port,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=world // tp,
    )


def pp_part(
    rank: int, world: int, port: int, hf_dir: str, *, steps: int = 2, ckpt_out: str | None = None, tp: int = 1
) -> dict:
    """TP = ``tp`` x PP = ``world / tp``: log-probs, export, ``steps`` train steps (two micro-batches), weights."""
    _init(rank, world, port, tp)
    actor = Actor(ActorConfig(hf_checkpoint=hf_dir, **CFG))
    probe = pack(SEQS, pad_to_multiple_of=8)
    result = {"log_probs": actor.compute_log_probs(probe), **exports(actor, hf_dir)}
    advantages = [1.0, -1.0, 0.5, -0.5]
    result["metrics"] = []
    for _ in range(steps):
        mbs = [
            rl_batch(actor, SEQS[:2], advantages[:2]),
            rl_batch(actor, SEQS[2:], advantages[2:], pad_to_multiple_of=4),
        ]
        result["metrics"].append(actor.train_step(mbs))
    result["weights"] = dict(actor.named_hf_tensors())
    if actor.spec.tie_word_embeddings:  # first stage: the embedding; last stage: its copy as the output weight
        result["tied_weight"] = actor.model.shared_embedding_or_output_weight().detach().clone()
    result["log_probs_after"] = actor.compute_log_probs(probe)
    if ckpt_out:
        save_checkpoint(ckpt_out, steps, actor.sharded_state_dict())
    return result


def load_part(rank: int, world: int, port: int, hf_dir: str, ckpt_in: str, *, tp: int = 1) -> dict:
    """A checkpoint saved at another layout, loaded at TP = ``tp`` x PP = ``world / tp``: its weights and step."""
    _init(rank, world, port, tp)
    actor = Actor(ActorConfig(hf_checkpoint=hf_dir, **CFG))
    state, _ = load_checkpoint(ckpt_in, actor.sharded_state_dict())
    actor.load_state_dict(state)
    return {"weights": dict(actor.named_hf_tensors()), "num_steps": actor.num_steps}


if __name__ == "__main__":
    torch.set_num_threads(1)
    rank, world, port = (int(x) for x in sys.argv[1:4])
    hf_dir, tied_dir, ckpt_in, ckpt_out = sys.argv[4:8]
    tp, out_file = (int(sys.argv[8]) if len(sys.argv) > 9 else 1), sys.argv[-1]
    out = {
        "pp": pp_part(rank, world, port, hf_dir, ckpt_out=ckpt_out, tp=tp),
        "tied": pp_part(rank, world, port, tied_dir, steps=1, tp=tp),
        "load": load_part(rank, world, port, hf_dir, ckpt_in, tp=tp),
    }
    torch.save(out, out_file)
