"""The Ray actor that hosts one rank of the trainer on its placement bundle, and what it trains on.

It only holds handles and forwards calls: the trainer's work is tidal.actor's and tidal.batching's, the checkpoint
IO tidal.ckpt's (the engines' actor is ``engine_worker.EngineWorker``). Each process sets its own log format
(``[tidal actor r0] ...``).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import ray
from tidal.train.logs import LogPlan, setup_logging
from tidal.train.weight_sync.adapter import AdapterSender
from tidal.train.weight_sync.delta import DeltaSender
from tidal.train.weight_sync.sender import WeightSender

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class RolloutData:
    """What the trainer needs of one rollout, in plain Python types (crosses the Ray boundary)."""

    tokens: list[list[int]]
    """Prompt + response token ids of each sample."""
    loss_masks: list[list[int]]
    """0 on prompt tokens, 1 on response tokens."""
    rollout_log_probs: list[list[float]]
    """Per-token log-probs from the engine, in tidal's convention (0 on prompt tokens); empty: none (SFT)."""
    rewards: list[float]
    """Scalar reward of each sample."""
    group_size: int
    """Samples per prompt (consecutive samples form one group)."""
    rollout_id: int = 0
    """The rollout's index (the actor waits during the first --num-critic-only-steps)."""
    routed_experts: list | None = None
    """Per sample, the engine's expert ids of every token but the last (--use-rollout-routing-replay), else None."""
    episode_ids: list[int] | None = None
    """Each sample's agent episode when one gave several samples (its trajectories), else None."""


@ray.remote
class ActorWorker(WeightSender, AdapterSender, DeltaSender):
    """One rank of the Megatron actor (tidal.actor) on its bundle, with its checkpoint IO (tidal.ckpt)."""

    def __init__(
        self,
        actor_cfg,
        batching_cfg,
        ckpt_cfg,
        *,
        rank: int,
        world_size: int,
        master_addr: str,
        master_port: int,
        seed: int,
        tensor_model_parallel_size: int = 1,
        context_parallel_size: int = 1,
        pipeline_model_parallel_size: int = 1,
        expert_model_parallel_size: int = 1,
        log: LogPlan | None = None,
    ) -> None:
        setup_logging(f"actor r{rank}", log)
        _limit_cpu_threads()
        from tidal.actor import Actor, init_distributed
        from tidal.ckpt import CheckpointIO

        init_distributed(
            rank=rank,
            world_size=world_size,
            master_addr=master_addr,
            master_port=master_port,
            seed=seed,
            tensor_model_parallel_size=tensor_model_parallel_size,
            context_parallel_size=context_parallel_size,
            pipeline_model_parallel_size=pipeline_model_parallel_size,
            expert_model_parallel_size=expert_model_parallel_size,
        )
        self.dp_size = world_size // (tensor_model_parallel_size * context_parallel_size * pipeline_model_parallel_size)
        self.rank = rank
        self.batching_cfg = batching_cfg
        self.hf_checkpoint = actor_cfg.hf_checkpoint
        self.checkpoints = CheckpointIO.from_config(ckpt_cfg)
        # HF weights are read once, by rank 0 (broadcast to the others), and not at all where --load overwrites them:
        # the reference and the critic copy the actor's when they start from the same checkpoint.
        resume = bool(ckpt_cfg.load)
        self.actor = Actor(actor_cfg, weights="checkpoint" if resume else "hf")
        self.reference = None
        if (actor_cfg.kl_loss_coef > 0 or actor_cfg.kl_coef > 0) and actor_cfg.lora_rank:
            from tidal.actor import BaseReference  # the base model: the actor with its adapters off

            self.reference = BaseReference(self.actor)
        elif actor_cfg.kl_loss_coef > 0 or actor_cfg.kl_coef > 0:  # frozen, offloaded to CPU between rollouts
            from tidal.actor import ReferenceModel

            lend = None if resume else self.actor  # --load does not hold the reference: from HF or --ref-load
            self.reference = ReferenceModel(actor_cfg, load_dir=ckpt_cfg.ref_load, weights_from=lend)
        self.critic = None
        if actor_cfg.advantage_estimator == "ppo":  # a second model on the same GPUs, with its own optimizer
            from tidal.actor import Critic

            weights = "checkpoint" if resume else self.actor  # --load holds the critic too
            self.critic = Critic(actor_cfg, load_dir=ckpt_cfg.critic_load, weights=weights)

    def ready(self) -> bool:
        """True once the model is built and loaded (the constructor finished)."""
        return True

    def train(self, rollout: RolloutData) -> dict[str, float]:
        """Old log-probs, advantages, then the rollout's optimizer steps; metrics of the rollout."""
        from tidal.actor import train_on_rollout

        return train_on_rollout(
            self.actor,
            self.batching_cfg,
            tokens=rollout.tokens,
            loss_masks=rollout.loss_masks,
            rewards=rollout.rewards,
            group_size=rollout.group_size,
            rollout_log_probs=rollout.rollout_log_probs or None,
            rank=_dp_rank(),
            dp_size=self.dp_size,
            reference=self.reference,
            critic=self.critic,
            rollout_id=rollout.rollout_id,
            routed_experts=rollout.routed_experts,
            episode_ids=rollout.episode_ids,
        )

    def nll(self, tokens: list[list[int]], loss_masks: list[list[int]]) -> tuple[float, float]:
        """``(sum of -log p over the loss tokens, their count)``; every rank computes every sequence (collectives)."""
        from tidal.batching import pack_micro_batches, plan_from_config

        plan = plan_from_config(self.batching_cfg, [len(t) for t in tokens], dp_size=1, forward_only=True)
        batches = pack_micro_batches(
            plan, 0, tokens, loss_masks=loss_masks, pad_to_multiple_of=self.batching_cfg.pad_to_multiple_of
        )
        total = count = 0.0
        for batch in batches:
            log_probs = self.actor.compute_log_probs(batch)
            total -= float((log_probs * batch.loss_mask).sum())
            count += float(batch.loss_mask.sum())
        return total, count

    def save_hf(self, out_dir: str, max_shard_bytes: int | None = None) -> str:
        """Write the current weights as an HF checkpoint beside --hf-checkpoint's config and tokenizer.

        With LoRA: the adapters alone, as a PEFT folder (adapter_config.json + adapter_model.safetensors). Rank 0
        writes (shards of ``max_shard_bytes``, default --max-shard-bytes); every rank gathers TP shards.
        """
        if self.actor.lora is not None:  # a PEFT adapter folder (train convert merges it into the base)
            from tidal.actor import gather_adapter_tensors, peft_adapter_config, write_peft_adapter

            adapters = gather_adapter_tensors(self.actor.lora)
            if self.rank == 0:
                config = peft_adapter_config(self.actor.lora.settings, base_model=self.hf_checkpoint)
                write_peft_adapter(out_dir, adapters, config)
            return out_dir
        tensors = self.actor.named_hf_tensors()
        if self.rank != 0:
            for _ in tensors:
                pass
            return out_dir
        return self.checkpoints.save_hf(
            out_dir, tensors, source_dir=self.hf_checkpoint, max_shard_bytes=max_shard_bytes
        )

    def reserve_offload_memory(self) -> None:
        """Pin the host memory the offloads will use, in the background (CUDA only): called while engines start."""
        self.actor.reserve_offload_memory()
        if self.critic:
            self.critic.reserve_offload_memory()

    def offload(self) -> dict[str, float]:
        """Parameters, gradients and optimizer state (the critic's too) to host memory while the engines generate."""
        return self.actor.offload() | (self.critic.offload() if self.critic else {})

    def onload(self) -> dict[str, float]:
        """Back onto the device, before training."""
        return self.actor.onload() | (self.critic.onload() if self.critic else {})

    def on_gpu(self) -> bool:
        """Whether this rank computes on a GPU (its tensor-transport handles are CUDA IPC ones, else shared memory)."""
        return next(iter(self.actor.params)).is_cuda

    def save_checkpoint(self, iteration: int, common_state: dict[str, Any]) -> str:
        """Save model, optimizer (the critic's too) and this rank's RNG states into --save (every rank takes part)."""
        state = self.actor.sharded_state_dict()
        if self.critic:
            state |= self.critic.checkpoint_sections()
        return self.checkpoints.save(iteration, state, common_state=common_state)

    def finalize_saves(self) -> list[str]:
        """Wait for a pending --async-save to be durable and published (every rank calls it)."""
        return self.checkpoints.finalize()

    def load_checkpoint(self) -> dict[str, Any]:
        """Load --load (model, optimizer unless --no-load-optim, RNG unless --no-load-rng); its common state."""
        state = self.actor.sharded_state_dict(with_optimizer=self.checkpoints.load_optimizer)
        if self.critic:
            state |= self.critic.checkpoint_sections(with_optimizer=self.checkpoints.load_optimizer)
        loaded, common = self.checkpoints.load(state)
        self.actor.load_state_dict(loaded)
        if self.critic:
            self.critic.load_checkpoint_sections(loaded)
        return common


def _limit_cpu_threads() -> None:
    """Without CUDA, one torch thread per actor rank (or ``OMP_NUM_THREADS``).

    Ray leaves an actor without a CPU reservation free to start one thread per core, and on a small CPU machine
    those threads spin against the SGLang server's: the actor's step ran 10-30x slower than single-threaded.
    """
    import torch

    if not torch.cuda.is_available():
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))


def _dp_rank() -> int:
    from tidal.actor import data_parallel_rank_and_size

    return data_parallel_rank_and_size()[0]
