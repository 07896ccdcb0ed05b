"""The app's own configuration section and the composed job configuration (standard library only)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tidal.actor import ActorConfig
    from tidal.batching import BatchingConfig
    from tidal.ckpt import CkptConfig
    from tidal.placement import PlacementConfig
    from tidal.rollout import RolloutConfig


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainConfig:
    """What the training loop itself owns: data, the number of rollouts, evaluation and outputs."""

    hf_checkpoint: str | None = None
    """HF model dir to train (config.json, tokenizer, weights); None: the embedded tiny Qwen2, built on first use
    and cached."""
    prompt_data: str | None = None
    """JSONL of training prompts and labels (required; the embedded recipe gives the shipped addition task)."""
    eval_prompt_data: str | None = None
    """JSONL of held-out prompts; None: --prompt-data."""
    input_key: str = "prompt"
    """Key of the prompt text in each JSONL record."""
    label_key: str = "label"
    """Key of the reference answer in each JSONL record."""
    num_rollout: int = 3
    """Rollouts to run, counted from rollout 0 (a resumed run stops at the same place)."""
    start_rollout_id: int | None = None
    """First rollout id; None: 0, or the one after the rollout --load's checkpoint finished."""
    eval_interval: int = 0
    """Evaluate on held-out prompts every this many rollouts, and before the first; 0 only before and after."""
    num_eval_prompts: int = 64
    """Held-out prompts per evaluation."""
    output_dir: str | None = None
    """Run folder: metrics, logs, weights handed to SGLang, checkpoints; None: a new runs/DATE-TIME, which
    runs/latest links to."""
    overwrite_output_dir: bool = False
    """Let a new run write over an earlier run's records in --output-dir."""
    seed: int = 1234
    """Seed of data order and initialisation."""
    tensor_model_parallel_size: int = 1
    """Tensor-parallel size of the actor."""
    context_parallel_size: int = 1
    """Context-parallel size of the actor."""
    pipeline_model_parallel_size: int = 1
    """Pipeline stages of the actor, Megatron's 1F1B schedule."""
    update_weights_interval: int = 1
    """Hand the actor's weights to the engines every this many rollouts."""
    max_staleness: int = 0
    """Asynchronous training: rollouts are generated ahead of training by weights at most this many versions older
    than the actor's (0: synchronous, generate then train; >= 1 needs engines on their own GPUs, --no-colocate)."""
    update_weight_buffer_size: int = 512 * 1024**2
    """Bytes per weight-sync shard (the safetensors shard the engines reload)."""
    save_hf: str | None = None
    """Also write an HF checkpoint at every save; "{rollout_id}" in the path is filled in."""
    debug_rollout_only: bool = False
    """Generate and score only: no actor is built and nothing trains."""
    debug_train_only: bool = False
    """Train only, on rollouts saved by --save-debug-rollout-data: no engine starts."""
    use_tensorboard: bool = False
    """Write TensorBoard event files into the run folder's tensorboard/."""
    use_wandb: bool = False
    """Log to Weights & Biases in offline mode, into the run folder's wandb/."""
    wandb_project: str = "tidal"
    """W&B project name."""
    use_fault_tolerance: bool = False
    """Restart an engine that died during a rollout and retry its requests."""
    reward_sanity_rollouts: int = 3
    """Warn when every reward was identical for this many rollouts in a row; 0 disables."""
    mismatch_warn_threshold: float = 0.05
    """Warn when a rollout's mean |engine - actor log-prob| of the sampled tokens exceeds this many nats (bf16
    serving next to an fp32 actor sits around 0.005-0.015, same-precision serving near 0); 0 disables."""

    def __post_init__(self) -> None:
        for flag, value, low in (
            ("--num-rollout", self.num_rollout, 1),
            ("--eval-interval", self.eval_interval, 0),
            ("--num-eval-prompts", self.num_eval_prompts, 1),
            ("--tensor-model-parallel-size", self.tensor_model_parallel_size, 1),
            ("--context-parallel-size", self.context_parallel_size, 1),
            ("--pipeline-model-parallel-size", self.pipeline_model_parallel_size, 1),
            ("--update-weights-interval", self.update_weights_interval, 1),
            ("--max-staleness", self.max_staleness, 0),
            ("--reward-sanity-rollouts", self.reward_sanity_rollouts, 0),
            ("--update-weight-buffer-size", self.update_weight_buffer_size, 1),
        ):
            if value < low:
                raise ValueError(f"{flag} must be >= {low}, got {value}")
        if not self.mismatch_warn_threshold >= 0:  # NaN too
            value = self.mismatch_warn_threshold
            raise ValueError(f"--mismatch-warn-threshold must be >= 0 nats (0 disables the warning), got {value}")
        if self.start_rollout_id is not None and not 0 <= self.start_rollout_id < self.num_rollout:
            raise ValueError(
                f"--start-rollout-id must be in [0, --num-rollout={self.num_rollout}), got {self.start_rollout_id}"
            )
        if self.debug_rollout_only and self.debug_train_only:
            raise ValueError("--debug-rollout-only and --debug-train-only exclude each other; pick one")
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
    ckpt: CkptConfig
    """Where checkpoints are loaded from and saved to."""
