"""The app's own configuration section and the composed job configuration (standard library only)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tidal.actor import ActorConfig
    from tidal.batching import BatchingConfig
    from tidal.placement import PlacementConfig
    from tidal.rollout import RolloutConfig


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainConfig:
    """What the training loop itself owns: data, the number of rollouts, evaluation and outputs."""

    hf_checkpoint: str | None = None
    """HF model dir to start from; None builds (or reuses) the embedded default model (--hf-checkpoint)."""
    prompt_data: str | None = None
    """JSONL of training prompts; None uses the shipped addition task (--prompt-data)."""
    eval_prompt_data: str | None = None
    """JSONL of held-out prompts; None uses the shipped held-out addition prompts (--eval-prompt-data)."""
    input_key: str = "prompt"
    """Key of the prompt text in each JSONL record (--input-key)."""
    label_key: str = "label"
    """Key of the reference answer in each JSONL record (--label-key)."""
    num_rollout: int = 3
    """Rollouts to run (--num-rollout)."""
    eval_interval: int = 0
    """Evaluate on held-out prompts every this many rollouts, and before the first; 0 only before and after
    (--eval-interval)."""
    num_eval_prompts: int = 64
    """Held-out prompts per evaluation (--num-eval-prompts)."""
    save: str | None = None
    """Megatron checkpoint dir to save to; None saves into the run folder's ckpt/ (--save)."""
    save_interval: int = 0
    """Save a checkpoint every this many rollouts; 0 saves only at the end (--save-interval)."""
    output_dir: str = "runs/latest"
    """Run folder: metrics, logs, weights handed to SGLang, checkpoints (--output-dir)."""
    seed: int = 1234
    """Seed of data order and initialisation (--seed)."""

    def __post_init__(self) -> None:
        for flag, value, low in (
            ("--num-rollout", self.num_rollout, 1),
            ("--eval-interval", self.eval_interval, 0),
            ("--num-eval-prompts", self.num_eval_prompts, 1),
            ("--save-interval", self.save_interval, 0),
        ):
            if value < low:
                raise ValueError(f"{flag} must be >= {low}, got {value}")
        if not self.input_key or not self.label_key:
            raise ValueError("--input-key and --label-key must be non-empty")


@dataclass(frozen=True, kw_only=True, slots=True)
class JobConfig:
    """Every package's section, as the command line produced them; components receive only their own."""

    train: TrainConfig
    """The loop's own section."""
    placement: PlacementConfig
    """Where the actor and the engines run."""
    rollout: RolloutConfig
    """Generation and rewards."""
    batching: BatchingConfig
    """Batch arithmetic and micro-batching."""
    actor: ActorConfig
    """Model, optimizer and loss."""
