"""ActorConfig: the actor's own section of the training config (standard library only)."""

from __future__ import annotations

from dataclasses import dataclass, field

_DTYPES = ("float32", "bfloat16")
_KL_TYPES = ("k1", "k2", "k3")
_ADVANTAGE_ESTIMATORS = (
    "grpo", "gspo", "cispo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "ppo",
    "on_policy_distillation",
)  # fmt: skip
_TEACHER_ESTIMATORS = ("grpo", "gspo", "cispo", "rloo", "on_policy_distillation")
"""Estimators a teacher's per-token term is added to (per-sample advantages; the token-level ones and GAE are not)."""
_LOSS_TYPES = ("policy_loss", "sft_loss", "custom_loss")
_TIS_MODES = ("truncate", "mask")
_LORA_REFUSED = (  # (what it is, given?) LoRA cannot serve yet
    ("--advantage-estimator ppo (the critic)", lambda c: c.advantage_estimator == "ppo"),
)


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
    cudnn_attention_min_tokens: int = 2048
    """On CUDA in bf16/fp16: packed sequences of at least this many tokens attend through cuDNN's kernel instead of
    FlashAttention-2 (each padded to one of 32 lengths per power of two so cuDNN builds few plans): +1.3-2.2 points
    of training MFU on an H200 at 32k tokens per GPU, and 3-7 GiB more peak memory there; 0: FlashAttention-2 only."""
    recompute_activations: bool = field(default=False, metadata={"auto": True})
    """Recompute each transformer layer in backward instead of storing its activations; `auto` (train): the layers
    to recompute, none to all, of the fastest configuration the memory plan says fits the GPU."""
    recompute_num_layers: int = 0
    """With --recompute-activations: recompute only the first N layers of each pipeline stage (Megatron's block
    method), keeping the others' activations; 0 recomputes every layer. Trades memory
    (about 1/layers of the activations per layer) for a forward of each recomputed layer."""
    moe_aux_loss_coeff: float = 0.0
    """Mixture-of-experts models: weight of the load-balancing loss (Switch Transformer's, per MoE layer, averaged
    over the step's micro-batches), logged as train/moe_load_balancing_loss; 0: off."""
    use_rollout_routing_replay: bool = False
    """Mixture-of-experts models: route every token of a rollout to the experts the engine routed it to (R3), in the
    log-prob and training passes; the router still learns from its probabilities of those experts."""
    moe_router_dtype: str = "fp32"
    """Mixture-of-experts models: dtype of the router's logits and softmax: "fp32", "fp64", or "none" (the
    parameters' dtype)."""
    gpu_memory_gib: float | None = None
    """Memory of one trainer GPU the memory plan is checked against before the run starts (GiB); None: this
    machine's first GPU (nvidia-smi), no check without one."""
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
    """How rewards become advantages and the policy loss: grpo (group baseline, token ratio), gspo (GRPO advantages,
    one ratio per sequence: exp of its mean token log-ratio), cispo (GRPO advantages, clipped stop-gradient IS weight
    times log-prob), rloo (leave-one-out baseline), reinforce_plus_plus (token returns with the KL in the reward,
    whitened over the rollout), reinforce_plus_plus_baseline (group baseline minus per-token KL, whitened), ppo (a
    critic model, GAE with --gamma/--lambd, whitened; the critic trains on the actor's GPUs with --critic-lr) or
    on_policy_distillation (no reward term: each response token's advantage is --teacher-kl-coef x (teacher log-prob
    minus the actor's old log-prob) of the sampled token, the negative reverse KL to --teacher-hf-checkpoint)."""
    teacher_hf_checkpoint: str | None = None
    """HF model dir of a frozen teacher (its own architecture and size, the actor's tokenizer), built on the actor's
    ranks and kept on the CPU between uses: its log-probs of the sampled tokens add --teacher-kl-coef x (teacher
    minus old log-prob) to each response token's advantage (on-policy distillation; with grpo, gspo, cispo or rloo
    on top of the reward's advantage)."""
    teacher_kl_coef: float = 1.0
    """Weight of the teacher's per-token term (the negative reverse KL on the sampled token) in the advantage."""
    disable_grpo_std_normalization: bool = False
    """GRPO (and gspo, cispo) without dividing by the group's reward std (Dr.GRPO)."""
    gamma: float = 1.0
    """Discount of the per-token returns of reinforce_plus_plus and ppo (GAE), in [0, 1]."""
    lambd: float = 1.0
    """GAE's lambda of --advantage-estimator ppo, in [0, 1] (1: Monte-Carlo return minus the value)."""
    value_clip: float | None = None
    """PPO value clipping of --advantage-estimator ppo: the critic's new value counts at most this far from its value
    before the update (pessimistic max of the clipped and unclipped squared errors); None: no clipping."""
    critic_lr: float | None = None
    """Learning rate of the critic of --advantage-estimator ppo (its own AdamW); None: --lr."""
    num_critic_only_steps: int = 0
    """With --advantage-estimator ppo: train only the critic for the first this many rollouts (the actor waits for
    useful values)."""
    loss_type: str = "policy_loss"
    """policy_loss (RL, by --advantage-estimator), sft_loss (negative log-likelihood of the response tokens) or
    custom_loss (--custom-loss-function-path)."""
    custom_loss_function_path: str | None = None
    """With --loss-type custom_loss: pkg.module:fn called as tidal.actor.loss.actor_loss is (same arguments, returns
    (loss, metric sums))."""
    overlong_buffer_len: int = 0
    """DAPO's soft overlong punishment (verl's reward_model.overlong_buffer.len): a response longer than
    max response length minus this many tokens loses (excess / this) x --overlong-penalty-factor of reward;
    0: off."""
    overlong_penalty_factor: float = 1.0
    """DAPO's overlong penalty at the full --rollout-max-response-len (verl's overlong_buffer.penalty_factor)."""
    max_response_len: int = field(default=1024, metadata={"flag": None})
    """The rollout's --rollout-max-response-len (the overlong penalty's L_max)."""
    custom_advantage_function_path: str | None = None
    """pkg.module:fn(rewards, *, group_size, normalize_std) -> per-sample advantages [N], in place of the
    estimator's (the estimator's policy loss still applies)."""
    eps_clip_c: float | None = None
    """Dual-clip PPO bound for negative advantages, > 1; None: off."""
    use_kl_loss: bool = False
    """Add ``kl_loss_coef`` x KL(pi || pi_ref) to the loss."""
    kl_coef: float = 0.0
    """KL-to-reference penalty subtracted from each token's advantage (reward shaping)."""
    calculate_per_token_loss: bool = False
    """Mean the loss over every response token of the step; default: mean per sample, then over samples."""
    use_tis: bool | None = None
    """Importance-weight each token by the actor's old log-prob over the engine's (truncated at --tis-clip): the
    off-policy correction of decoupled PPO, behaviour -> proximal policy. None: the app decides (the train app: on
    exactly when the samples can be older than the actor, --max-staleness >= 1); standalone, None is off."""
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
    lora_rank: int = 0
    """LoRA: train rank-r adapters on the chosen linear layers, the base weights frozen (no gradient, no optimizer
    state); the KL reference is then the base model itself (the adapters switched off). 0: full fine-tuning."""
    lora_alpha: float = 32.0
    """LoRA scaling numerator: an adapter adds (alpha / rank) x B @ A to its layer's weight."""
    lora_dropout: float = 0.0
    """Dropout on the adapters' input while training (PEFT's lora_dropout), in [0, 1)."""
    lora_target_modules: tuple[str, ...] = ("all-linear",)
    """The linear layers that get adapters: all-linear, or HF names q_proj k_proj v_proj o_proj gate_proj up_proj
    down_proj (space- or comma-separated), or Megatron's linear_qkv linear_proj linear_fc1 linear_fc2."""
    seed: int = field(default=1234, metadata={"flag": None})
    """Seed of what the actor initialises itself (the LoRA A matrices); the app's ``--seed``."""

    def _check_model(self) -> None:
        if self.cudnn_attention_min_tokens < 0:
            value = self.cudnn_attention_min_tokens
            raise ValueError(f"--cudnn-attention-min-tokens must be >= 0 (0: FlashAttention-2 only), got {value}")
        if self.gpu_memory_gib is not None and not self.gpu_memory_gib > 0:
            raise ValueError(f"--gpu-memory-gib must be > 0 (GiB of one trainer GPU), got {self.gpu_memory_gib}")
        if not self.hf_checkpoint:
            raise ValueError("--hf-checkpoint is required: point it at an HF model dir with config.json")
        if self.params_dtype not in _DTYPES:
            raise ValueError(f"--params-dtype must be one of {_DTYPES}, got {self.params_dtype!r}")
        if self.fp32_main_params and self.params_dtype == "float32":
            raise ValueError(
                "--fp32-main-params needs a half-precision --params-dtype (bfloat16), got --params-dtype float32; "
                "fp32 parameters are their own main copy: drop --fp32-main-params"
            )

    def _check_lora(self) -> None:
        if self.lora_rank < 0:
            raise ValueError(f"--lora-rank must be >= 0 (0: full fine-tuning, no LoRA), got {self.lora_rank}")
        if not 0.0 <= self.lora_dropout < 1.0:
            raise ValueError(f"--lora-dropout must be in [0, 1), got {self.lora_dropout}")
        if not self.lora_rank:
            return
        if not self.lora_alpha > 0:
            raise ValueError(f"--lora-alpha must be > 0 (the adapters' scale is alpha / rank), got {self.lora_alpha}")
        from tidal.actor.lora_targets import resolve_target_modules

        resolve_target_modules(self.lora_target_modules)
        for what, given in _LORA_REFUSED:
            if given(self):
                raise ValueError(f"--lora-rank {self.lora_rank} with {what} is not supported yet: drop one of them")

    def _check_moe(self) -> None:
        if not self.moe_aux_loss_coeff >= 0:
            raise ValueError(f"--moe-aux-loss-coeff must be >= 0 (0: off), got {self.moe_aux_loss_coeff}")
        if self.moe_router_dtype not in ("fp32", "fp64", "none"):
            raise ValueError(f"--moe-router-dtype must be one of fp32, fp64, none; got {self.moe_router_dtype!r}")

    def _check_recompute(self) -> None:
        if self.recompute_num_layers < 0:
            raise ValueError(f"--recompute-num-layers must be >= 0 (0: every layer), got {self.recompute_num_layers}")
        if self.recompute_num_layers and not self.recompute_activations:
            raise ValueError(
                f"--recompute-num-layers {self.recompute_num_layers} needs --recompute-activations (it says how many "
                "layers to recompute)"
            )

    @property
    def off_policy_correction(self) -> bool:
        """Whether the loss weights tokens by old / engine log-prob (``use_tis``; None: off)."""
        return bool(self.use_tis)

    def __post_init__(self) -> None:
        self._check_model()
        self._check_moe()
        self._check_recompute()
        self._check_lora()
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
        if self.advantage_estimator not in _ADVANTAGE_ESTIMATORS:
            raise ValueError(
                f"--advantage-estimator must be one of {_ADVANTAGE_ESTIMATORS}, got {self.advantage_estimator!r}"
            )
        self._check_algorithm()
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

    def _check_critic(self) -> None:
        if not 0.0 <= self.lambd <= 1.0:
            raise ValueError(f"--lambd must be in [0, 1], got {self.lambd}")
        if self.value_clip is not None and not self.value_clip > 0:
            raise ValueError(f"--value-clip must be > 0, got {self.value_clip}; leave it out for no value clipping")
        if self.critic_lr is not None and not self.critic_lr >= 0:
            raise ValueError(f"--critic-lr must be >= 0, got {self.critic_lr}")
        if self.num_critic_only_steps < 0:
            raise ValueError(f"--num-critic-only-steps must be >= 0, got {self.num_critic_only_steps}")
        if self.advantage_estimator == "ppo":
            if self.custom_advantage_function_path is not None:
                raise ValueError(
                    "--custom-advantage-function-path replaces per-sample advantages; --advantage-estimator ppo's come "
                    "from the critic (GAE): drop one of them"
                )
            return
        given = [
            flag
            for flag, value in (
                ("--lambd", self.lambd != 1.0),
                ("--value-clip", self.value_clip is not None),
                ("--critic-lr", self.critic_lr is not None),
                ("--num-critic-only-steps", self.num_critic_only_steps != 0),
            )
            if value
        ]
        if given:
            raise ValueError(
                f"{given[0]} is a setting of the critic, which only --advantage-estimator ppo has (got "
                f"--advantage-estimator {self.advantage_estimator}): pass --advantage-estimator ppo or drop {given[0]}"
            )

    def _check_teacher(self) -> None:
        teacher, estimator = self.teacher_hf_checkpoint, self.advantage_estimator
        if not self.teacher_kl_coef > 0:
            raise ValueError(f"--teacher-kl-coef must be > 0 (the teacher term's weight), got {self.teacher_kl_coef}")
        if teacher is None:
            if estimator == "on_policy_distillation":
                raise ValueError(
                    "--advantage-estimator on_policy_distillation needs a teacher: add --teacher-hf-checkpoint DIR"
                )
            if self.teacher_kl_coef != 1.0:
                raise ValueError(
                    f"--teacher-kl-coef {self.teacher_kl_coef} weighs a teacher's term and this run has none: add "
                    "--teacher-hf-checkpoint DIR or drop --teacher-kl-coef"
                )
            return
        if estimator not in _TEACHER_ESTIMATORS:
            raise ValueError(
                f"--teacher-hf-checkpoint with --advantage-estimator {estimator} is not supported (its advantages are "
                f"not per sample): use one of {', '.join(_TEACHER_ESTIMATORS)} or drop --teacher-hf-checkpoint"
            )
        if self.loss_type != "policy_loss":
            raise ValueError(
                f"--teacher-hf-checkpoint with --loss-type {self.loss_type}: the teacher's term is an advantage, "
                "which only --loss-type policy_loss uses; drop one of them"
            )
        if estimator == "on_policy_distillation" and self.custom_advantage_function_path is not None:
            raise ValueError(
                "--custom-advantage-function-path with --advantage-estimator on_policy_distillation: distillation "
                "has no reward term to replace; use --advantage-estimator grpo to mix the two, or drop one of them"
            )

    def _check_algorithm(self) -> None:
        if self.tis_mode not in _TIS_MODES:
            raise ValueError(f"--tis-mode must be one of {_TIS_MODES}, got {self.tis_mode!r}")
        if not 0 <= self.overlong_buffer_len < self.max_response_len:
            raise ValueError(
                f"--overlong-buffer-len must be in [0, --rollout-max-response-len={self.max_response_len}), got "
                f"{self.overlong_buffer_len}; 0 turns the overlong penalty off"
            )
        if self.overlong_penalty_factor < 0:
            raise ValueError(f"--overlong-penalty-factor must be >= 0, got {self.overlong_penalty_factor}")
        if not 0.0 <= self.gamma <= 1.0:
            raise ValueError(f"--gamma must be in [0, 1], got {self.gamma}")
        self._check_critic()
        self._check_teacher()
        if self.loss_type not in _LOSS_TYPES:
            raise ValueError(f"--loss-type must be one of {_LOSS_TYPES}, got {self.loss_type!r}")
        if (self.loss_type == "custom_loss") != (self.custom_loss_function_path is not None):
            raise ValueError(
                "--loss-type custom_loss and --custom-loss-function-path go together: give both "
                f"(got --loss-type {self.loss_type}, --custom-loss-function-path {self.custom_loss_function_path})"
            )
        for flag, path in (
            ("--custom-loss-function-path", self.custom_loss_function_path),
            ("--custom-advantage-function-path", self.custom_advantage_function_path),
        ):
            if path is not None and (path.count(":") != 1 or not all(path.split(":"))):
                raise ValueError(f"{flag} must look like 'pkg.module:fn', got {path!r}")
