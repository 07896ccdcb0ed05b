"""Fused q/k/v split + RoPE for packed (THD) self-attention, with cos/sin computed once per forward.

Megatron's ``SelfAttention`` adds the QKV bias in a separate broadcast add, splits its interleaved QKV projection
(``[T, groups, (heads/groups + 2) * dim]``) into q/k/v views, copies q into ``[T, heads, dim]`` (the reshape cannot be
a view), rotates q and k per layer from the ``freqs`` table (a cos and a sin per element, recomputed in every layer,
forward and backward), and ``packed_causal_attention`` repeats k/v per q head (torch 2.11's ``varlen_attn`` has no
grouped-query flag): on the H200 about 0.2 s of a 2.2 s training step (the profile of ``bench/bench_actor_gpu.py``).

``PackedSelfAttention`` takes ``SelfAttention``'s place in the layer spec (context parallel size 1). For packed THD
input with plain RoPE (non-interleaved, full rotary dim, no YaRN ``mscale``, no q/k norm, no output gate) it asks
megatron's QKV projection for its output without the bias and calls ``split_rope_qkv``: one function that adds
the bias and returns contiguous, rotated q and k and a contiguous v (k/v already repeated per q head where the
attention kernel needs it), with the rotation's cos/sin tables (``rope_table``) built once per forward and
shared by every layer of the model (``RopeTables``). Megatron then skips its own RoPE (it receives no
``rotary_pos_emb``). Any other input takes megatron's own path unchanged.

The arithmetic is megatron's ``_apply_rotary_pos_emb_bshd`` (``t * cos + rotate_half(t) * sin``) on fp32 values
with an fp32 cos/sin table, rounded once to ``t``'s dtype (megatron casts the table to ``t``'s dtype and rounds
after each op: in bf16 1.6x the rounding floor, ``tests/test_long_parity.py``); equal to megatron's on fp32 input,
tested on CPU.
With ``fused_kernels`` set on the layer (``set_fused_kernels``: the Actor's ``fused_kernels`` on CUDA)
``split_rope_qkv`` runs as two Triton kernels (``rope_kernel.py``: one forward, one backward, plus the bias
gradient's sum); on CPU, and for a head dim that is not a power of two, it runs eagerly.
"""

from __future__ import annotations

import logging
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP

logger = logging.getLogger(__name__)

# The PackedSelfAttention running megatron's own forward now, for compat patch 5 (megatron's THD RoPE function, which
# sees no layer): its fused_kernels and rope_tables. Set around that forward, reset when it returns.
RUNNING_ATTENTION: ContextVar[PackedSelfAttention | None] = ContextVar("tidal_running_attention", default=None)


def share_rope_tables(model: torch.nn.Module) -> None:
    """Give every ``PackedSelfAttention`` of ``model`` one ``RopeTables``: a forward's layers build one table."""
    tables = RopeTables()
    for module in model.modules():
        if isinstance(module, PackedSelfAttention):
            module.rope_tables = tables


def set_fused_kernels(model: torch.nn.Module, enabled: bool) -> None:
    """Fuse the CUDA kernels of ``model``'s layers, or not (the Actor's ``fused_kernels``).

    ``split_rope_qkv``, SwiGLU and RMSNorm run as Triton kernels, ``compat`` patch 5's RoPE through torch.compile,
    on CUDA tensors only; on CPU every layer runs eagerly either way.
    """
    for module in model.modules():
        if isinstance(module, (PackedSelfAttention, FusedSwiGLUMLP, FusedRMSNorm)):
            module.fused_kernels = enabled


def positions(cu_seqlens: torch.Tensor, n: int, device: torch.device) -> torch.Tensor:
    """Each of ``n`` packed tokens' position inside its own sequence, computed on the device."""
    idx = torch.arange(n, device=device)
    cu = cu_seqlens.to(device=device, dtype=torch.long)
    return idx - cu[torch.searchsorted(cu[1:], idx, right=True).clamp(max=cu.numel() - 2)]


def rope_table(freqs: torch.Tensor, position: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Cos and sin ``[T, 1, dim]`` in fp32 at ``position [T]`` from megatron's fp32 ``freqs [max_len, 1, 1, dim]``.

    Always fp32, also for bf16 activations: a table rounded to bf16 (as megatron's and HF's are) puts up to 2**-9 of
    relative error into every rotation (with bf16 ops, 1.6x the floor of one rounding: ``tests/test_long_parity.py``).
    """
    f = freqs[position].reshape(position.numel(), 1, freqs.size(-1)).float()
    return f.cos(), f.sin()


def packed_rope_table(freqs: torch.Tensor, cu_seqlens: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``rope_table`` for ``n`` packed tokens whose sequences restart at ``cu_seqlens`` (no autograd history)."""
    with torch.no_grad():
        return rope_table(freqs, positions(cu_seqlens, n, freqs.device))


class RopeTables:
    """One model's last RoPE table, reused while the same ``freqs`` and ``cu_seqlens`` objects come back.

    Every layer of one forward passes the same two objects, so the table is built once per micro-batch instead of
    twice per layer. A new micro-batch (a new ``cu_seqlens``) or grad mode builds a new one. The key holds strong
    references, so an identity match cannot be a recycled object.
    """

    def __init__(self) -> None:
        self._last: tuple[tuple[Any, ...], tuple[torch.Tensor, torch.Tensor]] | None = None

    def get(self, freqs: torch.Tensor, cu_seqlens: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``packed_rope_table(freqs, cu_seqlens, n)``, built once for a run of calls with the same objects."""
        key = (freqs, cu_seqlens, n, torch.is_inference_mode_enabled())
        last = self._last
        if last is not None and all(
            a is b if isinstance(a, torch.Tensor) else a == b for a, b in zip(last[0], key, strict=True)
        ):
            return last[1]
        table = packed_rope_table(freqs, cu_seqlens, n)
        self._last = (key, table)
        return table


def rope_with_table(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE of ``t [T, heads, dim]`` with fp32 ``cos``/``sin [T, 1, dim]``: megatron's non-interleaved rotation.

    Computed in fp32 and rounded once to ``t``'s dtype (what the Triton kernel of ``rope_kernel`` does).
    """
    x = t.float()
    x1, x2 = torch.chunk(x, 2, dim=-1)
    return (x * cos + torch.cat((-x2, x1), dim=-1) * sin).to(t.dtype)


@dataclass(frozen=True, slots=True)
class QKNorm:
    """The q and k RMSNorm weights ``[dim]`` and epsilon of a layer with qk-norm (Qwen3)."""

    q_weight: torch.Tensor
    k_weight: torch.Tensor
    eps: float


def _rms_norm_fp32(t: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of ``t`` over its last dim, in fp32 and not rounded (the rotation that follows rounds once)."""
    x = t.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.float()


def split_rope_qkv(
    mixed_qkv: torch.Tensor,
    bias: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    heads_per_group: int,
    qk_norm: QKNorm | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Add the QKV bias to megatron's interleaved ``[T, groups, (heads_per_group + 2) * dim]`` QKV, split, rotate.

    ``bias`` is the QKV projection's bias (``[groups * (heads_per_group + 2) * dim]``, or None): megatron's linear
    layer adds it as a separate broadcast add (and sums its gradient in another pass); here it rides along.
    ``qk_norm`` (Qwen3's q/k RMSNorm over each head) normalises q and k before the rotation; norm and rotation are
    one fp32 computation rounded once.

    Returns:
        Contiguous ``q [T, groups * heads_per_group, dim]`` and ``k [T, groups, dim]`` (rotated) and ``v [T, groups,
        dim]``: what megatron's split, reshape, RoPE and the attention kernel's copies produce, in one pass.
    """
    dim = cos.size(-1)
    if bias is not None:
        mixed_qkv = mixed_qkv + bias.view(mixed_qkv.shape[-2:])
    q, k, v = torch.split(mixed_qkv, [heads_per_group * dim, dim, dim], dim=-1)
    q = q.reshape(q.size(0), -1, dim)
    if qk_norm is not None:
        q = rope_with_table(_rms_norm_fp32(q, qk_norm.q_weight, qk_norm.eps), cos, sin).to(q.dtype)
        k = rope_with_table(_rms_norm_fp32(k, qk_norm.k_weight, qk_norm.eps), cos, sin).to(k.dtype)
        return q, k, v.contiguous()
    return rope_with_table(q, cos, sin), rope_with_table(k, cos, sin).contiguous(), v.contiguous()


class PackedSelfAttention(SelfAttention):
    """Megatron's ``SelfAttention`` with q/k/v split and RoPE fused for packed THD input (cp = 1).

    Constructed exactly like ``SelfAttention`` (the layer spec passes the same arguments).
    """

    fused_kernels: bool = False
    """Run ``split_rope_qkv`` as Triton kernels on CUDA (``set_fused_kernels``)."""
    rope_tables: RopeTables | None = None
    """The cos/sin cache this layer shares with the rest of its model (``share_rope_tables``); None: no cache."""
    _pending: tuple[torch.Tensor, torch.Tensor] | None = None

    def _fusable(self, rotary_pos_emb: Any, packed_seq_params: Any, kwargs: dict[str, Any]) -> bool:
        cfg = self.config
        return (
            packed_seq_params is not None
            and packed_seq_params.qkv_format == "thd"
            and isinstance(rotary_pos_emb, torch.Tensor)  # megatron passes one table for q and k
            and rotary_pos_emb.size(-1) == self.hidden_size_per_attention_head
            and kwargs.get("inference_context") is None
            and kwargs.get("inference_params") is None
            and kwargs.get("key_value_states") is None
            and self.pg_collection.cp.size() == 1
            and self.config.num_query_groups >= self.world_size
            and not cfg.rotary_interleaved
            and not cfg.apply_rope_fusion
            and not cfg.attention_output_gate
            and self._yarn_concentration_factor in (None, 1.0)
            and (self._qk_norm() is not None or not self._has_qk_norm())
        )

    def _has_qk_norm(self) -> bool:
        return not all(n is None or isinstance(n, IdentityOp) for n in (self.q_layernorm, self.k_layernorm))

    def _qk_norm(self) -> QKNorm | None:
        """The q/k RMSNorm weights when both norms are plain per-head ``torch.nn.RMSNorm``s (megatron's local spec)."""
        q, k = self.q_layernorm, self.k_layernorm
        dim = self.hidden_size_per_attention_head
        if not all(
            type(n) is torch.nn.RMSNorm and n.weight is not None and tuple(n.normalized_shape) == (dim,) for n in (q, k)
        ):
            return None
        eps = q.eps if q.eps is not None else torch.finfo(q.weight.dtype).eps
        return QKNorm(q.weight, k.weight, float(eps)) if q.eps == k.eps else None

    def forward(self, hidden_states: torch.Tensor, attention_mask: Any, *args: Any, **kwargs: Any):
        """``SelfAttention.forward``; packed THD input with plain RoPE takes the fused q/k/v path."""
        rotary_pos_emb = kwargs.get("rotary_pos_emb")
        packed_seq_params = kwargs.get("packed_seq_params")
        if args or not self._fusable(rotary_pos_emb, packed_seq_params, kwargs):
            token = RUNNING_ATTENTION.set(self)
            try:
                return super().forward(hidden_states, attention_mask, *args, **kwargs)
            finally:
                RUNNING_ATTENTION.reset(token)
        cu = packed_seq_params.cu_seqlens_q_padded
        cu = packed_seq_params.cu_seqlens_q if cu is None else cu
        tables = self.rope_tables.get if self.rope_tables is not None else packed_rope_table
        self._pending = tables(rotary_pos_emb, cu, hidden_states.size(0))
        try:
            return super().forward(hidden_states, attention_mask, **(kwargs | {"rotary_pos_emb": None}))
        finally:
            self._pending = None

    def get_query_key_value_tensors(self, hidden_states, key_value_states=None, output_gate=False, split_qkv=True):
        """Megatron's split; inside a fused forward, contiguous rotated q/k and v shaped ``[T, 1, heads, dim]``."""
        if self._pending is None:
            return super().get_query_key_value_tensors(
                hidden_states, key_value_states, output_gate=output_gate, split_qkv=split_qkv
            )
        # megatron's get_query_key_value_tensors (cp = 1, no gate, groups >= TP) with the bias add left to us
        linear, skip = self.linear_qkv, self.linear_qkv.skip_bias_add
        linear.skip_bias_add = True
        try:
            mixed, bias = linear(hidden_states)
        finally:
            linear.skip_bias_add = skip
        groups = self.num_query_groups_per_partition
        mixed = mixed.view(mixed.size(0), groups, -1)  # [T, 1, hp] -> [T, groups, (heads/groups + 2) * dim]
        cos, sin = self._pending
        fn = split_rope_qkv
        dim = self.hidden_size_per_attention_head
        if self.fused_kernels and mixed.is_cuda and dim & (dim - 1) == 0:
            from tidal.actor.rope_kernel import split_rope_qkv_triton as fn
        qk_norm = self._qk_norm()  # None for layers without q/k norm
        # k/v stay grouped: the varlen attention kernel takes them so (packed_causal_attention)
        q, k, v = fn(mixed, bias, cos, sin, self.num_attention_heads_per_partition // groups, qk_norm)
        return q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1)


class FusedSwiGLUMLP(MLP):
    """Megatron's ``MLP`` whose SwiGLU runs as Triton kernels (``swiglu_kernel.swiglu``) with ``fused_kernels``.

    For CUDA input of a gated SiLU MLP (no clamp, no per-token scale); anything else takes megatron's own forward.
    Constructed exactly like ``MLP`` (the layer spec passes the same arguments).
    """

    fused_kernels: bool = False
    """Run SwiGLU as Triton kernels on CUDA (``set_fused_kernels``)."""

    def forward(self, hidden_states: torch.Tensor, per_token_scale: torch.Tensor | None = None, **kwargs: Any):
        """``MLP.forward``; fc1, the Triton SwiGLU, fc2 on CUDA with fused kernels."""
        cfg = self.config
        if not (
            self.fused_kernels
            and hidden_states.is_cuda
            and per_token_scale is None
            and cfg.gated_linear_unit
            and cfg.activation_func is F.silu
            and cfg.activation_func_clamp_value is None
            and not cfg.use_te_activation_func
            and not cfg.activation_func_fp8_input_store
        ):
            return super().forward(hidden_states, per_token_scale, **kwargs)
        from tidal.actor.swiglu_kernel import swiglu

        intermediate, bias = self.linear_fc1(hidden_states)
        if bias is not None:
            intermediate = intermediate + bias
        return self.linear_fc2(swiglu(intermediate))


class FusedRMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` built like megatron's ``WrappedTorchNorm``, run as Triton kernels with ``fused_kernels``.

    On CUDA with ``fused_kernels`` it calls ``norm_kernel.rms_norm``; otherwise torch's own RMSNorm. The parameter
    is ``weight``, as in torch's.
    """

    fused_kernels: bool = False
    """Run as Triton kernels on CUDA (``set_fused_kernels``)."""

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, **_: Any) -> None:
        super().__init__(normalized_shape=hidden_size, eps=eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """RMSNorm of ``x`` over its last dim."""
        fusable = self.weight is not None and self.eps is not None and x.size(-1) <= 16384
        if self.fused_kernels and x.is_cuda and fusable:
            from tidal.actor.norm_kernel import rms_norm

            return rms_norm(x, self.weight, self.eps)
        return super().forward(x)
