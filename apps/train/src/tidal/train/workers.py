"""Ray actors that host the packages' components on their placement bundles.

They only hold handles and forward calls: the trainer's work is tidal.actor's and tidal.batching's, the engine's
is tidal.rollout's. Each process sets its own log format (``[tidal actor r0] ...``).
"""

from __future__ import annotations

import logging
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray

LOG_FORMAT = "[tidal {role}] %(asctime)s %(levelname)s %(name)s: %(message)s"


def setup_logging(role: str, level: int = logging.INFO) -> None:
    """One log format per process, naming its role; quiet third-party chatter."""
    logging.basicConfig(level=level, format=LOG_FORMAT.format(role=role), datefmt="%H:%M:%S", force=True)
    # megatron-core announces at import every optional accelerator library it did not find; tidal needs none.
    warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex|absl).*", category=UserWarning)
    warnings.filterwarnings("ignore", category=SyntaxWarning, module=r"megatron\..*")
    warnings.filterwarnings("ignore", message=r".*full scope is deprecated.*")
    for noisy in ("urllib3", "filelock", "httpx", "matplotlib"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


@dataclass(frozen=True, kw_only=True, slots=True)
class RolloutData:
    """What the trainer needs of one rollout, in plain Python types (crosses the Ray boundary)."""

    tokens: list[list[int]]
    """Prompt + response token ids of each sample."""
    loss_masks: list[list[int]]
    """0 on prompt tokens, 1 on response tokens."""
    rollout_log_probs: list[list[float]]
    """Per-token log-probs from the engine, in tidal's convention (0 on prompt tokens)."""
    rewards: list[float]
    """Scalar reward of each sample."""
    group_size: int
    """Samples per prompt (consecutive samples form one group)."""


@ray.remote
class ActorWorker:
    """One rank of the Megatron actor (tidal.actor) on its bundle."""

    def __init__(
        self, actor_cfg, batching_cfg, *, rank: int, world_size: int, master_addr: str, master_port: int, seed: int
    ) -> None:
        setup_logging(f"actor r{rank}")
        from tidal.actor import Actor, init_distributed

        init_distributed(rank=rank, world_size=world_size, master_addr=master_addr, master_port=master_port, seed=seed)
        self.rank = rank
        self.world_size = world_size
        self.batching_cfg = batching_cfg
        self.actor = Actor(actor_cfg)

    def ready(self) -> bool:
        """True once the model is built and loaded (the constructor finished)."""
        return True

    def train(self, rollout: RolloutData) -> dict[str, float]:
        """Old log-probs, advantages, then the rollout's optimizer steps; metrics of the rollout."""
        from tidal.actor.trainer import train_on_rollout

        return train_on_rollout(
            self.actor,
            self.batching_cfg,
            tokens=rollout.tokens,
            loss_masks=rollout.loss_masks,
            rewards=rollout.rewards,
            group_size=rollout.group_size,
            rollout_log_probs=rollout.rollout_log_probs,
            rank=self.rank,
            dp_size=self.world_size,
        )

    def save_hf(self, out_dir: str, source_dir: str) -> str:
        """Write the current weights as an HF checkpoint (rank 0 writes; every rank gathers TP shards)."""
        from tidal.ckpt import save_hf_checkpoint

        tensors = self.actor.named_hf_tensors()
        if self.rank != 0:
            for _ in tensors:
                pass
            return out_dir
        return str(save_hf_checkpoint(out_dir, tensors, source_dir=source_dir))

    def save_checkpoint(self, save_dir: str, iteration: int, common_state: dict[str, Any]) -> str:
        """Save a Megatron checkpoint (every rank takes part)."""
        from tidal.ckpt import save_checkpoint

        return str(save_checkpoint(save_dir, iteration, self.actor.sharded_state_dict(), common_state=common_state))


@ray.remote
class EngineWorker:
    """One SGLang server (tidal.rollout) started from its bundle, so it sees the bundle's GPUs."""

    def __init__(
        self,
        model_path: str,
        *,
        host: str,
        port: int,
        nccl_port: int,
        log_dir: str,
        rollout_cfg,
        env: dict[str, str] | None = None,
    ) -> None:
        setup_logging(f"engine {port}")
        from tidal.rollout import SGLangEngine

        env = dict(env or {})
        if os.environ.get("CUDA_VISIBLE_DEVICES"):
            env.setdefault("CUDA_VISIBLE_DEVICES", os.environ["CUDA_VISIBLE_DEVICES"])
        self.engine = SGLangEngine(
            model_path,
            host=host,
            port=port,
            nccl_port=nccl_port,
            log_dir=Path(log_dir),
            extra_server_args=rollout_cfg.sglang_server_args,
            startup_timeout_s=rollout_cfg.sglang_startup_timeout_s,
            request_timeout_s=rollout_cfg.sglang_request_timeout_s,
            env=env,
        )
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_path)

    def start(self) -> str:
        """Launch the server and wait until it is healthy; returns its URL."""
        self.engine.start(wait=True)
        return self.engine.url

    def pid(self) -> int | None:
        """Process id of the server (its process group leader)."""
        return self.engine.pid

    def generate_samples(self, prompts: list[list[int]], sampling_params: dict[str, Any], labels: list) -> list:
        """One batched generation wrapped as unscored Samples (tidal.rollout.generate_samples)."""
        from tidal.rollout import generate_samples

        return generate_samples(self.engine, prompts, sampling_params, labels=labels, decode=self._decode)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def update_weights_from_disk(self, path: str, weight_version: str) -> None:
        """Reload weights from an HF checkpoint directory and flush the prefix cache."""
        self.engine.update_weights_from_disk(path, weight_version=weight_version)
        self.engine.flush_cache()

    def shutdown(self) -> None:
        """Stop the server and every process it started."""
        self.engine.shutdown()
