"""Read a Hugging Face ``config.json`` and map it to Megatron's ``TransformerConfig``.

Supported architectures: ``qwen2`` (QKV bias), ``qwen3`` (q/k RMSNorm, explicit ``head_dim``), ``llama`` (no bias)
``qwen3_moe`` (Qwen3 attention with routed SwiGLU experts, ``tidal.actor.moe_spec``) and ``glm4_moe`` (GLM-4.5:
partial RoPE, optional q/k norm and attention bias, biased sigmoid routing and a shared expert,
``tidal.actor.glm4_moe``). RoPE: default, and the "linear", "dynamic" and "llama3" scalings (``rope_scaling``).
Anything else raises ``ValueError`` naming the model type (or the rope type).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from megatron.core.transformer.transformer_config import TransformerConfig
from tidal.actor.families import FAMILIES, family_of
from tidal.actor.glm4_moe import parse_glm4_moe, rotary_fraction
from tidal.actor.moe_spec import MoESpec, moe_transformer_fields, parse_moe
from tidal.actor.rope_scaling import RopeScaling, parse_rope_scaling
from tidal.ckpt import read_hf_config_json

logger = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = tuple(FAMILIES)


@dataclass(frozen=True, kw_only=True, slots=True)
class HFModelSpec:
    """The architecture facts tidal needs from an HF config (a decoder-only, RoPE, SwiGLU model)."""

    model_type: str
    """HF ``model_type`` (one of ``SUPPORTED_MODEL_TYPES``)."""
    vocab_size: int
    """Rows of the embedding and LM head."""
    hidden_size: int
    """Model width."""
    ffn_hidden_size: int
    """MLP intermediate size (per gate/up projection)."""
    num_layers: int
    """Decoder layers."""
    num_attention_heads: int
    """Query heads."""
    num_key_value_heads: int
    """Key/value heads (query groups)."""
    head_dim: int
    """Channels per head."""
    rms_norm_eps: float
    """RMSNorm epsilon."""
    rope_theta: float
    """RoPE base."""
    max_position_embeddings: int
    """Longest sequence the RoPE table is built for."""
    tie_word_embeddings: bool
    """LM head shares the embedding matrix."""
    qkv_bias: bool
    """q/k/v projections carry a bias (Qwen2)."""
    qk_norm: bool
    """Per-head RMSNorm on queries and keys (Qwen3)."""
    rope_scaling: RopeScaling | None = None
    """Non-default RoPE scaling (``rope_scaling``/``rope_parameters`` of the config), None for default RoPE."""
    moe: MoESpec | None = None
    """The routed experts of a mixture-of-experts model; None for a dense one."""
    rotary_percent: float = 1.0
    """Fraction of each head's channels RoPE rotates (the first ones; GLM-4.5's ``partial_rotary_factor``)."""

    @property
    def rotary_dim(self) -> int:
        """Channels per head that RoPE rotates."""
        return int(self.head_dim * self.rotary_percent)


def _rope_theta(cfg: dict) -> float:
    params = cfg.get("rope_parameters") or {}
    return float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))


def parse_hf_config(cfg: dict) -> HFModelSpec:
    """Turn a ``config.json`` dict into an ``HFModelSpec``.

    Raises:
        ValueError: unsupported ``model_type``, activation, sliding window or RoPE scaling.
    """
    model_type = cfg.get("model_type")
    moe = parse_glm4_moe(cfg) if model_type == "glm4_moe" else parse_moe(cfg)  # names other MoE architectures first
    if model_type not in SUPPORTED_MODEL_TYPES:
        family_of(cfg)  # one line naming the known families
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {cfg['hidden_act']!r} is not supported (SwiGLU/silu only)")
    if cfg.get("use_sliding_window"):
        raise ValueError("use_sliding_window=true is not supported by tidal.actor")
    num_heads = int(cfg["num_attention_heads"])
    head_dim = cfg.get("head_dim") or int(cfg["hidden_size"]) // num_heads
    glm = model_type == "glm4_moe"
    if model_type == "llama" and cfg.get("mlp_bias"):
        raise ValueError("llama with mlp_bias=true is not supported by tidal.actor")
    return HFModelSpec(
        model_type=model_type,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=int(cfg["hidden_size"]),
        ffn_hidden_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_attention_heads=num_heads,
        num_key_value_heads=int(cfg.get("num_key_value_heads") or num_heads),
        head_dim=int(head_dim),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=_rope_theta(cfg),
        rope_scaling=parse_rope_scaling(cfg),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=model_type == "qwen2" or bool(cfg.get("attention_bias", False)),
        qk_norm=model_type in ("qwen3", "qwen3_moe") or (glm and bool(cfg.get("use_qk_norm", False))),
        moe=moe,
        rotary_percent=rotary_fraction(cfg) if glm else 1.0,
    )


def read_hf_config(hf_dir: str | Path) -> HFModelSpec:
    """Read ``hf_dir/config.json`` into an ``HFModelSpec``.

    Raises:
        FileNotFoundError: no ``config.json`` in ``hf_dir``.
        ValueError: see ``parse_hf_config``.
    """
    if not (Path(hf_dir) / "config.json").is_file():
        raise FileNotFoundError(f"no config.json in {hf_dir}; point --hf-checkpoint at an HF model dir")
    return parse_hf_config(read_hf_config_json(hf_dir))  # read once per process (actor, reference model)


def to_transformer_config(
    spec: HFModelSpec,
    *,
    tensor_model_parallel_size: int = 1,
    params_dtype: torch.dtype = torch.float32,
    use_cpu_initialization: bool = False,
    fused_swiglu: bool = False,
    context_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    gradient_accumulation_fusion: bool = False,
    expert_model_parallel_size: int = 1,
    moe_aux_loss_coeff: float = 0.0,
    moe_router_dtype: str | None = "fp32",
) -> TransformerConfig:
    """Megatron ``TransformerConfig`` equivalent to the HF model (no dropout, no TE).

    ``fused_swiglu`` turns on megatron's SwiGLU fusion (``torch.compile``d; saves only the MLP's fc1 output for
    backward instead of three tensors); ``gradient_accumulation_fusion`` makes linear layers accumulate weight
    gradients into each weight's ``main_grad`` (needs ``compat.apply_wgrad_accumulation_fusion``); every other fusion
    stays off.

    With ``pipeline_model_parallel_size`` > 1 the settings Megatron's 1F1B schedule needs for packed micro-batches of
    varying length: ``variable_seq_lengths`` (stages exchange each activation's shape first), which megatron-core
    0.19 refuses with the default MoE token dispatcher "allgather" even for a dense model, so "alltoall" (no effect
    without MoE); ``pipeline_dtype`` (the activations' dtype between stages: the parameters'); and
    ``calculate_per_token_loss`` (tidal's loss is already normalised by the step's loss-token count, so the schedule
    must not divide it by the number of micro-batches again).

    A mixture-of-experts spec adds the routed experts (``moe_spec.moe_transformer_fields``: expert-parallel size,
    load-balancing loss coefficient, router dtype).

    Raises:
        ValueError: heads or groups not divisible by the tensor-parallel size (the vocabulary is padded instead,
            see ``vocab_padding``), or layers not divisible by the pipeline-parallel size.
    """
    tp = tensor_model_parallel_size
    for name, value in (
        ("num_attention_heads", spec.num_attention_heads),
        ("num_key_value_heads", spec.num_key_value_heads),
        ("intermediate_size", spec.ffn_hidden_size),
    ):
        if value % tp:
            raise ValueError(f"HF {name}={value} is not divisible by --tensor-model-parallel-size {tp}")
    pp = pipeline_model_parallel_size
    if spec.num_layers % pp:
        raise ValueError(
            f"HF num_hidden_layers={spec.num_layers} is not divisible by --pipeline-model-parallel-size {pp}; "
            "choose a pipeline size that divides the layer count"
        )
    pipeline = {}
    if pp > 1:
        pipeline = dict(
            variable_seq_lengths=True,
            moe_token_dispatcher_type="alltoall",
            pipeline_dtype=params_dtype,
            calculate_per_token_loss=True,
        )
    moe = {}
    if spec.moe is not None and context_parallel_size > 1:
        raise ValueError(
            f"--context-parallel-size {context_parallel_size} with a mixture-of-experts model is not supported yet "
            "(the zigzag shards' padding tokens would be routed and counted in the load-balancing loss); use "
            "--context-parallel-size 1"
        )
    if spec.moe is not None:
        moe = moe_transformer_fields(
            spec.moe,
            expert_model_parallel_size=expert_model_parallel_size,
            tensor_model_parallel_size=tp,
            aux_loss_coeff=moe_aux_loss_coeff,
            router_dtype=moe_router_dtype,
        )
    elif expert_model_parallel_size > 1:
        raise ValueError(
            f"--expert-model-parallel-size {expert_model_parallel_size} needs a mixture-of-experts model; "
            f"HF model_type {spec.model_type!r} is dense: use --expert-model-parallel-size 1"
        )
    return TransformerConfig(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        ffn_hidden_size=spec.ffn_hidden_size,
        num_attention_heads=spec.num_attention_heads,
        num_query_groups=spec.num_key_value_heads,
        kv_channels=spec.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=spec.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=spec.qkv_bias,
        qk_layernorm=spec.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_activation_fusion=fused_swiglu,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=gradient_accumulation_fusion,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        context_parallel_size=context_parallel_size,
        sequence_parallel=False,
        params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        use_cpu_initialization=use_cpu_initialization,
        perform_initialization=False,
        **(pipeline | moe),
    )
