"""GPU smoke of the trainer paths in the fast setting (bf16 parameters, fp32 main copies, fused kernels and the
gradient-accumulation fusion): GRPO and GSPO with one step per rollout (old log-probs taken from the training
forward), PPO with a critic (a critic-only rollout, then both), offload/onload of the actor and the critic, every
other estimator with a reference model, KL loss, KL penalty and TIS. Prints the metrics.

    PYTHONPATH=$P python3 bench/gpu_smoke_trainer.py       # P as in bench_actor_gpu.py; ~40 s on an H200
"""

from __future__ import annotations

import json
import socket
import sys
import tempfile
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_actor_gpu as B  # the checkpoint writer
from tidal.actor import Actor, ActorConfig, init_distributed
from tidal.actor.critic import Critic
from tidal.actor.trainer import train_on_rollout
from tidal.batching import BatchingConfig, pack

MODEL = dict(
    vocab_size=2048,
    hidden_size=512,
    intermediate_size=1536,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    tie_word_embeddings=True,
)
LENGTHS = (300, 280, 500, 450, 64, 90, 1200, 1000)
REWARDS = [1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 0.0, 1.0]


def grpo(out: dict, fast: dict, tokens: list, masks: list, estimator: str = "grpo") -> None:
    """GRPO, or another group estimator (``gspo``: the sequence ratio, per-sequence ids sent to the GPU)."""
    actor = Actor(ActorConfig(**fast, advantage_estimator=estimator))
    actor.reserve_offload_memory()  # pinned in the background; the offload below waits for it
    batching = BatchingConfig(
        rollout_batch_size=4, n_samples_per_prompt=2, use_dynamic_batch_size=True, max_tokens_per_gpu=4096
    )
    plain = pack(tokens)
    before = actor.compute_log_probs(plain)
    engine = [lp.tolist() for lp in torch.split(before, [len(t) for t in tokens])]  # an engine that agrees exactly
    m = train_on_rollout(
        actor, batching, tokens=tokens, loss_masks=masks, rewards=REWARDS, group_size=2, rollout_log_probs=engine
    )
    out[estimator] = {k: v for k, v in m.items() if k.startswith(("train/", "rollout/", "time/"))}
    out[f"{estimator}_max_logprob_change"] = float((actor.compute_log_probs(plain) - before).abs().max())
    out[f"{estimator}_offload"] = {**actor.offload(), **actor.onload()}


def two_step_batching(**kw) -> BatchingConfig:
    """4 prompts x 2 samples in two optimizer steps of dynamic micro-batches (2048 tokens)."""
    return BatchingConfig(
        rollout_batch_size=4,
        n_samples_per_prompt=2,
        num_steps_per_rollout=2,
        use_dynamic_batch_size=True,
        max_tokens_per_gpu=2048,
        **kw,
    )


def algorithms(out: dict, fast: dict, tokens: list, masks: list) -> None:
    """Every other estimator for one rollout (two optimizer steps, so the old log-probs come from their own pass),
    with a reference model, the KL loss and the KL reward penalty, and TIS against the engine's log-probs."""
    from tidal.actor import ReferenceModel

    batching = two_step_batching()
    keys = ("train/loss", "train/grad_norm", "train/kl", "train/pg_clipfrac", "rollout/logprob_abs_diff/max")
    for estimator in ("cispo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "gspo"):
        cfg = ActorConfig(
            **fast, advantage_estimator=estimator, use_kl_loss=True, kl_loss_coef=0.01, kl_coef=0.01, use_tis=True
        )
        try:
            actor = Actor(cfg)
            reference = ReferenceModel(cfg)
            before = actor.compute_log_probs(pack(tokens))
            engine = [lp.tolist() for lp in torch.split(before, [len(t) for t in tokens])]
            m = train_on_rollout(
                actor,
                batching,
                tokens=tokens,
                loss_masks=masks,
                rewards=REWARDS,
                group_size=2,
                rollout_log_probs=engine,
                reference=reference,
            )
            out[f"{estimator}_kl_tis"] = {k: m.get(k) for k in keys}
            del actor, reference
        except Exception as e:  # the next estimator still runs
            traceback.print_exc()
            out[f"{estimator}_kl_tis_error"] = repr(e)[:400]


def ppo(out: dict, fast: dict, tokens: list, masks: list, log_probs_budget: int | None = None) -> None:
    """PPO with a critic; ``log_probs_budget``: the forward-only passes on --log-probs-max-tokens-per-gpu."""
    cfg = ActorConfig(**fast, advantage_estimator="ppo", critic_lr=1e-4, value_clip=0.2, num_critic_only_steps=1)
    actor, critic = Actor(cfg), Critic(cfg)
    batching = two_step_batching(log_probs_max_tokens_per_gpu=log_probs_budget)
    kw = dict(tokens=tokens, loss_masks=masks, rewards=REWARDS, group_size=2, critic=critic)
    keys = ("critic/", "train/loss", "train/grad_norm", "train/critic_only", "batching/")
    name = "ppo" if log_probs_budget is None else f"ppo_log_probs_budget_{log_probs_budget}"
    out[name] = [
        {k: v for k, v in train_on_rollout(actor, batching, rollout_id=i, **kw).items() if k.startswith(keys)}
        for i in range(3)
    ]
    out[f"{name}_critic_offload"] = {**critic.offload(), **critic.onload()}


def main() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    init_distributed(rank=0, world_size=1, master_addr="127.0.0.1", master_port=port)
    g = torch.Generator().manual_seed(0)
    tokens = [torch.randint(0, MODEL["vocab_size"], (n,), generator=g).tolist() for n in LENGTHS]
    masks = [[0] * 20 + [1] * (len(t) - 20) for t in tokens]
    out: dict = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp, "model")
        B.save_checkpoint(MODEL, ckpt)
        fast = dict(hf_checkpoint=str(ckpt), params_dtype="bfloat16", fp32_main_params=True, lr=1e-4)
        budget = lambda *a: ppo(*a, log_probs_budget=8192)  # noqa: E731
        gspo = lambda *a: grpo(*a, estimator="gspo")  # noqa: E731
        cases = (("grpo", grpo), ("gspo", gspo), ("ppo", ppo), ("ppo_log_probs_budget", budget), ("algos", algorithms))
        for name, fn in cases:
            try:
                fn(out, fast, tokens, masks)
            except Exception as e:  # keep going: the report says what failed
                traceback.print_exc()
                out[f"{name}_error"] = repr(e)[:400]
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
