"""One rank of the read-once test (run as a script by test_hf_read_once.py; not collected by pytest).

Usage: python hf_read_worker.py RANK WORLD PORT TP HF_DIR CKPT_DIR OUT_FILE
At TP x PP = WORLD (PP = WORLD / TP): builds the actor from HF_DIR, the reference model and the critic from it, and
records the HF bytes each read and whether their weights are the checkpoint's. Then moves the actor's and critic's
weights off the HF ones, saves them as a Megatron checkpoint in CKPT_DIR (tidal.ckpt, every rank), and resumes as
`train --load` does: actor and critic built with weights="checkpoint", then loaded. torch.saves what it saw.
"""

import sys

import torch
from safetensors.torch import load_file
from tidal.actor import Actor, ActorConfig, ActorError, Critic, ReferenceModel, init_distributed
from tidal.batching import pack
from tidal.ckpt import load_checkpoint, save_checkpoint

SEQS = [[5, 17, 99, 3, 42, 7, 64], [1, 2, 3], [120, 0, 33, 33, 8, 90, 12, 101, 4, 56, 77]]


def _same(a: torch.nn.Module, b: torch.nn.Module, *, skip_head: bool = False) -> bool:
    theirs = dict(b.named_parameters())
    return all(
        torch.equal(p, theirs[n]) for n, p in a.named_parameters() if not (skip_head and n.startswith("output_layer."))
    )


def run(rank: int, world: int, port: int, tp: int, hf_dir: str, ckpt_dir: str) -> dict:
    pp = world // tp
    init_distributed(
        rank=rank,
        world_size=world,
        master_addr="127.0.0.1",
        master_port=port,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
    )
    cfg = ActorConfig(hf_checkpoint=hf_dir, lr=1e-2)
    actor = Actor(cfg)
    reference = ReferenceModel(cfg, weights_from=actor, offload=False)
    critic = Critic(cfg, weights=actor)
    original = load_file(f"{hf_dir}/model.safetensors")
    exported = dict(actor.named_hf_tensors())  # every shard gathered back: the broadcast put each in its place
    out = {
        "read": {"actor": actor.hf_bytes_read, "reference": reference.hf_bytes_read},
        "export_equal": set(exported) == set(original)
        and all(torch.equal(t, original[n]) for n, t in exported.items()),
        "reference_equal": _same(reference.model, actor.model),
        "critic_equal": _same(critic.model, actor.model, skip_head=True),
        "log_probs": actor.compute_log_probs(pack(SEQS)),
    }
    out["read"]["critic"] = critic.hf_bytes_read

    with torch.no_grad():  # weights that are not the HF ones, so a resume that read HF would show
        for model, shift in ((actor.model, 0.25), (critic.model, -0.5)):
            for p in model.parameters():
                p.add_(shift)
    state = actor.sharded_state_dict() | critic.checkpoint_sections()
    save_checkpoint(ckpt_dir, 1, state)
    trained = actor.compute_log_probs(pack(SEQS))

    resumed, resumed_critic = Actor(cfg, weights="checkpoint"), Critic(cfg, weights="checkpoint")
    try:
        resumed.compute_log_probs(pack(SEQS))
        out["refused_before_load"] = False
    except ActorError:
        out["refused_before_load"] = True
    request = resumed.sharded_state_dict() | resumed_critic.checkpoint_sections()
    loaded, _ = load_checkpoint(ckpt_dir, request)
    resumed.load_state_dict(loaded)
    resumed_critic.load_checkpoint_sections(loaded)
    out["resume_read"] = {"actor": resumed.hf_bytes_read, "critic": resumed_critic.hf_bytes_read}
    out["resume_equal"] = _same(resumed.model, actor.model) and _same(resumed_critic.model, critic.model)
    out["resume_log_probs_equal"] = torch.equal(resumed.compute_log_probs(pack(SEQS)), trained)
    return out


if __name__ == "__main__":
    rank, world, port, tp = (int(x) for x in sys.argv[1:5])
    torch.save(run(rank, world, port, tp, sys.argv[5], sys.argv[6]), sys.argv[7])
