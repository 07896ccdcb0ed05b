"""The actor's memory plan: the peak GPU memory of one trainer rank, estimated before anything starts.

Standard library only, so the app can plan at parse time. The estimate adds, per GPU:

- **resident state**: parameters (in ``--params-dtype``), fp32 main copies and gradients (``--fp32-main-params``)
  or gradients in the parameters' dtype, AdamW's two moments (none on the GPU with ``--optimizer-cpu-offload``),
  a reference model's weights when a KL term needs one, a critic with its optimizer for PPO; with LoRA
  (``--lora-rank``) the base parameters alone, and main copies, gradients and moments of the adapters only (the
  reference is the base: no second copy);
- **activations** of one training micro-batch of ``tokens`` tokens kept for backward: per token and layer the
  tensors the layer saves (see ``layer_activation_bytes``), for a recomputed layer its input (what the checkpoint
  keeps), plus one layer's worth while a recomputed layer runs its backward;
  the final hidden states; the LM head's logits (all of
  them with ``--no-recompute-lm-head``, one chunk otherwise); cuDNN's padded q/k/v copies when a sequence can reach
  ``--cudnn-attention-min-tokens``;
- **the backward's transient**: the largest set of gradients alive at once (one layer's MLP, or one LM-head chunk).

A mixture-of-experts model (``qwen3_moe``, ``glm4_moe``) counts its MoE layers' router and this rank's share of the
experts (``--expert-model-parallel-size``), and in their activations each token's top-k copies through the experts
(the dispatched input, the gate/up output and the SwiGLU output, in even balance) instead of the dense MLP's; a
shared expert (``glm4_moe``) counts as a dense SwiGLU MLP of its width in every MoE layer.

The log-prob pass (``--log-probs-max-tokens-per-gpu``) keeps no activations: resident state plus the larger of one
layer's forward and one LM-head chunk. Co-located engines take ``--sglang-mem-fraction-static`` of the card on top.
The formula's terms are those of the CUDA path (bf16, fused kernels); bench/memory_plan_gpu.py compares it with
the measured peak.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tidal.actor.config import ActorConfig

GIB = 2**30
ALIGN = 128
"""Token budgets the plan proposes are multiples of this (the usual --pad-to-multiple-of)."""
ALLOCATOR_HEADROOM = 0.05
"""Share of the card kept free for the caching allocator's fragmentation and the CUDA context."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelShape:
    """The dimensions of a decoder-only model that decide its memory (from an HF ``config.json``)."""

    vocab_size: int
    """Rows of the embedding and LM head."""
    hidden_size: int
    """Model width h."""
    ffn_hidden_size: int
    """MLP intermediate size F (per gate/up projection)."""
    num_layers: int
    """Decoder layers."""
    num_attention_heads: int
    """Query heads."""
    num_key_value_heads: int
    """Key/value heads."""
    head_dim: int
    """Channels per head."""
    tie_word_embeddings: bool
    """The LM head shares the embedding matrix."""
    qkv_bias: bool = False
    """The q/k/v projections carry a bias (Qwen2)."""
    qk_norm: bool = False
    """Per-head RMSNorm of queries and keys (Qwen3): the layer keeps q/k before the norm too."""
    num_experts: int = 0
    """Routed experts of each MoE layer (0: a dense model)."""
    experts_per_token: int = 0
    """Experts each token is routed to (top-k)."""
    moe_ffn_hidden_size: int = 0
    """Intermediate size of one expert."""
    num_moe_layers: int = 0
    """Decoder layers with routed experts (the others have the dense MLP of ``ffn_hidden_size``)."""
    shared_ffn_hidden_size: int = 0
    """Intermediate size of the shared expert beside the routed ones in each MoE layer (0: none)."""

    @classmethod
    def from_hf_config(cls, cfg: dict) -> ModelShape:
        """The shape of an HF ``config.json`` dict (qwen2, qwen3, llama, qwen3_moe, glm4_moe and the like)."""
        heads = int(cfg["num_attention_heads"])
        layers = int(cfg["num_hidden_layers"])
        experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts") or 0)
        glm = cfg.get("model_type") == "glm4_moe"
        moe = {}
        if glm and experts:  # tidal.actor.glm4_moe: dense first layers, a shared expert
            moe = dict(
                num_experts=experts,
                experts_per_token=int(cfg["num_experts_per_tok"]),
                moe_ffn_hidden_size=int(cfg["moe_intermediate_size"]),
                num_moe_layers=layers - min(layers, int(cfg.get("first_k_dense_replace") or 0)),
                shared_ffn_hidden_size=int(cfg.get("n_shared_experts") or 0) * int(cfg["moe_intermediate_size"]),
            )
        elif experts and cfg.get("moe_intermediate_size"):  # qwen3_moe's layer pattern (tidal.actor.moe_spec)
            step, dense = int(cfg.get("decoder_sparse_step") or 1), set(cfg.get("mlp_only_layers") or ())
            moe = dict(
                num_experts=experts,
                experts_per_token=int(cfg["num_experts_per_tok"]),
                moe_ffn_hidden_size=int(cfg["moe_intermediate_size"]),
                num_moe_layers=sum(i not in dense and (i + 1) % step == 0 for i in range(layers)),
            )
        return cls(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            ffn_hidden_size=int(cfg["intermediate_size"]),
            num_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=cfg.get("model_type") == "qwen2" or bool(cfg.get("attention_bias", False)),
            qk_norm=cfg.get("model_type") in ("qwen3", "qwen3_moe") or (glm and bool(cfg.get("use_qk_norm"))),
            **moe,
        )

    @property
    def qkv_width(self) -> int:
        """Channels of the fused q/k/v projection's output."""
        return (self.num_attention_heads + 2 * self.num_key_value_heads) * self.head_dim

    def layer_params(self, tp: int = 1) -> int:
        """Parameters of one dense decoder layer on one tensor-parallel rank (norms are replicated)."""
        h, f, q = self.hidden_size, self.ffn_hidden_size, self.num_attention_heads * self.head_dim
        sharded = h * self.qkv_width + (self.qkv_width if self.qkv_bias else 0) + q * h + 3 * h * f
        return sharded // tp + 2 * h + (2 * self.head_dim if self.qk_norm else 0)

    def lora_layer_params(self, rank: int, modules: tuple[str, ...], tp: int = 1) -> int:
        """Adapter parameters of one decoder layer on one TP rank (``modules``: HF names, ``lora_targets``)."""
        h, f = self.hidden_size, self.ffn_hidden_size
        q, kv = self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        column = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "gate_proj": (h, f), "up_proj": (h, f)}
        row = {"o_proj": (q, h), "down_proj": (f, h)}
        total = sum(rank * (i + o // tp) for m, (i, o) in column.items() if m in modules)  # B split
        return total + sum(rank * (i // tp + o) for m, (i, o) in row.items() if m in modules)  # A split

    def moe_layer_params(self, ep: int = 1) -> int:
        """Parameters of one MoE layer on one expert-parallel rank: attention, norms, router, its share of experts."""
        experts = self.num_experts // ep * 3 * self.hidden_size * self.moe_ffn_hidden_size
        return (
            self.layer_params()
            - 3 * self.hidden_size * (self.ffn_hidden_size - self.shared_ffn_hidden_size)
            + self.num_experts * self.hidden_size
            + experts
        )

    def all_layer_params(self, tp: int = 1, ep: int = 1) -> int:
        """Parameters of every decoder layer on one rank (dense and MoE layers)."""
        dense = self.num_layers - self.num_moe_layers
        return dense * self.layer_params(tp) + self.num_moe_layers * self.moe_layer_params(ep)

    def embedding_params(self, tp: int = 1) -> int:
        """Parameters of the embedding (or of an untied LM head) on one rank, the vocabulary padded for TP.

        The padding is ``vocab_padding.padded_vocab_size``'s: none when TP divides the vocabulary.
        """
        padded = self.vocab_size if self.vocab_size % tp == 0 else -(-self.vocab_size // (ALIGN * tp)) * ALIGN * tp
        return padded // tp * self.hidden_size

    def num_params(self) -> int:
        """Parameters of the whole model."""
        heads = 1 if self.tie_word_embeddings else 2
        return self.all_layer_params() + heads * self.embedding_params() + self.hidden_size


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryInputs:
    """What the plan needs beyond the model: the actor's options, the parallel layout and the token budgets."""

    train_tokens: int
    """Tokens of the largest training micro-batch on one GPU (``--max-tokens-per-gpu``, or sequences x length)."""
    logprob_tokens: int
    """Tokens of the largest forward-only micro-batch on one GPU (``--log-probs-max-tokens-per-gpu``)."""
    longest_sequence: int
    """Longest prompt + response, which decides whether cuDNN's padded copies can occur."""
    params_dtype: str = "bfloat16"
    """``--params-dtype``."""
    bf16: bool = False
    """``--bf16`` (fp32 weights under bf16 autocast: activations in bf16)."""
    fp32_main_params: bool = True
    """``--fp32-main-params``."""
    optimizer_cpu_offload: bool = False
    """``--optimizer-cpu-offload``: AdamW's moments live in host memory."""
    recompute_activations: bool = False
    """``--recompute-activations``."""
    recompute_num_layers: int = 0
    """``--recompute-num-layers`` (0: every layer of the stage)."""
    recompute_lm_head: bool = True
    """False with ``--no-recompute-lm-head``: every chunk's logits stay for backward."""
    log_probs_chunk_size: int = 1024
    """``--log-probs-chunk-size``: rows per LM-head chunk."""
    cudnn_attention_min_tokens: int = 2048
    """``--cudnn-attention-min-tokens`` (0: no padded copies)."""
    fused_kernels: bool = True
    """Triton kernels for SwiGLU, RoPE, RMSNorm and the log-softmax (the CUDA path)."""
    tensor_parallel: int = 1
    """``--tensor-model-parallel-size``."""
    pipeline_parallel: int = 1
    """``--pipeline-model-parallel-size``."""
    context_parallel: int = 1
    """``--context-parallel-size`` (each GPU holds 1/CP of a micro-batch's tokens)."""
    expert_parallel: int = 1
    """``--expert-model-parallel-size`` (each GPU holds 1/EP of every MoE layer's experts)."""
    reference_model: bool = False
    """A reference model's weights are resident (a KL loss or KL penalty)."""
    critic: bool = False
    """A critic with its own optimizer shares the GPU (``--advantage-estimator ppo``)."""
    lora_rank: int = 0
    """``--lora-rank`` (0: full fine-tuning)."""
    lora_target_modules: tuple[str, ...] = ("all-linear",)
    """``--lora-target-modules``."""

    @classmethod
    def from_actor_config(cls, cfg: ActorConfig, **kwargs: object) -> MemoryInputs:
        """The inputs of ``cfg``'s options; ``kwargs`` give the budgets, the layout and the extra models."""
        names = (
            "params_dtype",
            "bf16",
            "fp32_main_params",
            "optimizer_cpu_offload",
            "recompute_activations",
            "recompute_num_layers",
            "recompute_lm_head",
            "log_probs_chunk_size",
            "cudnn_attention_min_tokens",
            "fused_kernels",
            "lora_rank",
            "lora_target_modules",
        )
        return cls(**{name: getattr(cfg, name) for name in names}, **kwargs)


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryPlan:
    """The estimate: named rows in bytes and the peaks they add up to."""

    rows: tuple[tuple[str, int], ...]
    """(what, bytes) in the order of the table; the training peak is their sum."""
    train_peak: int
    """Peak bytes of a training step on one GPU."""
    logprob_peak: int
    """Peak bytes of a forward-only (log-prob) pass on one GPU."""
    inputs: MemoryInputs
    """What the plan was made from."""
    engine_bytes: int = 0
    """Bytes the co-located engines take of the same card (0: decoupled, or no card known)."""
    gpu_bytes: int | None = None
    """The card's memory, when known."""
    notes: tuple[str, ...] = field(default=())
    """What the estimate leaves out or assumes."""

    @property
    def peak(self) -> int:
        """The larger of the two peaks, plus the co-located engines' share."""
        return max(self.train_peak, self.logprob_peak) + self.engine_bytes

    @property
    def limit(self) -> int | None:
        """Bytes the actor may use: the card less the allocator's headroom (None when no card is known)."""
        return None if self.gpu_bytes is None else int(self.gpu_bytes * (1.0 - ALLOCATOR_HEADROOM))

    def fits(self) -> bool | None:
        """Whether the peak fits the card (None when no card is known)."""
        return None if self.limit is None else self.peak <= self.limit

    def table(self) -> str:
        """The plan as a short fixed-width table (GiB)."""
        lines = [f"memory plan per GPU (GiB), training micro-batch {self.inputs.train_tokens} tokens:"]
        lines += [f"  {name:<40} {size / GIB:8.2f}" for name, size in self.rows]
        lines.append(f"  {'training peak':<40} {self.train_peak / GIB:8.2f}")
        lines.append(f"  {f'log-prob peak ({self.inputs.logprob_tokens} tokens)':<40} {self.logprob_peak / GIB:8.2f}")
        if self.engine_bytes:
            lines.append(f"  {'co-located engines':<40} {self.engine_bytes / GIB:8.2f}")
        if self.gpu_bytes is not None:
            verdict = "fits" if self.fits() else "DOES NOT FIT"
            lines.append(f"  {'card (less 5% headroom)':<40} {self.limit / GIB:8.2f}  {verdict}")
        return "\n".join(lines)

    def to_json(self) -> str:
        """The plan as JSON (bytes and GiB), for the run folder."""
        return json.dumps(
            {
                "rows_gib": {name: round(size / GIB, 3) for name, size in self.rows},
                "train_peak_gib": round(self.train_peak / GIB, 3),
                "logprob_peak_gib": round(self.logprob_peak / GIB, 3),
                "engine_gib": round(self.engine_bytes / GIB, 3),
                "gpu_gib": None if self.gpu_bytes is None else round(self.gpu_bytes / GIB, 3),
                "fits": self.fits(),
                "inputs": asdict(self.inputs),
                "notes": list(self.notes),
            },
            indent=2,
        )


def _activation_bytes(inputs: MemoryInputs) -> int:
    return 2 if inputs.params_dtype == "bfloat16" or inputs.bf16 else 4


def layer_activation_bytes(shape: ModelShape, inputs: MemoryInputs) -> int:
    """Bytes one layer keeps for backward per token on one GPU (no recompute).

    With fused kernels (the CUDA path): the first norm's input and output (the q/k/v projection's input), the
    rotated q/k/v (the attention's inputs; with a q/k norm also their input), the attention's output (the output
    projection's input) and its fp32 log-sum-exp, the second norm's input and output (the MLP's input), the
    gate/up projection's output (SwiGLU's input) and SwiGLU's output (the down projection's input); each norm's
    fp32 inverse RMS. Unfused, SwiGLU keeps its two halves and their product too.
    """
    tp, e = inputs.tensor_parallel, _activation_bytes(inputs)
    h, f = shape.hidden_size, shape.ffn_hidden_size // tp
    qkv, attn = shape.qkv_width // tp, shape.num_attention_heads * shape.head_dim // tp
    elements = 4 * h + qkv + (qkv if shape.qk_norm else 0) + attn + 3 * f
    if not inputs.fused_kernels:
        elements += 3 * f
    return elements * e + 4 * (2 + shape.num_attention_heads // tp)


def moe_layer_activation_bytes(shape: ModelShape, inputs: MemoryInputs) -> int:
    """Bytes one MoE layer keeps for backward per token.

    The attention's as a dense layer's; then per routed copy (top-k) the dispatched input, the gate/up output,
    SwiGLU's output and its probability-scaled copy (the down projection's input); the shared expert's as a dense
    MLP's of its width; the router's fp32 logits and probabilities.
    """
    e, h, f = _activation_bytes(inputs), shape.hidden_size, shape.moe_ffn_hidden_size
    dense_mlp = 3 * shape.ffn_hidden_size // inputs.tensor_parallel * e * (1 if inputs.fused_kernels else 2)
    routed = shape.experts_per_token * (h + 4 * f) * e
    shared = 3 * shape.shared_ffn_hidden_size * e * (1 if inputs.fused_kernels else 2)
    return layer_activation_bytes(shape, inputs) - dense_mlp + routed + shared + 8 * shape.num_experts


def _mean_layer_activation_bytes(shape: ModelShape, inputs: MemoryInputs) -> int:
    dense = (shape.num_layers - shape.num_moe_layers) * layer_activation_bytes(shape, inputs)
    moe = shape.num_moe_layers * moe_layer_activation_bytes(shape, inputs) if shape.num_moe_layers else 0
    return -(-(dense + moe) // shape.num_layers)


def _max_layer_activation_bytes(shape: ModelShape, inputs: MemoryInputs) -> int:
    dense = layer_activation_bytes(shape, inputs) if shape.num_moe_layers < shape.num_layers else 0
    return max(dense, moe_layer_activation_bytes(shape, inputs) if shape.num_moe_layers else 0)


def _mlp_transient_elements(shape: ModelShape, inputs: MemoryInputs, *, forward_only: bool = False) -> int:
    """Elements per token of one layer's MLP working set (forward and the backward's gradients).

    In a forward-only pass with a LoRA adapter on the gate/up projection, the adapter's per-module outputs and their
    fused delta sit beside the projection's output while they are added: three times the projection's width in all
    (measured on an H100, bench/auto_plan_gpu.py; in training the backward's gradients are the larger set). An MoE
    layer's forward-only working set holds the routed tokens twice (the dispatcher's permuted copy and the
    un-permuted output, ``experts_per_token * hidden`` each) beside the experts' own: fitted on Qwen3-30B-A3B's width
    at 32k and 131k tokens on an H100, where one copy fewer left the plan 6% under the measured peak.
    """
    f = shape.ffn_hidden_size // inputs.tensor_parallel
    dense = 3 * f
    if forward_only and inputs.lora_rank and _lora_on_fc1(inputs):
        dense = 6 * f
    if not shape.num_moe_layers:
        return dense
    routed = (2 if forward_only else 1) * shape.hidden_size
    return max(dense, shape.experts_per_token * (routed + 3 * shape.moe_ffn_hidden_size))


def _lora_on_fc1(inputs: MemoryInputs) -> bool:
    from tidal.actor.lora_targets import resolve_target_modules

    return bool({"gate_proj", "up_proj"} & set(resolve_target_modules(inputs.lora_target_modules)))


def _layers_per_stage(shape: ModelShape, inputs: MemoryInputs) -> int:
    return -(-shape.num_layers // inputs.pipeline_parallel)


def _resident(shape: ModelShape, inputs: MemoryInputs) -> list[tuple[str, int]]:
    tp, pp = inputs.tensor_parallel, inputs.pipeline_parallel
    # the stage that holds the embedding (and, in one stage, the LM head): the largest
    heads = 1 if shape.tie_word_embeddings or pp > 1 else 2
    layer_params = -(-shape.all_layer_params(tp, inputs.expert_parallel) // pp)  # even stages
    params = layer_params + heads * shape.embedding_params(tp)
    params += shape.hidden_size  # the final norm
    width = 2 if inputs.params_dtype == "bfloat16" else 4
    rows = [(f"parameters ({inputs.params_dtype})", params * width)]
    if inputs.lora_rank:  # the base is frozen: the trained state is the adapters'
        from tidal.actor.lora_targets import resolve_target_modules

        modules = resolve_target_modules(inputs.lora_target_modules)
        rows = [(f"frozen base parameters ({inputs.params_dtype})", params * width)]
        params = _layers_per_stage(shape, inputs) * shape.lora_layer_params(inputs.lora_rank, modules, tp)
        rows.append(("LoRA adapters", params * width))
    if inputs.fp32_main_params:
        rows += [("fp32 main parameters", params * 4), ("fp32 main gradients", params * 4)]
    else:
        rows.append(("gradients", params * width))
    moments = params * (8 if inputs.fp32_main_params or width == 4 else 4)
    rows.append(
        (
            "AdamW moments (host)" if inputs.optimizer_cpu_offload else "AdamW moments",
            0 if inputs.optimizer_cpu_offload else moments,
        )
    )
    trained = sum(size for _, size in rows)  # the policy's weights, gradients and optimizer state
    if inputs.reference_model and not inputs.lora_rank:  # with LoRA the base is the reference
        rows.append(("reference model", params * width))
    if inputs.critic:  # the same trunk with a value head, its gradients and optimizer
        trunk = params - shape.embedding_params(tp) * (heads - 1)
        rows.append(("critic (weights, gradients, AdamW)", trained * trunk // params))
    return rows


def _chunk_bytes(shape: ModelShape, inputs: MemoryInputs, rows: int) -> int:
    vocab = shape.embedding_params(inputs.tensor_parallel) // shape.hidden_size
    logits = rows * vocab * _activation_bytes(inputs)
    # unfused: an fp32 log-softmax of the chunk next to its logits
    return logits + (0 if inputs.fused_kernels else rows * vocab * 4)


def _activations(shape: ModelShape, inputs: MemoryInputs, tokens: int) -> list[tuple[str, int]]:
    t = -(-tokens // inputs.context_parallel)
    e, h = _activation_bytes(inputs), shape.hidden_size
    layers = _layers_per_stage(shape, inputs)
    recomputed = 0
    if inputs.recompute_activations:
        recomputed = layers if inputs.recompute_num_layers == 0 else min(inputs.recompute_num_layers, layers)
    per_layer = _mean_layer_activation_bytes(shape, inputs)
    rows = [(f"activations ({layers - recomputed} layers kept)", (layers - recomputed) * per_layer * t)]
    if recomputed:
        # the recomputed layer's input, kept by the checkpoint: all it keeps since tidal's checkpoint runs without
        # torch's early stop and the MoE dispatchers let go of their routing graphs (bench/auto_plan_gpu.py measures it)
        rows.append((f"recomputed layers ({recomputed}, held)", recomputed * h * e * t))
        # the first layers are recomputed, so their backward runs after every kept layer's has freed its
        # activations: a rebuilt layer adds to the peak only where it exceeds what the kept layers held
        rebuilt = _max_layer_activation_bytes(shape, inputs) * t - (layers - recomputed) * per_layer * t
        rows.append(("one layer rebuilt in backward", max(rebuilt, 0)))
    if inputs.cudnn_attention_min_tokens and inputs.longest_sequence >= inputs.cudnn_attention_min_tokens:
        padded = (layers - recomputed) * shape.qkv_width // inputs.tensor_parallel * e * t
        rows.append(("cuDNN's padded q/k/v copies", padded))
    chunk = min(inputs.log_probs_chunk_size, t)
    kept = t if not inputs.recompute_lm_head else chunk
    rows.append(("final hidden states and LM-head logits", t * h * e + _chunk_bytes(shape, inputs, kept)))
    # backward: one chunk's logit gradients next to the hidden-state gradient, or one layer's MLP gradients
    mlp_grads = t * (_mlp_transient_elements(shape, inputs) + 2 * h) * e
    rows.append(("gradients in flight (backward)", max(mlp_grads, _chunk_bytes(shape, inputs, chunk) + t * h * 4)))
    return rows


def plan_memory(
    shape: ModelShape, inputs: MemoryInputs, *, gpu_bytes: int | None = None, engine_fraction: float = 0.0
) -> MemoryPlan:
    """The memory plan of one trainer GPU.

    Args:
        shape: the model's dimensions (``ModelShape.from_hf_config``).
        inputs: the actor's options, layout and budgets.
        gpu_bytes: the card's memory, to judge the fit (None: not known, no verdict).
        engine_fraction: the share of the card co-located engines take (``--sglang-mem-fraction-static``; 0 when
            the engines have GPUs of their own).
    """
    resident = _resident(shape, inputs)
    static = sum(size for _, size in resident)
    activations = _activations(shape, inputs, inputs.train_tokens)
    t = -(-inputs.logprob_tokens // inputs.context_parallel)
    e, h = _activation_bytes(inputs), shape.hidden_size
    one_layer = t * (_mlp_transient_elements(shape, inputs, forward_only=True) + 3 * h) * e
    chunk = _chunk_bytes(shape, inputs, min(inputs.log_probs_chunk_size, t))
    logprob_peak = static + max(one_layer, chunk) + t * h * e
    engine = int(engine_fraction * gpu_bytes) if gpu_bytes else 0
    notes = ()
    if inputs.pipeline_parallel > 1:
        notes = ("pipeline: the first stage's activations of in-flight micro-batches are not counted",)
    return MemoryPlan(
        rows=tuple(resident + activations),
        train_peak=static + sum(size for _, size in activations),
        logprob_peak=logprob_peak,
        inputs=inputs,
        engine_bytes=engine,
        gpu_bytes=gpu_bytes,
        notes=notes,
    )


def largest_fitting_tokens(
    shape: ModelShape, inputs: MemoryInputs, *, gpu_bytes: int, engine_fraction: float = 0.0, logprob: bool = False
) -> int:
    """The largest training (or, with ``logprob``, forward-only) micro-batch in tokens that fits the card.

    A multiple of ``ALIGN``; 0 when not even ``ALIGN`` tokens fit (the resident state alone is too large).
    """

    def fits(tokens: int) -> bool:
        key = "logprob_tokens" if logprob else "train_tokens"
        plan = plan_memory(
            shape, replace(inputs, **{key: tokens}), gpu_bytes=gpu_bytes, engine_fraction=engine_fraction
        )
        peak = plan.logprob_peak if logprob else plan.train_peak
        return peak + plan.engine_bytes <= plan.limit

    lo, hi = 0, ALIGN
    while fits(hi) and hi < 2**24:
        lo, hi = hi, hi * 2
    while hi - lo > ALIGN:
        mid = (lo + hi) // 2 // ALIGN * ALIGN
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def gib(size: int | float) -> str:
    """``size`` bytes as "12.3 GiB"."""
    return f"{size / GIB:.1f} GiB" if math.isfinite(size) else "? GiB"
