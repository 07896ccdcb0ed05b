"""HF <-> Megatron bridge: build a GPTModel for an HF checkpoint, load its weights, export them back.

Layout facts (megatron-core 0.19, local spec):

* ``linear_qkv`` is column-parallel and interleaved per query group: for each KV group ``g`` the
  rows are ``[q heads of g (heads_per_group * d), k_g (d), v_g (d)]``; TP rank ``r`` holds the
  groups ``[r * G/tp, (r + 1) * G/tp)``. The QKV bias follows the same layout.
* ``linear_fc1`` is column-parallel with the gated unit stacked per rank: ``[gate_r; up_r]``.
* ``linear_proj`` and ``linear_fc2`` are row-parallel (split on the input dim); the embedding and
  LM head are vocab-parallel (split on dim 0); norms are replicated.
* An MoE layer (``qwen3_moe``, ``glm4_moe``) holds ``mlp.router.weight`` (HF ``mlp.gate.weight``, replicated) and
  ``mlp.experts.weight1`` / ``weight2`` (``moe_experts.GroupedExperts``: HF's per-expert gate/up and down projections
  stacked on a leading expert axis); expert-parallel rank ``r`` holds the experts ``[r * E/ep, (r + 1) * E/ep)``.
  ``glm4_moe`` adds the router's score-correction bias ``mlp.router.expert_bias`` (HF
  ``mlp.gate.e_score_correction_bias``: a float32 buffer, not a parameter, read and written in float32 here) and a
  shared expert ``mlp.shared_experts.linear_fc1`` / ``linear_fc2`` (HF ``mlp.shared_experts.{gate,up,down}_proj``,
  laid out as a dense MLP).
* With pipeline parallelism a stage's module names its layers from 0 (``pipeline.PipelineStage.local_name``);
  the mappings here use global layer indices. Export broadcasts each HF tensor from its owning stage.

HF safetensors are read through ``tidal.ckpt.HFCheckpointReader`` (random access by name, one tensor at a time:
QKV and gate/up merging need several HF tensors per Megatron parameter), by rank 0 alone, which broadcasts each
tensor to the other ranks (:func:`load_hf_weights`).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
from megatron.core.transformer.moe.shared_experts import SharedExpertMLP
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import LayerNormImpl, TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig
from tidal.actor import moe_permute
from tidal.actor.attention import PackedCoreAttention
from tidal.actor.cp_attention import ContextParallelCoreAttention
from tidal.actor.fused import (
    FusedRMSNorm,
    FusedSwiGLUMLP,
    PackedSelfAttention,
    set_fused_kernels,
    share_rope_tables,
)
from tidal.actor.hf_config import HFModelSpec
from tidal.actor.moe_experts import GroupedExperts
from tidal.actor.pipeline import PipelineStage, broadcast_from_stage
from tidal.actor.rope_scaling import apply_rope_scaling
from tidal.actor.vocab_padding import install_padded_logits_mask, pad_vocab_rows, padded_vocab_size
from tidal.ckpt import HFCheckpointReader
from torch.utils.checkpoint import checkpoint

logger = logging.getLogger(__name__)

# HF tensors that carry no weights (older checkpoints save RoPE buffers).
_IGNORED_HF_SUFFIXES = ("rotary_emb.inv_freq",)


class ValueHead(torch.nn.Linear):
    """The critic's head in place of the LM head: hidden state -> one scalar value, replicated on every TP rank.

    Zero-initialised, so every rank starts from the same head without an RNG and the first values are 0. The
    final-norm hidden states are the same on every TP rank, so are the head's gradients (no TP reduction needed).
    """

    def __init__(self, hidden_size: int) -> None:
        super().__init__(hidden_size, 1, bias=True)
        with torch.no_grad():
            self.weight.zero_()
            self.bias.zero_()


def build_gpt_model(
    spec: HFModelSpec,
    config: TransformerConfig,
    stage: PipelineStage | None = None,
    *,
    fused_kernels: bool = False,
    value_head: bool = False,
) -> GPTModel:
    """A GPTModel with Megatron's local layer spec and tidal's packed core attention (``stage``'s share of it).

    ``fused_kernels`` runs the layers' q/k/v split + RoPE, SwiGLU and RMSNorm as Triton kernels on CUDA
    (``fused.set_fused_kernels``). ``value_head`` builds a critic: the last stage's ``output_layer`` is a
    :class:`ValueHead` (no LM head, no tied output weight).
    """
    stage = stage or PipelineStage(rank=0, size=1, num_layers=spec.num_layers)
    layer_spec: ModuleSpec | TransformerBlockSubmodules = _layer_spec(spec, config, moe=False)
    if spec.moe is not None:  # one spec per layer of this stage: routed experts or a dense MLP
        kinds = spec.moe.layers[stage.layer_offset : stage.layer_offset + spec.num_layers // stage.size]
        moe_spec = _layer_spec(spec, config, moe=True)
        layer_spec = TransformerBlockSubmodules(
            layer_specs=[moe_spec if is_moe else layer_spec for is_moe in kinds], layer_norm=LayerNormImpl
        )
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec,
        vocab_size=padded_vocab_size(spec.vocab_size, config.tensor_model_parallel_size),
        max_sequence_length=spec.max_position_embeddings,
        pre_process=stage.first,
        post_process=stage.last,
        parallel_output=True,
        share_embeddings_and_output_weights=spec.tie_word_embeddings and not value_head,
        position_embedding_type="rope",
        rotary_percent=spec.rotary_percent,
        rotary_base=int(spec.rope_theta) if float(spec.rope_theta).is_integer() else spec.rope_theta,
        pg_collection=_process_groups(),
    )
    apply_rope_scaling(
        model,
        head_dim=spec.rotary_dim,
        theta=spec.rope_theta,
        scaling=spec.rope_scaling,
        max_position_embeddings=spec.max_position_embeddings,
    )
    if stage.last and value_head:  # the LM head Megatron built (vocab x hidden) is dropped here
        model.output_layer = ValueHead(spec.hidden_size)
    elif stage.last:
        install_padded_logits_mask(model, spec.vocab_size, tp_rank=parallel_state.get_tensor_model_parallel_rank())
    set_fused_kernels(model, fused_kernels)
    share_rope_tables(model)
    return model


def _layer_spec(spec: HFModelSpec, config: TransformerConfig, *, moe: bool) -> ModuleSpec:
    """Megatron's local layer spec with tidal's packed attention, norms and MLP (``moe``: routed experts)."""
    layer_spec = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=spec.qk_norm)
    core_attention = PackedCoreAttention if config.context_parallel_size == 1 else ContextParallelCoreAttention
    layer_spec.submodules.self_attention.submodules.core_attention = core_attention
    if config.context_parallel_size == 1:  # q/k/v split + RoPE in one pass (tidal.actor.fused)
        layer_spec.submodules.self_attention.module = PackedSelfAttention
    if moe:  # megatron's MoE layer (top-k router, token dispatcher) around tidal's stacked experts
        moe_permute.install()  # the dispatcher's permutation without atomic adds
        shared = None
        if spec.moe.shared_ffn_hidden_size:  # megatron's shared-expert MLP with the dense layers' linear layers
            shared = functools.partial(SharedExpertMLP, submodules=layer_spec.submodules.mlp.keywords["submodules"])
        submodules = MoESubmodules(experts=GroupedExperts, shared_experts=shared)
        layer_spec.submodules.mlp = functools.partial(MoELayer, submodules=submodules)
    else:  # megatron's MLP with SwiGLU as Triton kernels (fused_kernels); the spec's mlp is a partial of MLP's
        mlp = layer_spec.submodules.mlp
        layer_spec.submodules.mlp = functools.partial(FusedSwiGLUMLP.as_mlp_submodule, *mlp.args, **mlp.keywords)
    layer_spec.submodules.input_layernorm = FusedRMSNorm  # torch's RMSNorm; Triton kernels with fused_kernels
    layer_spec.submodules.pre_mlp_layernorm = FusedRMSNorm
    return layer_spec


def _process_groups() -> ProcessGroupCollection:
    """Megatron's default process groups without the embedding group.

    tidal loads the last stage's tied output weight from the HF embedding itself, so GPTModel's start-up all-reduce
    of it (``weight.data.cuda()`` first, which fails without a GPU) is not needed; the per-step gradient sum uses
    ``parallel_state``'s embedding group directly (``pipeline.all_reduce_tied_embedding_grad``).
    """
    groups = ProcessGroupCollection.use_mpu_process_groups()
    groups.embd = None
    return groups


def enable_layer_recompute(model: GPTModel, num_layers: int = 0) -> None:
    """Recompute the first ``num_layers`` transformer layers (0: every layer) in backward, not keep their activations.

    Uses ``torch.utils.checkpoint`` (non-reentrant) per layer rather than Megatron's
    ``recompute_granularity="full"``: Megatron's ``CheckpointFunction`` does not restore the autocast
    state, so under bf16 autocast its recomputation ran in fp32 (3.5x slower on an H200, and not the
    forward that produced the loss). The layers have no dropout, so no RNG state needs replaying.

    ``early_stop=False``: with torch's default early stop, one ``[tokens, 2 * ffn]`` tensor per recomputed layer
    stayed allocated after the step until the next one (3.0 GiB for 4 layers of Llama-3.1-8B at 14k tokens on an
    H100); without it none does, at the same speed (the recompute check of bench/auto_plan_gpu.py, bench/RESULTS.md).
    """
    layers = list(model.decoder.layers)
    for layer in layers[:num_layers] if num_layers > 0 else layers:
        forward = layer.forward

        def checkpointed(*args, _forward=forward, **kwargs):
            if not torch.is_grad_enabled():
                return _forward(*args, **kwargs)
            return checkpoint(_forward, *args, use_reentrant=False, early_stop=False, **kwargs)

        layer.forward = checkpointed


@dataclass(frozen=True, slots=True)
class _Mapping:
    """One Megatron parameter and the HF tensors it is made of."""

    megatron: str
    hf: tuple[str, ...]
    kind: str  # "replicated" | "column" | "row" | "qkv" | "glu" | "experts_glu" | "experts" | "expert_bias"


EXPERT_KINDS = ("experts_glu", "experts")
"""Kinds of stacked expert weights: split over the expert-parallel group on their leading (expert) axis."""
EXPERT_BIAS = "expert_bias"
"""Kind of the router's score-correction bias: a replicated float32 buffer (``router_buffers``)."""


def router_buffers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The routers' score-correction biases of ``model`` by name (buffers that the HF mapping carries like weights)."""
    return {name: b for name, b in model.named_buffers() if name.endswith("mlp.router.expert_bias")}


def hf_dtype(m: _Mapping, dtype: torch.dtype) -> torch.dtype:
    """The dtype ``m``'s HF tensors are moved in: float32 for the score-correction bias, else ``dtype``."""
    return torch.float32 if m.kind == EXPERT_BIAS else dtype


def _moe_mappings(spec: HFModelSpec, hf: str, mg: str) -> list[_Mapping]:
    """An MoE layer's router and stacked experts (HF names: every expert's gate, then every up; every down)."""
    experts = range(spec.moe.num_experts)
    gate_up = tuple(f"{hf}mlp.experts.{e}.{p}_proj.weight" for p in ("gate", "up") for e in experts)
    down = tuple(f"{hf}mlp.experts.{e}.down_proj.weight" for e in experts)
    maps = [_Mapping(mg + "mlp.router.weight", (hf + "mlp.gate.weight",), "replicated")]
    if spec.moe.expert_bias:
        maps.append(_Mapping(mg + "mlp.router.expert_bias", (hf + "mlp.gate.e_score_correction_bias",), EXPERT_BIAS))
    maps += [
        _Mapping(mg + "mlp.experts.weight1", gate_up, "experts_glu"),
        _Mapping(mg + "mlp.experts.weight2", down, "experts"),
    ]
    if spec.moe.shared_ffn_hidden_size:
        shared = hf + "mlp.shared_experts."
        fc1 = (shared + "gate_proj.weight", shared + "up_proj.weight")
        maps.append(_Mapping(mg + "mlp.shared_experts.linear_fc1.weight", fc1, "glu"))
        maps.append(_Mapping(mg + "mlp.shared_experts.linear_fc2.weight", (shared + "down_proj.weight",), "row"))
    return maps


def weight_mappings(spec: HFModelSpec) -> list[_Mapping]:
    """Every Megatron parameter of the model and its HF source tensors, in HF order."""
    maps = [_Mapping("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "column")]
    for i in range(spec.num_layers):
        hf, mg = f"model.layers.{i}.", f"decoder.layers.{i}."
        attn = hf + "self_attn."
        maps.append(_Mapping(mg + "input_layernorm.weight", (hf + "input_layernorm.weight",), "replicated"))
        maps.append(
            _Mapping(
                mg + "self_attention.linear_qkv.weight",
                tuple(f"{attn}{p}_proj.weight" for p in "qkv"),
                "qkv",
            )
        )
        if spec.qkv_bias:
            maps.append(
                _Mapping(mg + "self_attention.linear_qkv.bias", tuple(f"{attn}{p}_proj.bias" for p in "qkv"), "qkv")
            )
        if spec.qk_norm:
            maps.append(_Mapping(mg + "self_attention.q_layernorm.weight", (attn + "q_norm.weight",), "replicated"))
            maps.append(_Mapping(mg + "self_attention.k_layernorm.weight", (attn + "k_norm.weight",), "replicated"))
        maps.append(_Mapping(mg + "self_attention.linear_proj.weight", (attn + "o_proj.weight",), "row"))
        maps.append(_Mapping(mg + "pre_mlp_layernorm.weight", (hf + "post_attention_layernorm.weight",), "replicated"))
        if spec.moe is not None and spec.moe.layers[i]:
            maps.extend(_moe_mappings(spec, hf, mg))
            continue
        maps.append(
            _Mapping(mg + "mlp.linear_fc1.weight", (hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight"), "glu")
        )
        maps.append(_Mapping(mg + "mlp.linear_fc2.weight", (hf + "mlp.down_proj.weight",), "row"))
    maps.append(_Mapping("decoder.final_layernorm.weight", ("model.norm.weight",), "replicated"))
    if not spec.tie_word_embeddings:
        maps.append(_Mapping("output_layer.weight", ("lm_head.weight",), "column"))
    return maps


def stage_mappings(spec: HFModelSpec, stage: PipelineStage) -> list[tuple[_Mapping, str]]:
    """The mappings of the parameters ``stage`` holds, with their names in its module (for loading).

    With tied embeddings the last stage (when it is not also the first) holds a copy of the word embedding as its
    output weight, loaded from the same HF tensor (and not exported: the first stage exports it).
    """
    maps = [(m, stage.local_name(m.megatron)) for m in weight_mappings(spec) if stage.owner(m.megatron) == stage.rank]
    if spec.tie_word_embeddings and stage.last and not stage.first:
        maps.append((_Mapping("output_layer.weight", ("model.embed_tokens.weight",), "column"), "output_layer.weight"))
    return maps


def expected_hf_shapes(spec: HFModelSpec) -> dict[str, tuple[int, ...]]:
    """The full (unsharded) shape of every HF tensor the model needs."""
    h, d, inter = spec.hidden_size, spec.head_dim, spec.ffn_hidden_size
    q_out, kv_out = spec.num_attention_heads * d, spec.num_key_value_heads * d
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (spec.vocab_size, h), "model.norm.weight": (h,)}
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q_out, h),
            p + "self_attn.k_proj.weight": (kv_out, h),
            p + "self_attn.v_proj.weight": (kv_out, h),
            p + "self_attn.o_proj.weight": (h, q_out),
        }
        if spec.moe is not None and spec.moe.layers[i]:
            f = spec.moe.ffn_hidden_size
            shapes[p + "mlp.gate.weight"] = (spec.moe.num_experts, h)
            if spec.moe.expert_bias:
                shapes[p + "mlp.gate.e_score_correction_bias"] = (spec.moe.num_experts,)
            if spec.moe.shared_ffn_hidden_size:
                x, s = p + "mlp.shared_experts.", spec.moe.shared_ffn_hidden_size
                shapes |= {x + "gate_proj.weight": (s, h), x + "up_proj.weight": (s, h), x + "down_proj.weight": (h, s)}
            for e in range(spec.moe.num_experts):
                x = f"{p}mlp.experts.{e}."
                shapes |= {x + "gate_proj.weight": (f, h), x + "up_proj.weight": (f, h), x + "down_proj.weight": (h, f)}
        else:
            shapes |= {p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h)}
            shapes[p + "mlp.down_proj.weight"] = (h, inter)
        if spec.qkv_bias:
            shapes |= {p + "self_attn.q_proj.bias": (q_out,), p + "self_attn.k_proj.bias": (kv_out,)}
            shapes[p + "self_attn.v_proj.bias"] = (kv_out,)
        if spec.qk_norm:
            shapes |= {p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)}
    if not spec.tie_word_embeddings:
        shapes["lm_head.weight"] = (spec.vocab_size, h)
    return shapes


def local_hf_names(m: _Mapping, ep_rank: int, ep_size: int) -> tuple[str, ...]:
    """The HF tensors this rank's shard of ``m`` is made of: its own experts' for stacked experts, else all."""
    if m.kind not in EXPERT_KINDS:
        return m.hf
    runs = (m.hf[: len(m.hf) // 2], m.hf[len(m.hf) // 2 :]) if m.kind == "experts_glu" else (m.hf,)
    local = len(runs[0]) // ep_size
    return tuple(name for run in runs for name in run[ep_rank * local : (ep_rank + 1) * local])


def _to_local(m: _Mapping, full: list[torch.Tensor], spec: HFModelSpec, rank: int, size: int) -> torch.Tensor:
    """Megatron's local shard of one parameter from its HF tensors (for experts: this rank's, ``local_hf_names``)."""
    if m.kind == "experts":
        return torch.stack(full)
    if m.kind == "experts_glu":
        gates, ups = full[: len(full) // 2], full[len(full) // 2 :]
        return torch.stack([torch.cat([g, u]) for g, u in zip(gates, ups, strict=True)])
    if m.kind in ("replicated", EXPERT_BIAS):
        return full[0]
    if m.kind == "column":  # vocab-parallel: embedding / LM head, padded when the vocabulary does not split
        return pad_vocab_rows(full[0], padded_vocab_size(spec.vocab_size, size)).chunk(size, dim=0)[rank]
    if m.kind == "row":
        return full[0].chunk(size, dim=1)[rank]
    if m.kind == "glu":
        gate, up = (t.chunk(size, dim=0)[rank] for t in full)
        return torch.cat([gate, up], dim=0)
    groups, d = spec.num_key_value_heads, spec.head_dim
    q, k, v = full
    rest = q.shape[1:]
    q = q.reshape(groups, -1, d, *rest)  # [G, heads_per_group, d, ...]
    qkv = torch.cat([q, k.reshape(groups, 1, d, *rest), v.reshape(groups, 1, d, *rest)], dim=1)
    return qkv.chunk(size, dim=0)[rank].reshape(-1, *rest)


def _to_hf(m: _Mapping, gathered: list[torch.Tensor], spec: HFModelSpec) -> list[torch.Tensor]:
    """Full HF tensors from the shards of one parameter (rank order: TP, or EP for stacked experts)."""
    if m.kind in EXPERT_KINDS:
        full = torch.cat(gathered, dim=0) if len(gathered) > 1 else gathered[0]
        if m.kind == "experts":
            return list(full.unbind(0))
        gates, ups = full.chunk(2, dim=1)
        return [*gates.unbind(0), *ups.unbind(0)]
    if m.kind in ("replicated", EXPERT_BIAS):
        return [gathered[0]]
    if m.kind == "column":
        return [torch.cat(gathered, dim=0)[: spec.vocab_size]]  # drop vocabulary padding
    if m.kind == "row":
        return [torch.cat(gathered, dim=1)]
    if m.kind == "glu":
        halves = [t.chunk(2, dim=0) for t in gathered]
        return [torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])]
    groups, d = spec.num_key_value_heads, spec.head_dim
    full = torch.cat(gathered, dim=0)
    rest = full.shape[1:]
    qkv = full.reshape(groups, -1, d, *rest)
    q = qkv[:, :-2].reshape(-1, *rest)
    return [q, qkv[:, -2].reshape(-1, *rest), qkv[:, -1].reshape(-1, *rest)]


def gather_shards(m: _Mapping, local: torch.Tensor) -> list[torch.Tensor] | None:
    """Every rank's shard of one parameter (collective over the group that splits it); None when it is whole here.

    Stacked experts are split over the expert-parallel group, the other sharded kinds over the tensor-parallel one.
    """
    if m.kind in ("replicated", EXPERT_BIAS):
        return None
    if m.kind in EXPERT_KINDS:
        group = parallel_state.get_expert_model_parallel_group()
    else:
        group = parallel_state.get_tensor_model_parallel_group()
    if group is None or dist.get_world_size(group) == 1:
        return None
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, local.contiguous(), group=group)
    return gathered


def _beyond_the_model(spec: HFModelSpec, name: str) -> bool:
    """A tensor of a layer past the decoder's (GLM-4.5's multi-token-prediction layer), which the model ignores."""
    if spec.model_type != "glm4_moe" or not name.startswith("model.layers."):
        return False
    index = name.split(".")[2]
    return index.isdigit() and int(index) >= spec.num_layers


def _check_hf(spec: HFModelSpec, reader: HFCheckpointReader) -> None:
    """Every tensor the config implies, none it does not, each of its shape: from the shards' headers alone."""
    expected = expected_hf_shapes(spec)
    available = set(reader.names())
    missing = sorted(set(expected) - available)
    extra = sorted(
        n
        for n in available - set(expected)
        if not n.endswith(_IGNORED_HF_SUFFIXES)
        and not (spec.tie_word_embeddings and n == "lm_head.weight")
        and not _beyond_the_model(spec, n)
    )
    if missing or extra:
        raise ValueError(
            f"HF checkpoint does not match its config ({spec.model_type}, {spec.num_layers} layers): "
            f"missing tensors {missing[:8]}{'...' if len(missing) > 8 else ''}, "
            f"unexpected tensors {extra[:8]}{'...' if len(extra) > 8 else ''}"
        )
    for name, shape in expected.items():
        if reader.shape(name) != shape:
            raise ValueError(f"HF tensor {name} has shape {reader.shape(name)}, expected {shape} from config.json")


def _open_on_rank0(spec: HFModelSpec, hf_dir: str | Path, rank: int, world: int) -> HFCheckpointReader | None:
    """Rank 0's checked reader (None elsewhere); a problem rank 0 finds is raised on every rank, not only there."""
    reader, problem = None, None
    if rank == 0:
        try:
            reader = HFCheckpointReader(hf_dir)
            _check_hf(spec, reader)
        except Exception as e:  # raised on every rank below: the others must not wait for tensors that never come
            problem = e
    if world > 1:
        box = [problem]
        dist.broadcast_object_list(box, src=0)
        problem = box[0]
    if problem is not None:
        raise problem
    return reader


@torch.no_grad()
def load_hf_weights(
    model: GPTModel,
    spec: HFModelSpec,
    hf_dir: str | Path,
    stage: PipelineStage | None = None,
    *,
    value_head: bool = False,
) -> int:
    """Copy an HF checkpoint's weights into every rank's shards of ``model`` (``stage``'s layers, embedding, head).

    Collective over the default process group (the actor's ranks; a single process without one): rank 0 alone
    reads the checkpoint, each HF tensor once, and broadcasts it in the model's dtype; every rank keeps its own TP
    shard of the tensors its pipeline stage holds. So only rank 0's node needs the weight files, and the job
    reads them once, whatever its TP, CP, PP and DP sizes. With ``value_head`` (a critic,
    :func:`build_gpt_model`) the LM head is not loaded and the value head keeps its initial weights.

    Returns:
        The bytes of tensor data this rank read from the checkpoint (0 on every rank but 0).

    Raises:
        ValueError: on every rank, a tensor is missing, unexpected or has the wrong shape (the message names it).
        HFCheckpointError: on every rank, ``hf_dir`` is not a readable HF checkpoint.
    """
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    reader = _open_on_rank0(spec, hf_dir, rank, world)
    shapes = expected_hf_shapes(spec)
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    ep_rank = parallel_state.get_expert_model_parallel_rank()
    ep_size = parallel_state.get_expert_model_parallel_world_size()
    params = dict(model.named_parameters()) | router_buffers(model)
    some = next(iter(params.values()))
    stage = stage or PipelineStage(rank=0, size=1, num_layers=spec.num_layers)
    local_of: dict[tuple[str, ...], list[tuple[_Mapping, str]]] = {}  # HF names -> this rank's parameters of them
    for m, local_name in stage_mappings(spec, stage):
        if not (value_head and m.megatron == "output_layer.weight"):
            local_of.setdefault(m.hf, []).append((m, local_name))
    for m in weight_mappings(spec):  # the same order on every rank: one broadcast per HF tensor
        if value_head and m.megatron == "output_layer.weight":
            continue
        full: dict[str, torch.Tensor] = {}
        dtype = hf_dtype(m, some.dtype)
        for name in m.hf:
            if reader is not None:
                tensor = reader.get(name).to(device=some.device, dtype=dtype)
            else:
                tensor = torch.empty(shapes[name], device=some.device, dtype=dtype)
            if world > 1:
                dist.broadcast(tensor, src=0)
            full[name] = tensor
        for mine, local_name in local_of.pop(m.hf, []):
            param = params.pop(local_name, None)
            if param is None:
                raise ValueError(f"Megatron model has no parameter {local_name} (for HF {', '.join(m.hf)})")
            own = [full[name] for name in local_hf_names(mine, ep_rank, ep_size)]  # stacked experts: this rank's
            local = _to_local(mine, own, spec, tp_rank, tp_size)
            if local.shape != param.shape:
                raise ValueError(f"{local_name}: shard shape {tuple(local.shape)} != parameter {tuple(param.shape)}")
            param.copy_(local)
    if value_head:
        params = {k: v for k, v in params.items() if not k.startswith("output_layer.")}
    if params:
        raise ValueError(f"Megatron parameters with no HF source: {sorted(params)}")
    read = 0 if reader is None else reader.bytes_read
    logger.info(
        "loaded HF tensors from %s (tp rank %d/%d, pp stage %d/%d): %s",
        hf_dir,
        tp_rank,
        tp_size,
        stage.rank,
        stage.size,
        f"read {read} bytes for {world} rank(s)" if reader is not None else "broadcast from rank 0",
    )
    return read


@torch.no_grad()
def named_hf_tensors(
    model: GPTModel,
    spec: HFModelSpec,
    *,
    params: dict[str, torch.Tensor] | None = None,
    stage: PipelineStage | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, full tensor on CPU)`` for every HF tensor of the whole model, gathering TP and EP shards.

    Every TP (and expert-parallel) rank must iterate (the gathers are collective); every rank receives the full
    tensors. With pipeline stages every rank of the pipeline must iterate too: each tensor is broadcast from the
    stage that holds it. ``params`` (Megatron name in this stage's module -> tensor) replaces the model's parameters,
    e.g. the fp32 main copies.
    """
    params = dict(model.named_parameters()) if params is None else params
    if spec.moe is not None and spec.moe.expert_bias:
        params = {**params, **router_buffers(model)}
    stage = stage or PipelineStage(rank=0, size=1, num_layers=spec.num_layers)
    shapes = expected_hf_shapes(spec)
    some = next(iter(params.values()))
    for m in weight_mappings(spec):
        owner = stage.owner(m.megatron)
        if owner != stage.rank:  # another stage's: receive it
            for name in m.hf:
                tensor = torch.empty(shapes[name], dtype=hf_dtype(m, some.dtype), device=some.device)
                broadcast_from_stage(tensor, owner)
                yield name, tensor.to("cpu")
            continue
        local = params[stage.local_name(m.megatron)].detach()
        gathered = gather_shards(m, local) or [local]
        for name, tensor in zip(m.hf, _to_hf(m, gathered, spec), strict=True):
            if stage.size > 1:
                tensor = tensor.contiguous()
                broadcast_from_stage(tensor, owner)
            yield name, tensor.to("cpu").contiguous()
