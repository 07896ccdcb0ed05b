"""One rank of the expert-parallel test (run as a script by test_expert_parallel.py; not collected by pytest).

Usage: python ep_worker.py RANK WORLD PORT EP HF_DIR OUT_FILE [PP]
Builds the actor of a tiny Qwen3-MoE with EP experts per group, computes log-probs of a fixed packed batch, exports
HF tensors, runs one train step (with the load-balancing loss) on this rank's share of the micro-batches, saves a
distributed checkpoint into OUT_FILE's folder (``ckpt``), and torch.saves what it saw to OUT_FILE.
"""

import json
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from rl_batches import rl_batch  # same folder: on sys.path as a script and when the tests import it
from safetensors.torch import load_file
from tidal.actor import (
    Actor,
    ActorConfig,
    MemoryInputs,
    ModelShape,
    init_distributed,
    plan_memory,
    stage_export_role,
)
from tidal.actor.routing_replay import FIELD, routed_experts_field
from tidal.batching import pack
from tidal.ckpt import read_hf_config_json, save_checkpoint

_GEN = torch.Generator().manual_seed(7)
SEQS = [torch.randint(0, 128, (n,), generator=_GEN).tolist() for n in (23, 9, 31, 14)]
# adam_eps 1 and no clipping: the first update is lr * g / (|g| + 1), so equal weights after it mean equal gradients
CFG = dict(lr=0.1, adam_eps=1.0, clip_grad=0.0, moe_aux_loss_coeff=0.01, log_probs_chunk_size=16)


def replayed_routing(layers: int = 3, top_k: int = 2, experts: int = 8) -> list:
    """Token t of each sequence to experts (t + l) % E and (t + l + 3) % E in layer l (the R3 token field)."""
    rows = []
    for seq in SEQS:
        t = np.arange(len(seq) - 1)[:, None, None]
        ids = (t + np.arange(layers)[None, :, None] + np.array([0, 3])[None, None, :top_k]) % experts
        rows.append(routed_experts_field(ids.reshape(len(seq) - 1, layers * top_k), len(seq)))
    return rows


def run(rank: int, world: int, port: int, ep: int, hf_dir: str, ckpt_dir: Path | None = None, pp: int = 1) -> dict:
    init_distributed(
        rank=rank,
        world_size=world,
        master_addr="127.0.0.1",
        master_port=port,
        expert_model_parallel_size=ep,
        pipeline_model_parallel_size=pp,
    )
    actor = Actor(ActorConfig(hf_checkpoint=hf_dir, **CFG))
    probe = pack(SEQS)
    result = {"log_probs": actor.compute_log_probs(probe)}
    # rollout routing replay: every token sent to the experts of a fixed routing (not the routers' own), all-to-all
    actor.routing_replay.replay = True
    layers = json.loads((Path(hf_dir) / "config.json").read_text())["num_hidden_layers"]
    routing = replayed_routing(layers=layers)
    result["replay_log_probs"] = actor.compute_log_probs(pack(SEQS, token_fields={FIELD: routing}))
    actor.routing_replay.replay = False
    result["local_experts"] = tuple(actor.model.decoder.layers[0].mlp.experts.weight1.shape) if pp == 1 else None
    shape = ModelShape.from_hf_config(read_hf_config_json(hf_dir))
    inputs = MemoryInputs.from_actor_config(actor.cfg, train_tokens=64, logprob_tokens=64, longest_sequence=32)
    plan = dict(plan_memory(shape, replace(inputs, expert_parallel=ep, pipeline_parallel=pp)).rows)
    result["plan_param_bytes"] = plan["parameters (float32)"]
    result["param_bytes"] = sum(p.numel() * p.element_size() for p in actor.params)
    original = load_file(f"{hf_dir}/model.safetensors")
    exported = dict(actor.named_hf_tensors())
    result["export_equal"] = set(exported) == set(original) and all(
        torch.equal(t, original[n]) for n, t in exported.items()
    )
    buckets = [(n, t) for b in actor.hf_tensor_buckets(bucket_bytes=2**14) for n, t in b]
    result["buckets_equal"] = [n for n, _ in buckets] == list(exported) and all(
        torch.equal(t, exported[n].to(torch.bfloat16)) for n, t in buckets
    )
    stage, exports, sends = stage_export_role()  # a per-stage export: the exporting ranks iterate together
    if pp > 1 and exports:
        own = [(n, t.clone()) for b in actor.hf_tensor_buckets(bucket_bytes=2**14, stage_only=True) for n, t in b]
        result["stage_export"] = (stage, sends, {n: torch.equal(t, exported[n].to(torch.bfloat16)) for n, t in own})
    advantages = [1.0, -1.0, 0.5, -0.5]
    dp, dp_rank = world // pp, rank % (world // pp)  # TP = CP = 1
    mbs = [rl_batch(actor, [s], [a]) for s, a in zip(SEQS, advantages, strict=True)]
    result["metrics"] = actor.train_step(mbs[dp_rank::dp])
    result["weights"] = dict(actor.named_hf_tensors())
    result["log_probs_after"] = actor.compute_log_probs(probe)
    if ckpt_dir is not None:
        save_checkpoint(ckpt_dir, 1, actor.sharded_state_dict())
    return result


if __name__ == "__main__":
    rank, world, port, ep = (int(x) for x in sys.argv[1:5])
    pp = int(sys.argv[7]) if len(sys.argv) > 7 else 1
    torch.save(run(rank, world, port, ep, sys.argv[5], Path(sys.argv[6]).parent / "ckpt", pp), sys.argv[6])
