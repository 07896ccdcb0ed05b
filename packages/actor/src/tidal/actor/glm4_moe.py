"""GLM-4.5 (``glm4_moe``, ``Glm4MoeForCausalLM``): what its ``config.json`` adds over Qwen3-MoE (standard library).

* Routing (HF ``Glm4MoeTopkRouter``): sigmoid scores; the experts are chosen by score plus ``e_score_correction_bias``
  (a buffer, aux-loss-free balancing), within the best ``topk_group`` of ``n_group`` groups (a group's score: the sum
  of its two best biased scores); the chosen experts are weighted by their unbiased scores, renormalised to sum to 1
  (``norm_topk_prob``) and multiplied by ``routed_scaling_factor``. megatron-core's ``TopKRouter`` computes the same
  with ``moe_router_score_function="sigmoid"``, ``moe_router_enable_expert_bias`` and ``moe_router_num_groups`` /
  ``moe_router_group_topk``, except that it always renormalises and scores a group by its best
  ``top_k // topk_group`` experts: the settings where the two differ are refused.
* A shared SwiGLU expert of ``n_shared_experts * moe_intermediate_size`` beside the routed ones in every MoE layer;
  the first ``first_k_dense_replace`` layers are dense SwiGLU layers of ``intermediate_size``.
* Attention: q/k/v bias with ``attention_bias``, per-head q/k RMSNorm with ``use_qk_norm``, RoPE on the first
  ``partial_rotary_factor`` of each head's channels (non-interleaved).

HF names: ``mlp.gate.weight`` and ``mlp.gate.e_score_correction_bias`` (router), ``mlp.experts.E.{gate,up,down}_proj``,
``mlp.shared_experts.{gate,up,down}_proj``. Tensors of layers past ``num_hidden_layers`` (the multi-token-prediction
layer of GLM-4.5's released checkpoints, ``num_nextn_predict_layers``) are not part of the model and are ignored.
"""

from __future__ import annotations

from typing import Any

from tidal.actor.moe_spec import MoESpec


def _rope_parameter(cfg: dict[str, Any], key: str, default: float) -> float:
    params = cfg.get("rope_parameters") or {}
    return float(params.get(key, cfg.get(key, default)))


def rotary_fraction(cfg: dict[str, Any]) -> float:
    """The fraction of each head's channels RoPE rotates (``partial_rotary_factor``, GLM-4.5's default 0.5)."""
    fraction = _rope_parameter(cfg, "partial_rotary_factor", 0.5)
    head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // int(cfg["num_attention_heads"]))
    rotary = head_dim * fraction
    if not 0 < fraction <= 1 or rotary != int(rotary) or int(rotary) % 2:
        raise ValueError(
            f"config.json: partial_rotary_factor={fraction} of head_dim {head_dim} must rotate an even number of "
            "channels (0 < factor <= 1)"
        )
    return fraction


def parse_glm4_moe(cfg: dict[str, Any]) -> MoESpec:
    """The MoE facts of a ``glm4_moe`` ``config.json`` dict.

    Raises:
        ValueError: counts that do not add up, or a routing setting megatron-core's router computes differently
            (the key named).
    """
    num_experts = int(cfg.get("n_routed_experts") or cfg.get("num_local_experts") or 0)
    top_k = int(cfg.get("num_experts_per_tok", 0))
    if not num_experts or not 1 <= top_k <= num_experts:
        raise ValueError(
            f"config.json: n_routed_experts={num_experts}, num_experts_per_tok={top_k}; a glm4_moe model needs "
            "1 <= num_experts_per_tok <= n_routed_experts"
        )
    if not cfg.get("norm_topk_prob", True) or top_k == 1:
        raise ValueError(
            f"config.json: norm_topk_prob={cfg.get('norm_topk_prob', True)}, num_experts_per_tok={top_k}: "
            "megatron-core's sigmoid router renormalises the chosen experts' weights exactly when it chooses more "
            "than one; tidal.actor supports glm4_moe with norm_topk_prob true and num_experts_per_tok >= 2"
        )
    groups, group_topk = int(cfg.get("n_group") or 1), int(cfg.get("topk_group") or 1)
    if num_experts % groups or not 1 <= group_topk <= groups:
        raise ValueError(
            f"config.json: n_group={groups}, topk_group={group_topk} with {num_experts} experts; n_group must divide "
            "n_routed_experts and 1 <= topk_group <= n_group"
        )
    if groups > 1 and top_k // group_topk != 2:
        raise ValueError(
            f"config.json: n_group={groups}, topk_group={group_topk}, num_experts_per_tok={top_k}: HF scores a group "
            "by its 2 best experts, megatron-core by its num_experts_per_tok // topk_group best; tidal.actor supports "
            "grouped routing where the two agree (num_experts_per_tok // topk_group == 2)"
        )
    shared = int(cfg.get("n_shared_experts") or 0)
    if shared < 1:
        raise ValueError(f"config.json: n_shared_experts={shared}; a glm4_moe layer has at least one shared expert")
    dense = int(cfg.get("first_k_dense_replace") or 0)
    num_layers = int(cfg["num_hidden_layers"])
    ffn = int(cfg["moe_intermediate_size"])
    scale = float(cfg.get("routed_scaling_factor", 1.0))
    return MoESpec(
        num_experts=num_experts,
        top_k=top_k,
        ffn_hidden_size=ffn,
        norm_topk_prob=True,
        layers=tuple(i >= dense for i in range(num_layers)),
        score_function="sigmoid",
        expert_bias=True,
        num_groups=groups if groups > 1 else None,
        group_topk=group_topk if groups > 1 else None,
        scaling_factor=None if scale == 1.0 else scale,
        shared_ffn_hidden_size=shared * ffn,
    )
