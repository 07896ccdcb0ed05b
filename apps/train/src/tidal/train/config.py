"""The app's own configuration section and the composed job configuration (standard library only)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from tidal.train.sft_config import SftConfig

if TYPE_CHECKING:
    from tidal.actor import ActorConfig, MemoryChoice
    from tidal.batching import BatchingConfig
    from tidal.ckpt import CkptConfig
    from tidal.placement import PlacementConfig
    from tidal.rollout import RolloutConfig


WEIGHT_TRANSPORTS = ("tensor", "nccl", "disk")
"""The values of --update-weight-transport."""
WANDB_MODES = ("online", "offline", "disabled")
"""The values of --wandb-mode."""
APP_SECTIONS = ("eval", "parallel", "sync", "offload", "logging", "sft")
"""The app's sections besides ``train``, each its own config (JobConfig has one attribute per section)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainConfig:
    """What the training loop itself owns: the model and data, the number of rollouts, outputs and modes."""

    hf_checkpoint: str | None = None
    """HF model dir to train (config.json, tokenizer, weights); None: the embedded tiny Qwen2, built on first use
    and cached."""
    prompt_data: tuple[str, ...] | None = field(default=None, metadata={"metavar": "PATH[:WEIGHT]"})
    """Training prompts and labels (required; the embedded recipe gives the shipped addition task): JSONL, JSON or
    Parquet files, globs of them, or datasets save_to_disk folders; several sources with weights are mixed
    (a.parquet:0.7 b.jsonl:0.3), several without are read end to end."""
    input_key: str = "prompt"
    """Key path of the prompt in each row (nested: prompt.0.content); a list of chat messages is rendered with the
    chat template."""
    label_key: str = "label"
    """Key path of the reference answer in each row (nested: reward_model.ground_truth)."""
    tool_key: str = "tools"
    """Key of a row's tool list, given to the chat template with its messages (rows without it: no tools)."""
    metadata_key: str | None = None
    """Key path of a row's value handed to reward functions as sample.metadata (agent functions get the whole
    row); None: none."""
    environment: str | None = field(default=None, metadata={"metavar": "KIND:NAME"})
    """Train on an environment of another library, unmodified: verifiers:NAME (a verifiers taskset id or module;
    needs tidal-train[environments]). Its tasks are the prompts and the held-out set, its episodes run as agents
    through the gateway, its rubric is the reward; None: none."""
    num_rollout: int = 3
    """Rollouts to run, counted from rollout 0 (a resumed run stops at the same place)."""
    start_rollout_id: int | None = None
    """First rollout id; None: 0, or the one after the rollout --load's checkpoint finished."""
    output_dir: str | None = None
    """Run folder: metrics, logs, weights handed to SGLang, checkpoints; None: a new runs/DATE-TIME, which
    runs/latest links to."""
    overwrite_output_dir: bool = False
    """Let a new run write over an earlier run's records in --output-dir."""
    seed: int = 1234
    """Seed of data order and initialisation."""
    max_staleness: int = 0
    """Asynchronous training: rollouts are generated ahead of training by weights at most this many versions older
    than the actor's (0: synchronous, generate then train; >= 1 needs engines on their own GPUs, --no-colocate)."""
    save_hf: str | None = None
    """Also write an HF checkpoint at every save (with --lora-rank: the adapters as a PEFT folder, which
    `train convert --lora-adapter` merges); "{rollout_id}" in the path is filled in."""
    debug_rollout_only: bool = False
    """Generate and score only: no actor is built and nothing trains."""
    debug_train_only: bool = False
    """Train only, on rollouts saved by --save-debug-rollout-data: no engine starts."""
    use_fault_tolerance: bool = False
    """Restart an engine that died, give it the actor's current weights, then resend its requests."""

    def __post_init__(self) -> None:
        _at_least(("--num-rollout", self.num_rollout, 1), ("--max-staleness", self.max_staleness, 0))
        if self.start_rollout_id is not None and not 0 <= self.start_rollout_id < self.num_rollout:
            raise ValueError(
                f"--start-rollout-id must be in [0, --num-rollout={self.num_rollout}), got {self.start_rollout_id}"
            )
        if self.debug_rollout_only and self.debug_train_only:
            raise ValueError("--debug-rollout-only and --debug-train-only exclude each other; pick one")
        if not self.input_key or not self.label_key:
            raise ValueError("--input-key and --label-key must be non-empty")


@dataclass(frozen=True, kw_only=True, slots=True)
class EvalConfig:
    """Held-out evaluation: which sets, how often, how sampled."""

    eval_prompt_data: tuple[str, ...] | None = field(default=None, metadata={"metavar": "[NAME] PATH"})
    """Held-out prompt sets (read as --prompt-data, without weights): one PATH (named by its file stem), or NAME
    PATH [NAME PATH ...] as slime; None: each --prompt-data source. The first set's mean@k is also logged as
    eval/accuracy."""
    eval_interval: int = 0
    """Evaluate on held-out prompts every this many rollouts, and before the first; 0 only before and after."""
    num_eval_prompts: int = 64
    """Held-out prompts per evaluation, of each eval set."""
    n_samples_per_eval_prompt: int = 1
    """Responses sampled per held-out prompt (k of mean@k and pass@k)."""
    eval_temperature: float = 0.0
    """Sampling temperature of evaluation (0: greedy)."""
    eval_top_p: float = 1.0
    """Top-p of evaluation sampling."""
    eval_max_response_len: int | None = None
    """Most tokens an evaluation response may have; None: --rollout-max-response-len."""

    def __post_init__(self) -> None:
        _at_least(
            ("--eval-interval", self.eval_interval, 0),
            ("--num-eval-prompts", self.num_eval_prompts, 1),
            ("--n-samples-per-eval-prompt", self.n_samples_per_eval_prompt, 1),
            ("--eval-max-response-len", self.eval_max_response_len or 1, 1),
        )
        if self.eval_temperature < 0 or not 0 < self.eval_top_p <= 1:
            got = f"{self.eval_temperature}/{self.eval_top_p}"
            raise ValueError(f"--eval-temperature must be >= 0 and --eval-top-p in (0, 1], got {got}")
        if self.eval_prompt_data is not None:
            eval_sets(self.eval_prompt_data)


@dataclass(frozen=True, kw_only=True, slots=True)
class ParallelConfig:
    """The actor's parallel layout (each engine's is --rollout-num-gpus-per-engine)."""

    tensor_model_parallel_size: int = 1
    """Tensor-parallel size of the actor."""
    context_parallel_size: int = 1
    """Context-parallel size of the actor."""
    pipeline_model_parallel_size: int = 1
    """Pipeline stages of the actor, Megatron's 1F1B schedule."""
    expert_model_parallel_size: int = 1
    """Mixture-of-experts models: the actor's ranks of a pipeline stage split each MoE layer's experts this many ways
    (tokens exchanged all-to-all); divides the experts and the GPUs of a stage."""
    expert_tensor_parallel_size: int = 1
    """Tensor-parallel size inside each expert; only 1 (the experts are split by --expert-model-parallel-size)."""

    def __post_init__(self) -> None:
        _at_least(
            ("--tensor-model-parallel-size", self.tensor_model_parallel_size, 1),
            ("--context-parallel-size", self.context_parallel_size, 1),
            ("--pipeline-model-parallel-size", self.pipeline_model_parallel_size, 1),
            ("--expert-model-parallel-size", self.expert_model_parallel_size, 1),
        )
        if self.expert_tensor_parallel_size != 1:
            raise ValueError(
                f"--expert-tensor-parallel-size {self.expert_tensor_parallel_size} is not supported (only 1): split "
                "the experts with --expert-model-parallel-size instead"
            )


@dataclass(frozen=True, kw_only=True, slots=True)
class WeightSyncConfig:
    """How and how often the actor's weights reach the engines, and the check after each sync."""

    update_weights_interval: int = 1
    """Hand the actor's weights to the engines every this many rollouts."""
    update_weight_transport: str | None = None
    """How new weights reach the engines: "tensor" (in-memory handles, CUDA IPC on GPU; co-located engines only),
    "nccl" (the actor's rank 0 broadcasts buckets to every engine rank; gloo on CPU) or "disk" (an HF checkpoint
    each engine reloads); None: tensor with --colocate, nccl without it or with --rollout-external-engine-addrs."""
    update_weight_buffer_size: int = 512 * 1024**2
    """Bytes per weight-sync bucket (tensor, nccl) or safetensors shard (disk)."""
    update_weight_timeout: float = 600.0
    """Seconds one weight sync may take (group rendezvous, broadcasts, the engines' answers) before the run stops
    with one error naming the engines."""
    update_weight_delta: bool = False
    """Each weight sync sends only the elements whose value in the engines' dtype changed since the version they
    serve, checked by a checksum per tensor (every transport); costs one host copy of the weights."""
    check_weight_update_equal: bool = False
    """After every weight sync, compare the engines' log-probs on a fixed probe (the first training prompts) with
    the actor's, record the gap and stop when its mean exceeds --check-weight-update-tolerance."""
    check_weight_update_tolerance: float = 0.05
    """Largest mean |engine - actor| log-prob gap (nats) --check-weight-update-equal accepts (bf16 serving next to
    an fp32 actor sits around 0.005-0.015, fp32 serving below 1e-3)."""

    def __post_init__(self) -> None:
        _at_least(
            ("--update-weights-interval", self.update_weights_interval, 1),
            ("--update-weight-buffer-size", self.update_weight_buffer_size, 1),
        )
        if self.update_weight_transport not in (None, *WEIGHT_TRANSPORTS):
            raise ValueError(
                f"--update-weight-transport must be one of {', '.join(WEIGHT_TRANSPORTS)}, "
                f"got {self.update_weight_transport!r}"
            )
        for flag, value in (
            ("--update-weight-timeout", self.update_weight_timeout),
            ("--check-weight-update-tolerance", self.check_weight_update_tolerance),
        ):
            if not value > 0:  # NaN too
                raise ValueError(f"{flag} must be > 0, got {value}")


@dataclass(frozen=True, kw_only=True, slots=True)
class OffloadConfig:
    """What leaves the GPU while the other side runs (co-located actor and engines)."""

    offload: bool | None = None
    """Offload both the actor and the engines (each also has its own option, which wins); None: on with --colocate
    and engines this job launches."""
    offload_train: bool | None = None
    """Move the actor's parameters, gradients and optimizer state off the GPU while the engines generate, back
    before training; None: --offload."""
    offload_rollout: bool | None = None
    """Have the engines release their weights and KV cache while the actor trains (resumed before generation:
    weights, then the sync, then the KV cache; frees GPU memory with --sglang-enable-memory-saver); None: --offload."""


@dataclass(frozen=True, kw_only=True, slots=True)
class LogConfig:
    """Where metrics go, what the terminal shows, and the warnings a run raises about itself."""

    use_tensorboard: bool = False
    """Write TensorBoard event files into the run folder's tensorboard/."""
    use_wandb: bool = False
    """Log every rollout's metrics to a Weights & Biases run, kept in the run folder's wandb/ (summary.json says
    where the run is: its URL online, its folder offline)."""
    wandb_mode: str | None = None
    """W&B mode: "online" (the key from WANDB_API_KEY or `wandb login`; there is no key flag, which would land in
    config.yaml and `ps`), "offline" (upload later with `wandb sync`) or "disabled"; None: $WANDB_MODE, else online."""
    wandb_project: str = "tidal"
    """W&B project name."""
    wandb_group: str | None = None
    """W&B group of the run (runs of one experiment side by side); None: no group."""
    wandb_host: str | None = None
    """URL of the W&B server (self-hosted W&B); None: $WANDB_BASE_URL, else https://api.wandb.ai."""
    verbose: bool = field(default=False, metadata={"short": "-v"})
    """Also show every process's INFO log lines on the terminal (generation progress, weight-sync timings,
    checkpoint writes); they are always in the run folder's logs/."""
    reward_sanity_rollouts: int = 3
    """Warn when every reward was identical for this many rollouts in a row; 0 disables."""
    mismatch_warn_threshold: float = 0.05
    """Warn when a rollout's mean |engine - actor log-prob| of the sampled tokens exceeds this many nats (bf16
    serving next to an fp32 actor sits around 0.005-0.015, same-precision serving near 0); 0 disables."""

    def __post_init__(self) -> None:
        _at_least(("--reward-sanity-rollouts", self.reward_sanity_rollouts, 0))
        if self.wandb_mode not in (None, *WANDB_MODES):
            raise ValueError(f"--wandb-mode must be one of {', '.join(WANDB_MODES)}, got {self.wandb_mode!r}")
        if not self.mismatch_warn_threshold >= 0:  # NaN too
            value = self.mismatch_warn_threshold
            raise ValueError(f"--mismatch-warn-threshold must be >= 0 nats (0 disables the warning), got {value}")


def _at_least(*checks: tuple[str, float, float]) -> None:
    """Raise naming the first ``(flag, value, low)`` whose value is below ``low``."""
    for flag, value, low in checks:
        if value < low:
            raise ValueError(f"{flag} must be >= {low}, got {value}")


def eval_sets(value: str | Sequence[str]) -> list[tuple[str, str]]:
    """``(name, path)`` of each held-out set of ``--eval-prompt-data``: ``PATH`` or ``NAME PATH [NAME PATH ...]``.

    Raises:
        ValueError: an odd number of values beyond one, or a name given twice.
    """
    values = [value] if isinstance(value, str) else list(value)
    if len(values) == 1:
        return [(Path(values[0]).stem or "eval", values[0])]
    if not values or len(values) % 2:
        raise ValueError(
            f"--eval-prompt-data takes PATH or NAME PATH [NAME PATH ...], got {len(values)} values: {values}"
        )
    sets = list(zip(values[::2], values[1::2], strict=True))
    names = [name for name, _ in sets]
    if len(set(names)) != len(names) or any("/" in name for name in names):
        raise ValueError(f"--eval-prompt-data names must be distinct and contain no '/', got {names}")
    return sets


def held_out_sets(eval_prompt_data: Sequence[str] | None, prompt_data: Sequence[str] | None) -> list[tuple[str, str]]:
    """``--eval-prompt-data``'s sets; unset: each ``--prompt-data`` source, its weight dropped, named by its stem."""
    if eval_prompt_data:
        return eval_sets(eval_prompt_data)
    from tidal.train.data_sources import split_weight

    sets: list[tuple[str, str]] = []
    for spec in prompt_data or ():
        path, _ = split_weight(spec)
        name = re.sub(r"[^\w.-]", "_", Path(path).stem) or "eval"
        sets.append((name if name not in dict(sets) else f"{name}_{len(sets)}", path))
    return sets


def eval_metric_keys(train: TrainConfig, evaluation: EvalConfig) -> list[str]:
    """The ``eval/...`` keys an evaluation of the held-out sets records (as ``RolloutManager.evaluate``)."""
    from tidal.train.metrics import pass_ks

    n = evaluation.n_samples_per_eval_prompt
    keys = ["eval/accuracy"]
    for name, _ in held_out_sets(evaluation.eval_prompt_data, train.prompt_data):
        keys += [f"eval/{name}/mean@{n}", *(f"eval/{name}/pass@{k}" for k in pass_ks(n))]
    return keys


@dataclass(frozen=True, kw_only=True, slots=True)
class JobConfig:
    """Every package's section, as the command line produced them; components receive only their own."""

    train: TrainConfig
    """The loop's own section: model, data, rollouts, outputs."""
    eval: EvalConfig
    """Held-out evaluation."""
    parallel: ParallelConfig
    """The actor's parallel layout."""
    sync: WeightSyncConfig
    """Weight sync to the engines."""
    offload: OffloadConfig
    """GPU memory handed between the actor and the engines."""
    logging: LogConfig
    """Metrics sinks, terminal, self-warnings."""
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
    sft: SftConfig = field(default_factory=SftConfig)
    """The stage (RL or SFT) and the SFT stage's data."""
    memory_choice: MemoryChoice | None = field(default=None, compare=False)
    """What ``auto`` budgets and recompute resolved to (tidal.train.auto_memory), for the run folder; None: none
    was ``auto``. A record, not an option: two jobs with the same options are equal whatever chose them."""
