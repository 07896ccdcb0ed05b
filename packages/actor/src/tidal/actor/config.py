"""ActorConfig: the actor's own section of the training config (standard library only)."""

from __future__ import annotations

from dataclasses import dataclass

_DTYPES = ("float32", "bfloat16")
_KL_TYPES = ("k1", "k2", "k3")


@dataclass(frozen=True, kw_only=True, slots=True)
class ActorConfig:
    """Model, optimizer and loss settings of the Megatron actor (parallel sizes go to ``init_distributed``)."""

    hf_checkpoint: str
    """HF model dir (config.json + *.safetensors) the actor is built from and loads (``--hf-checkpoint``)."""
    params_dtype: str = "float32"
    """Parameter dtype: "float32" or "bfloat16" (``--params-dtype``)."""
    bf16: bool = False
    """On CUDA, run forward/backward under bf16 autocast with fp32 weights and Adam state (``--bf16``)."""
    recompute_activations: bool = False
    """Recompute each transformer layer in backward instead of storing its activations (``--recompute-activations``)."""
    lr: float = 1e-6
    """Peak learning rate (``--lr``)."""
    lr_warmup_steps: int = 0
    """Linear warm-up optimizer steps from 0 to ``lr`` (``--lr-warmup-iters``)."""
    weight_decay: float = 0.0
    """AdamW weight decay (``--weight-decay``)."""
    adam_beta1: float = 0.9
    """AdamW beta1 (``--adam-beta1``)."""
    adam_beta2: float = 0.98
    """AdamW beta2 (``--adam-beta2``)."""
    adam_eps: float = 1e-8
    """AdamW epsilon (``--adam-eps``)."""
    clip_grad: float = 1.0
    """Global gradient-norm clip; 0 disables clipping (``--clip-grad``)."""
    eps_clip: float = 0.2
    """PPO lower clip range (``--eps-clip``)."""
    eps_clip_high: float | None = None
    """PPO upper clip range; None means equal to ``eps_clip`` (``--eps-clip-high``)."""
    kl_loss_coef: float = 0.0
    """Weight of the KL-to-reference loss; needs "ref_log_probs" in the batch when non-zero (``--kl-loss-coef``)."""
    kl_loss_type: str = "k3"
    """KL estimator: "k1", "k2" or "k3" (``--kl-loss-type``)."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus (``--entropy-coef``)."""
    log_probs_chunk_size: int = 1024
    """Tokens per LM-head chunk when computing log-probs (bounds logits memory) (``--log-probs-chunk-size``)."""
    temperature: float = 1.0
    """Rollout sampling temperature; logits are divided by it before log-softmax (``--rollout-temperature``)."""

    def __post_init__(self) -> None:
        if not self.hf_checkpoint:
            raise ValueError("--hf-checkpoint is required: point it at an HF model dir with config.json")
        if self.params_dtype not in _DTYPES:
            raise ValueError(f"--params-dtype must be one of {_DTYPES}, got {self.params_dtype!r}")
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
        if self.kl_loss_type not in _KL_TYPES:
            raise ValueError(f"--kl-loss-type must be one of {_KL_TYPES}, got {self.kl_loss_type!r}")
        if self.log_probs_chunk_size < 1:
            raise ValueError(f"--log-probs-chunk-size must be >= 1, got {self.log_probs_chunk_size}")
        if self.temperature <= 0:
            raise ValueError(f"--rollout-temperature must be > 0, got {self.temperature}")
