"""The mixture-of-experts facts of an HF ``config.json`` and the Megatron ``TransformerConfig`` fields they set.

Supported: ``qwen3_moe`` (softmax router over ``num_experts``, top-``num_experts_per_tok``, ``norm_topk_prob``
renormalising the chosen probabilities, SwiGLU experts of ``moe_intermediate_size``, dense SwiGLU layers where
``mlp_only_layers`` / ``decoder_sparse_step`` say so) and ``glm4_moe`` (``tidal.actor.glm4_moe``: sigmoid router with a
score-correction bias, grouped top-k, routed scaling factor, a shared expert, dense first layers). Other MoE
architectures, and those variants in a ``qwen3_moe`` config, raise ``ValueError`` naming the key.

HF's router and Megatron's ``TopKRouter`` in the same arithmetic:

* ``norm_topk_prob`` false: softmax over every expert, then top-k (Megatron ``moe_router_pre_softmax``);
* ``norm_topk_prob`` true: top-k probabilities renormalised to sum to 1, which is softmax over the top-k logits
  (Megatron's default, ``moe_router_pre_softmax`` false).

Dropless routing (no capacity factor), as HF computes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MOE_MODEL_TYPES = ("qwen3_moe", "glm4_moe")
# model types of other mixture-of-experts families, refused by name
OTHER_MOE_MODEL_TYPES = (
    "qwen2_moe",
    "mixtral",
    "deepseek_v2",
    "deepseek_v3",
    "olmoe",
    "dbrx",
    "jamba",
    "granitemoe",
    "phimoe",
    "minimax",
    "llama4",
    "gpt_oss",
    "qwen3_next",
    "ernie4_5_moe",
    "hunyuan_v1_moe",
    "bailing_moe",
    "dots1",
)
ROUTER_DTYPES = ("fp32", "fp64")


@dataclass(frozen=True, kw_only=True, slots=True)
class MoESpec:
    """The routed-experts facts of a mixture-of-experts HF model."""

    num_experts: int
    """Routed experts per MoE layer."""
    top_k: int
    """Experts each token is routed to (``num_experts_per_tok``)."""
    ffn_hidden_size: int
    """Intermediate size of one expert (``moe_intermediate_size``)."""
    norm_topk_prob: bool
    """The chosen experts' probabilities are renormalised to sum to 1."""
    layers: tuple[bool, ...]
    """Per decoder layer: True for an MoE layer, False for a dense SwiGLU layer (``intermediate_size``)."""
    score_function: str = "softmax"
    """The router's score of each expert: "softmax" or "sigmoid"."""
    expert_bias: bool = False
    """A per-expert score-correction bias is added to the scores for choosing experts (not for weighting them)."""
    num_groups: int | None = None
    """Experts are split into this many groups and only the best ``group_topk`` groups are chosen from."""
    group_topk: int | None = None
    """Groups chosen per token (with ``num_groups``)."""
    scaling_factor: float | None = None
    """The chosen experts' weights are multiplied by this factor (None: 1)."""
    shared_ffn_hidden_size: int | None = None
    """Intermediate size of the shared SwiGLU expert every token goes through beside the routed ones (None: none)."""

    @property
    def num_moe_layers(self) -> int:
        """MoE layers in the model."""
        return sum(self.layers)


def _refuse_variants(cfg: dict[str, Any]) -> None:
    unsupported = {
        "shared_expert_intermediate_size": "shared experts",
        "n_shared_experts": "shared experts",
        "num_shared_experts": "shared experts",
        "n_group": "grouped top-k routing",
        "topk_group": "grouped top-k routing",
    }
    for key, what in unsupported.items():
        if cfg.get(key):
            raise ValueError(f"{key}={cfg[key]!r} in config.json: {what} are not supported by tidal.actor's MoE")
    if cfg.get("scoring_func", "softmax") != "softmax":
        raise ValueError(f"scoring_func={cfg['scoring_func']!r} in config.json: only the softmax router is supported")
    if cfg.get("topk_method", "greedy") != "greedy":
        raise ValueError(f"topk_method={cfg['topk_method']!r} in config.json: only greedy top-k routing is supported")
    if float(cfg.get("routed_scaling_factor", 1.0)) != 1.0:
        raise ValueError(f"routed_scaling_factor={cfg['routed_scaling_factor']!r} in config.json is not supported")


def parse_moe(cfg: dict[str, Any]) -> MoESpec | None:
    """The MoE facts of a ``qwen3_moe`` ``config.json`` dict; None for another model type.

    Raises:
        ValueError: another MoE architecture (``model_type`` named), or an unsupported variant of ``qwen3_moe``
            (the key named), or counts that do not add up.
    """
    model_type = cfg.get("model_type")
    if model_type in OTHER_MOE_MODEL_TYPES:
        raise ValueError(
            f"HF model_type {model_type!r} is a mixture-of-experts architecture tidal.actor does not support; "
            f"supported MoE: {', '.join(MOE_MODEL_TYPES)}"
        )
    if model_type != "qwen3_moe":  # a dense model, or glm4_moe (read by tidal.actor.glm4_moe)
        return None
    _refuse_variants(cfg)
    num_experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)  # transformers 5 writes the latter
    top_k = int(cfg.get("num_experts_per_tok", 0))
    num_layers = int(cfg["num_hidden_layers"])
    if not num_experts or not 1 <= top_k <= num_experts:
        raise ValueError(
            f"config.json: num_experts={num_experts}, num_experts_per_tok={top_k}; a qwen3_moe model needs "
            "1 <= num_experts_per_tok <= num_experts"
        )
    step = int(cfg.get("decoder_sparse_step", 1))
    if step < 1:
        raise ValueError(f"config.json: decoder_sparse_step must be >= 1, got {step}")
    dense = {int(i) for i in cfg.get("mlp_only_layers") or ()}
    layers = tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers))
    return MoESpec(
        num_experts=num_experts,
        top_k=top_k,
        ffn_hidden_size=int(cfg["moe_intermediate_size"]),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        layers=layers,
    )


def moe_transformer_fields(
    moe: MoESpec,
    *,
    expert_model_parallel_size: int = 1,
    tensor_model_parallel_size: int = 1,
    aux_loss_coeff: float = 0.0,
    router_dtype: str | None = "fp32",
) -> dict[str, Any]:
    """``TransformerConfig`` keyword arguments of the routed experts (dropless top-k router, no fusions).

    The score-correction bias (``MoESpec.expert_bias``) is a frozen buffer: loaded, exported and synced with the
    weights, never updated from expert load (megatron-core's own update runs in its ``finalize_model_grads`` at
    ``moe_router_bias_update_rate``, default 1e-3; tidal does not call it, and slime's GLM-4.5 scripts set the rate
    to 0).

    Raises:
        ValueError: experts not divisible by the expert-parallel size, or tensor parallelism with experts (megatron
            -core's MoE layer trains with TP > 1 only under sequence parallelism, which tidal-actor does not use).
    """
    ep = expert_model_parallel_size
    if moe.num_experts % ep:
        raise ValueError(
            f"HF num_experts={moe.num_experts} is not divisible by --expert-model-parallel-size {ep}; choose an "
            "expert-parallel size that divides the expert count"
        )
    if tensor_model_parallel_size > 1:
        raise ValueError(
            f"--tensor-model-parallel-size {tensor_model_parallel_size} with a mixture-of-experts model is not "
            "supported (megatron-core trains MoE layers with TP > 1 only under sequence parallelism); use "
            "--expert-model-parallel-size (and data parallelism) for the experts instead"
        )
    if router_dtype is not None and router_dtype not in ROUTER_DTYPES:
        raise ValueError(f"--moe-router-dtype must be one of {ROUTER_DTYPES} or None, got {router_dtype!r}")
    return dict(
        num_moe_experts=moe.num_experts,
        moe_router_topk=moe.top_k,
        moe_ffn_hidden_size=moe.ffn_hidden_size,
        moe_layer_freq=[int(x) for x in moe.layers],
        moe_router_score_function=moe.score_function,
        moe_router_pre_softmax=moe.score_function == "softmax" and not moe.norm_topk_prob,
        moe_router_topk_scaling_factor=moe.scaling_factor,
        moe_router_enable_expert_bias=moe.expert_bias,
        moe_router_bias_update_rate=0.0,  # frozen (slime's GLM-4.5 runs); tidal does not run the update anyway
        moe_router_num_groups=moe.num_groups,
        moe_router_group_topk=moe.group_topk,
        moe_shared_expert_intermediate_size=moe.shared_ffn_hidden_size,
        moe_shared_expert_overlap=False,
        moe_router_load_balancing_type="aux_loss" if aux_loss_coeff > 0 else "none",
        moe_aux_loss_coeff=aux_loss_coeff,
        moe_router_dtype=router_dtype,
        moe_token_dispatcher_type="alltoall",
        moe_expert_capacity_factor=None,
        moe_grouped_gemm=False,
        moe_permute_fusion=False,
        moe_router_fusion=False,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=1,
    )
