"""ActorConfig: the actor's own section of the training config (standard library only)."""

from __future__ import annotations

from dataclasses import dataclass, field

_DTYPES = ("float32", "bfloat16")
_KL_TYPES = ("k1", "k2", "k3")
_TIS_MODES = ("truncate", "mask")
_ADVANTAGE_ESTIMATORS = ("grpo", "rloo", "reinforce_plus_plus_baseline")


@dataclass(frozen=True, kw_only=True, slots=True)
class ActorConfig:
    """Model, optimizer and loss settings of the Megatron actor (parallel sizes go to ``init_distributed``)."""

    hf_checkpoint: str = field(metadata={"flag": None})
    """HF model dir (config.json + *.safetensors) the actor is built from and loads (``--hf-checkpoint``)."""
    params_dtype: str = "float32"
    """Parameter dtype: "float32" or "bfloat16"."""
    bf16: bool = False
    """On CUDA, run forward/backward under bf16 autocast with fp32 weights and Adam state."""
    fp32_main_params: bool = False
    """With a bf16/fp16 ``params_dtype``: keep fp32 main copies of the parameters for the optimizer (AdamW state,
    update and gradient accumulation in fp32; Megatron-style mixed precision)."""
    optimizer_cpu_offload: bool = False
    """Keep AdamW's moments in host memory and run the update on the CPU (``offload.CPUOffloadAdamW``): 8 bytes
    per parameter less GPU memory for a slower step."""
    fused_kernels: bool = field(default=True, metadata={"flag": None})
    """On CUDA, run q/k/v split + RoPE, SwiGLU, RMSNorm and the LM head's log-softmax/entropy as Triton kernels."""
    recompute_lm_head: bool = field(default=True, metadata={"flag": "--no-recompute-lm-head"})
    """Recompute each LM-head chunk's logits in backward (memory: one chunk) instead of keeping them (faster;
    memory ~2 bytes x tokens x vocab / tp per micro-batch: 10 GB at 32k tokens, 152k vocab)."""
    recompute_activations: bool = False
    """Recompute each transformer layer in backward instead of storing its activations."""
    lr: float = 1e-6
    """Peak learning rate."""
    lr_warmup_steps: int = field(default=0, metadata={"flag": "--lr-warmup-iters"})
    """Linear warm-up optimizer steps from 0 to ``lr``."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    adam_beta1: float = 0.9
    """AdamW beta1."""
    adam_beta2: float = 0.98
    """AdamW beta2."""
    adam_eps: float = 1e-8
    """AdamW epsilon."""
    clip_grad: float = 1.0
    """Global gradient-norm clip; 0 disables clipping."""
    eps_clip: float = 0.2
    """PPO lower clip range."""
    eps_clip_high: float | None = None
    """PPO upper clip range; None means equal to ``eps_clip``."""
    kl_loss_coef: float = 0.0
    """Weight of the KL-to-reference loss; needs "ref_log_probs" in the batch when non-zero."""
    kl_loss_type: str = "k3"
    """KL estimator: "k1", "k2" or "k3"."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus."""
    advantage_estimator: str = "grpo"
    """How rewards become advantages: grpo, rloo or reinforce_plus_plus_baseline."""
    disable_grpo_std_normalization: bool = False
    """GRPO without dividing by the group's reward std."""
    eps_clip_c: float | None = None
    """Dual-clip PPO bound for negative advantages, > 1; None: off."""
    use_kl_loss: bool = False
    """Add ``kl_loss_coef`` x KL(pi || pi_ref) to the loss."""
    kl_coef: float = 0.0
    """KL-to-reference penalty subtracted from each token's advantage (reward shaping)."""
    calculate_per_token_loss: bool = False
    """Mean the loss over every response token of the step; default: mean per sample, then over samples."""
    use_tis: bool = False
    """Truncated importance sampling between the engine's and the actor's old log-probs."""
    tis_clip: float = 2.0
    """Upper bound of the TIS weight."""
    tis_mode: str = "truncate"
    """What --use-tis does with a weight above --tis-clip: "truncate" lowers it to the bound (TIS), "mask" drops the
    token from the loss (MIS). With stale samples (--max-staleness) the weight is behaviour -> proximal policy, as in
    decoupled PPO."""
    check_for_nan_in_loss_and_grad: bool = field(default=True, metadata={"flag": "--no-check-for-nan-in-loss-and-grad"})
    """Stop with an error on a NaN/inf loss or gradient; False skips such steps with a warning."""
    log_probs_chunk_size: int = 1024
    """Tokens per LM-head chunk when computing log-probs (bounds logits memory)."""
    temperature: float = field(default=1.0, metadata={"flag": None})
    """Rollout sampling temperature; logits are divided by it before log-softmax (``--rollout-temperature``)."""

    def _check_model(self) -> None:
        if not self.hf_checkpoint:
            raise ValueError("--hf-checkpoint is required: point it at an HF model dir with config.json")
        if self.params_dtype not in _DTYPES:
            raise ValueError(f"--params-dtype must be one of {_DTYPES}, got {self.params_dtype!r}")
        if self.fp32_main_params and self.params_dtype == "float32":
            raise ValueError(
                "--fp32-main-params needs a half-precision --params-dtype (bfloat16), got --params-dtype float32; "
                "fp32 parameters are their own main copy: drop --fp32-main-params"
            )

    def __post_init__(self) -> None:
        self._check_model()
        for flag, value in (("--lr", self.lr), ("--weight-decay", self.weight_decay), ("--clip-grad", self.clip_grad)):
            if value < 0:
                raise ValueError(f"{flag} must be >= 0, got {value}")
        if self.lr_warmup_steps < 0:
            raise ValueError(f"--lr-warmup-iters must be >= 0, got {self.lr_warmup_steps}")
        for flag, value in (("--adam-beta1", self.adam_beta1), ("--adam-beta2", self.adam_beta2)):
            if not 0.0 <= value < 1.0:
                raise ValueError(f"{flag} must be in [0, 1), got {value}")
        if self.eps_clip <= 0 or (self.eps_clip_high is not None and self.eps_clip_high <= 0):
            raise ValueError(f"--eps-clip/--eps-clip-high must be > 0, got {self.eps_clip}/{self.eps_clip_high}")
        for flag, value, choices in (
            ("--kl-loss-type", self.kl_loss_type, _KL_TYPES),
            ("--advantage-estimator", self.advantage_estimator, _ADVANTAGE_ESTIMATORS),
            ("--tis-mode", self.tis_mode, _TIS_MODES),
        ):
            if value not in choices:
                raise ValueError(f"{flag} must be one of {choices}, got {value!r}")
        if self.eps_clip_c is not None and self.eps_clip_c <= 1.0:
            raise ValueError(f"--eps-clip-c must be > 1 (dual-clip bound), got {self.eps_clip_c}")
        if self.tis_clip <= 0:
            raise ValueError(f"--tis-clip must be > 0, got {self.tis_clip}")
        if self.kl_coef < 0 or self.kl_loss_coef < 0:
            raise ValueError(f"--kl-coef/--kl-loss-coef must be >= 0, got {self.kl_coef}/{self.kl_loss_coef}")
        if self.use_kl_loss and self.kl_loss_coef == 0.0:
            raise ValueError("--use-kl-loss needs a positive --kl-loss-coef (e.g. --kl-loss-coef 0.01)")
        if self.log_probs_chunk_size < 1:
            raise ValueError(f"--log-probs-chunk-size must be >= 1, got {self.log_probs_chunk_size}")
        if self.temperature <= 0:
            raise ValueError(f"--rollout-temperature must be > 0, got {self.temperature}")
