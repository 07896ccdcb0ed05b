"""Triton kernels for ``fused.split_rope_qkv``: QKV bias + split + RoPE in one pass, forward and backward.

``torch.compile`` of the same function (dynamic token count) produced a q kernel at ~0.15 TB/s on the H200 (1.3 ms
per layer at 24k tokens in the profile of ``bench/bench_actor_gpu.py``), so the rotation is written out: each program
reads one head of ``BLOCK_T`` tokens from megatron's interleaved ``[T, groups, (heads_per_group + 2) * dim]``
projection (two half-rows), adds the bias, rotates q/k heads with the per-token cos/sin table and writes contiguous
q, k and v. Arithmetic in fp32, rounded once (the eager code rounds after each op: the two agree to bf16 rounding).

Imported only on CUDA (``fused.PackedSelfAttention`` with ``fused_kernels``); tested on CPU against the eager
``split_rope_qkv`` under Triton's interpreter (``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

_BLOCK_T = 32


@triton.jit
def _load_head(
    mixed, bias, t, mask, g, h, d, stride_t, stride_g, R: tl.constexpr, D: tl.constexpr, HAS_BIAS: tl.constexpr
):
    """Head ``h`` of group ``g`` for tokens ``t`` as two fp32 halves, the bias added and rounded as megatron does."""
    HALF: tl.constexpr = D // 2
    src = mixed + t[:, None].to(tl.int64) * stride_t + g * stride_g + h * D + d[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        off = (g * (R + 2) + h) * D + d[None, :]
        x1 = (x1 + tl.load(bias + off).to(tl.float32)).to(mixed.dtype.element_ty).to(tl.float32)
        x2 = (x2 + tl.load(bias + off + HALF).to(tl.float32)).to(mixed.dtype.element_ty).to(tl.float32)
    return x1, x2


@triton.jit
def _split_rope_fwd(
    mixed, bias, cos, sin, q, k, v, qw, kw, eps, T, stride_t, stride_g,
    G: tl.constexpr, R: tl.constexpr, D: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_NORM: tl.constexpr,
    BLOCK_T: tl.constexpr,
):  # fmt: skip
    HALF: tl.constexpr = D // 2
    g = tl.program_id(1) // (R + 2)
    h = tl.program_id(1) % (R + 2)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.arange(0, HALF)
    mask = (t < T)[:, None]
    x1, x2 = _load_head(mixed, bias, t, mask, g, h, d, stride_t, stride_g, R, D, HAS_BIAS)
    t64 = t[:, None].to(tl.int64)
    if h <= R:  # q heads (h < R) and the k head (h == R) rotate; v (h == R + 1) is copied
        if HAS_NORM:  # RMSNorm over the head's D values (both halves), weight of q or k
            r = 1.0 / tl.sqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / D + eps)
            if h < R:  # noqa: SIM108 (a runtime branch: Triton has no conditional expression on tensors)
                w = qw
            else:
                w = kw
            x1 = x1 * r[:, None] * tl.load(w + d)[None, :].to(tl.float32)
            x2 = x2 * r[:, None] * tl.load(w + HALF + d)[None, :].to(tl.float32)
        tab = t64 * D + d[None, :]
        c1 = tl.load(cos + tab, mask=mask, other=0.0).to(tl.float32)
        c2 = tl.load(cos + tab + HALF, mask=mask, other=0.0).to(tl.float32)
        s1 = tl.load(sin + tab, mask=mask, other=0.0).to(tl.float32)
        s2 = tl.load(sin + tab + HALF, mask=mask, other=0.0).to(tl.float32)
        y1 = x1 * c1 - x2 * s1
        y2 = x2 * c2 + x1 * s2
        if h < R:  # noqa: SIM108 (a runtime branch: Triton has no conditional expression on tensors)
            dst = q + t64 * (G * R * D) + (g * R + h) * D + d[None, :]
        else:
            dst = k + t64 * (G * D) + g * D + d[None, :]
    else:
        y1 = x1
        y2 = x2
        dst = v + t64 * (G * D) + g * D + d[None, :]
    tl.store(dst, y1.to(q.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, y2.to(q.dtype.element_ty), mask=mask)


@triton.jit
def _split_rope_bwd(
    gq, gk, gv, cos, sin, gmixed, mixed, bias, qw, kw, eps, dw_part, T, stride_t, stride_g,
    G: tl.constexpr, R: tl.constexpr, D: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_NORM: tl.constexpr,
    BLOCK_T: tl.constexpr,
):  # fmt: skip
    HALF: tl.constexpr = D // 2
    g = tl.program_id(1) // (R + 2)
    h = tl.program_id(1) % (R + 2)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.arange(0, HALF)
    mask = (t < T)[:, None]
    t64 = t[:, None].to(tl.int64)
    if h < R:
        src = gq + t64 * (G * R * D) + (g * R + h) * D + d[None, :]
    elif h == R:
        src = gk + t64 * (G * D) + g * D + d[None, :]
    else:
        src = gv + t64 * (G * D) + g * D + d[None, :]
    y1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    y2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    if h <= R:  # transpose of the rotation: dx1 = dy1 c1 + dy2 s2, dx2 = dy2 c2 - dy1 s1
        tab = t64 * D + d[None, :]
        c1 = tl.load(cos + tab, mask=mask, other=0.0).to(tl.float32)
        c2 = tl.load(cos + tab + HALF, mask=mask, other=0.0).to(tl.float32)
        s1 = tl.load(sin + tab, mask=mask, other=0.0).to(tl.float32)
        s2 = tl.load(sin + tab + HALF, mask=mask, other=0.0).to(tl.float32)
        x1 = y1 * c1 + y2 * s2
        x2 = y2 * c2 - y1 * s1
        if HAS_NORM:  # back through the RMSNorm: the forward's input is read again from the projection
            a1, a2 = _load_head(mixed, bias, t, mask, g, h, d, stride_t, stride_g, R, D, HAS_BIAS)
            r = 1.0 / tl.sqrt((tl.sum(a1 * a1, 1) + tl.sum(a2 * a2, 1)) / D + eps)
            if h < R:  # noqa: SIM108 (a runtime branch: Triton has no conditional expression on tensors)
                w = qw
            else:
                w = kw
            w1 = tl.load(w + d)[None, :].to(tl.float32)
            w2 = tl.load(w + HALF + d)[None, :].to(tl.float32)
            n1 = a1 * r[:, None]
            n2 = a2 * r[:, None]
            wg1 = w1 * x1
            wg2 = w2 * x2
            c = (tl.sum(n1 * wg1, 1) + tl.sum(n2 * wg2, 1)) / D
            part = dw_part + (tl.program_id(0) * (G * (R + 2)) + tl.program_id(1)) * D + d
            tl.store(part, tl.sum(x1 * n1, 0))
            tl.store(part + HALF, tl.sum(x2 * n2, 0))
            x1 = (wg1 - n1 * c[:, None]) * r[:, None]
            x2 = (wg2 - n2 * c[:, None]) * r[:, None]
    else:
        x1 = y1
        x2 = y2
    dst = gmixed + t64 * (G * (R + 2) * D) + (g * (R + 2) + h) * D + d[None, :]
    tl.store(dst, x1.to(gmixed.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, x2.to(gmixed.dtype.element_ty), mask=mask)


class SplitRopeQKV(torch.autograd.Function):
    """Autograd wrapper of the two kernels: ``apply(mixed, bias, cos, sin, heads_per_group) -> (q, k, v)``."""

    @staticmethod
    def forward(ctx, mixed, bias, cos, sin, heads_per_group, qw=None, kw=None, eps=0.0):  # noqa: D102
        n, groups, width = mixed.shape
        dim = cos.size(-1)
        assert mixed.stride(-1) == 1 and width == (heads_per_group + 2) * dim and dim % 2 == 0
        cos, sin = cos.reshape(n, dim).contiguous(), sin.reshape(n, dim).contiguous()
        q = mixed.new_empty(n, groups * heads_per_group, dim)
        k, v = mixed.new_empty(n, groups, dim), mixed.new_empty(n, groups, dim)
        grid = (triton.cdiv(n, _BLOCK_T), groups * (heads_per_group + 2))
        b = bias if bias is not None else mixed
        norm = qw is not None
        qw_, kw_ = (qw, kw) if norm else (mixed, mixed)
        _split_rope_fwd[grid](
            mixed, b, cos, sin, q, k, v, qw_, kw_, float(eps), n, mixed.stride(0), mixed.stride(1),
            G=groups, R=heads_per_group, D=dim, HAS_BIAS=bias is not None, HAS_NORM=norm,
            BLOCK_T=_BLOCK_T,
        )  # fmt: skip
        if norm:  # the backward reads the projection again for the norm's input
            ctx.save_for_backward(cos, sin, mixed, b, qw, kw)
        else:
            ctx.save_for_backward(cos, sin)
        ctx.meta = (groups, heads_per_group, dim, bias is not None, norm, float(eps))
        return q, k, v

    @staticmethod
    def backward(ctx, gq, gk, gv):  # noqa: D102
        groups, heads_per_group, dim, has_bias, norm, eps = ctx.meta
        if norm:
            cos, sin, mixed, b, qw, kw = ctx.saved_tensors
        else:
            (cos, sin), mixed, b, qw, kw = ctx.saved_tensors, None, None, None, None
        n = cos.size(0)
        gq, gk, gv = (torch.zeros_like(x) if x is None else x.contiguous() for x in (gq, gk, gv))
        gmixed = gq.new_empty(n, groups, (heads_per_group + 2) * dim)
        grid = (triton.cdiv(n, _BLOCK_T), groups * (heads_per_group + 2))
        shape = (grid[0], groups, heads_per_group + 2, dim) if norm else (1,)
        dw_part = torch.zeros(shape, device=gq.device, dtype=torch.float32)
        src = mixed if norm else gmixed
        _split_rope_bwd[grid](
            gq, gk, gv, cos, sin, gmixed, src, b if norm else gmixed, qw if norm else gmixed,
            kw if norm else gmixed, eps, dw_part, n, src.stride(0), src.stride(1),
            G=groups, R=heads_per_group, D=dim, HAS_BIAS=has_bias, HAS_NORM=norm,
            BLOCK_T=_BLOCK_T,
        )  # fmt: skip
        gbias = gmixed.view(n, -1).sum(0) if has_bias else None
        gqw = gkw = None
        if norm:
            gqw = dw_part[:, :, :heads_per_group].sum((0, 1, 2)).to(qw.dtype)
            gkw = dw_part[:, :, heads_per_group].sum((0, 1)).to(kw.dtype)
        return gmixed, gbias, None, None, None, gqw, gkw, None


def split_rope_qkv_triton(
    mixed: torch.Tensor,
    bias: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    heads_per_group: int,
    qk_norm: Any = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``fused.split_rope_qkv`` (same arguments and results, ``qk_norm`` a ``fused.QKNorm``) in two Triton kernels."""
    if qk_norm is None:
        return SplitRopeQKV.apply(mixed, bias, cos, sin, heads_per_group)
    return SplitRopeQKV.apply(mixed, bias, cos, sin, heads_per_group, qk_norm.q_weight, qk_norm.k_weight, qk_norm.eps)
