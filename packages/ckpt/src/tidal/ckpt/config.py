"""CkptConfig: where checkpoints are loaded from and saved to. Standard library only."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3
"""Hugging Face's usual shard size: 5 GiB."""


@dataclass(frozen=True, kw_only=True, slots=True)
class CkptConfig:
    """Checkpoint flags (slime's names, dashed, in the messages)."""

    load: str | None = None
    """Megatron checkpoint dir to resume the actor from; None starts from --hf-checkpoint."""
    ref_load: str | None = None
    """Megatron checkpoint dir of the reference model; None uses --hf-checkpoint."""
    critic_load: str | None = None
    """Megatron checkpoint dir (an earlier run's --save) whose critic starts --advantage-estimator ppo's critic; None:
    --hf-checkpoint's backbone with a new value head."""
    hf_checkpoint: str | None = field(default=None, metadata={"flag": None})
    """Hugging Face checkpoint dir: config.json, tokenizer, *.safetensors (--hf-checkpoint)."""
    ckpt_step: int | None = None
    """Iteration to load from --load instead of the one named by latest_checkpointed_iteration.txt."""
    no_load_optim: bool = False
    """Do not load optimizer (and LR scheduler) state from --load."""
    no_load_rng: bool = False
    """Do not load RNG states from --load; needed when the world size changed."""
    save: str | None = None
    """Directory to save Megatron checkpoints into; None saves none (`train` then saves into OUTPUT_DIR/ckpt)."""
    save_interval: int | None = None
    """Save every this many rollouts; None saves only at the end."""
    keep_last: int | None = None
    """Keep only the newest K iterations in --save; None keeps all."""
    keep_best_by: str | None = None
    """A metrics.jsonl key, higher is better (e.g. eval/accuracy): the saved iteration with its best value is named
    in best_checkpointed_iteration.txt and kept by --keep-last beyond its K."""
    async_save: bool = False
    """Write checkpoints in a background process; published at the next save or at exit."""
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES
    """Largest safetensors shard written for an HF checkpoint."""

    def __post_init__(self) -> None:
        for flag, value in (("--ckpt-step", self.ckpt_step),):
            if value is not None and value < 0:
                raise ValueError(f"{flag} must be >= 0, got {value}; pass an iteration number listed in --load")
        for flag, value in (("--save-interval", self.save_interval), ("--keep-last", self.keep_last)):
            if value is not None and value < 1:
                raise ValueError(f"{flag} must be >= 1, got {value}; leave it unset to disable it")
        if self.keep_best_by is not None and not self.keep_best_by.strip():
            raise ValueError("--keep-best-by must name a metrics.jsonl key such as eval/accuracy")
        if self.max_shard_bytes < 1:
            raise ValueError(f"--max-shard-bytes must be >= 1, got {self.max_shard_bytes}")
        if self.ckpt_step is not None and self.load is None:
            raise ValueError(f"--ckpt-step {self.ckpt_step} has no effect without --load; set --load DIR or drop it")
        if self.save_interval is not None and self.save is None:
            raise ValueError(f"--save-interval {self.save_interval} needs --save DIR to write checkpoints into")
        if self.async_save and self.save is None:
            logger.warning("--async-save has no effect without --save")
        if self.load is None and (self.no_load_optim or self.no_load_rng):
            logger.warning("--no-load-optim/--no-load-rng have no effect without --load")
