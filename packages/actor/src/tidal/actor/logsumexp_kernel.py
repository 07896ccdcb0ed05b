"""Triton kernels for the LM head's log-softmax at TP = 1: log-prob of the target (and entropy), forward and backward.

``torch.compile`` of ``local_log_probs`` reads a ``[4096, 151936]`` bf16 chunk at ~1.1 TB/s on the H200 in the
log-prob pass (its online softmax keeps a max and a sum per lane: two exponentials per element), and in training
its forward (log-softmax + entropy) and backward (log-softmax backward, plus a separate scatter of the gathered
gradient into a zeroed fp32 ``[N, V]``) took ~0.11 s of a 2.1 s step (the profile of ``bench/bench_actor_gpu.py``).

Here the forward streams each row once in blocks, keeping a running max ``m``, ``s = sum exp(x - m)`` and (for the
entropy) ``t = sum exp(x - m) * x``, and writes ``lp = x[target] - lse``, ``H = lse - t / s`` and ``lse``. The
backward is elementwise over ``[N, V]`` from the saved ``lse`` and ``H``:

    d lp / d x_j = [j == target] - p_j          d H / d x_j = -p_j * (log p_j + H)          p_j = exp(x_j - lse)

(divided by the temperature), written straight in the logits' dtype. Arithmetic in fp32. Tested on CPU against
``local_log_probs`` (values and gradients) under Triton's interpreter (``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 4096


@triton.jit
def _log_prob_fwd(logits, targets, lp, ent, lse, V, stride, temperature, WITH_ENT: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    base = logits + row.to(tl.int64) * stride
    m = tl.max(tl.full([BLOCK], float("-inf"), tl.float32), 0)
    s = tl.sum(tl.zeros([BLOCK], tl.float32), 0)
    t = tl.sum(tl.zeros([BLOCK], tl.float32), 0)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < V
        x = tl.load(base + cols, mask=mask, other=float("-inf")).to(tl.float32) / temperature
        m_new = tl.maximum(m, tl.max(x, 0))
        scale = tl.exp(m - m_new)
        e = tl.exp(x - m_new)
        s = s * scale + tl.sum(e, 0)
        if WITH_ENT:
            t = t * scale + tl.sum(tl.where(mask, e * x, 0.0), 0)
        m = m_new
    log_z = m + tl.log(s)
    target = tl.load(base + tl.load(targets + row)).to(tl.float32) / temperature
    tl.store(lp + row, target - log_z)
    if WITH_ENT:
        tl.store(ent + row, log_z - t / s)
        tl.store(lse + row, log_z)


@triton.jit
def _log_prob_bwd(
    logits, targets, lse, ent, grad_lp, grad_ent, grad, V, stride, grad_stride, temperature,
    ENT_GRAD: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < V
    x = tl.load(logits + row.to(tl.int64) * stride + cols, mask=mask, other=0.0).to(tl.float32) / temperature
    log_z = tl.load(lse + row)
    g_lp = tl.load(grad_lp + row)
    log_p = x - log_z
    p = tl.exp(log_p)
    g = tl.where(cols == tl.load(targets + row), g_lp, 0.0) - g_lp * p
    if ENT_GRAD:
        g -= tl.load(grad_ent + row) * p * (log_p + tl.load(ent + row))
    g = g / temperature
    tl.store(grad + row.to(tl.int64) * grad_stride + cols, g.to(grad.dtype.element_ty), mask=mask)


class _FusedLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, temperature, with_entropy, entropy_grad):
        n, vocab = logits.shape
        targets = targets.contiguous()
        lp = torch.empty(n, device=logits.device, dtype=torch.float32)
        keep = with_entropy or logits.requires_grad  # the backward needs lse (the forward then writes both)
        ent = torch.empty_like(lp) if keep else torch.zeros_like(lp)
        lse = torch.empty_like(lp) if keep else lp
        if n:
            _log_prob_fwd[(n,)](
                logits, targets, lp, ent, lse, vocab, logits.stride(0), float(temperature),
                WITH_ENT=keep, BLOCK=_BLOCK, num_warps=8,
            )  # fmt: skip
        ctx.temperature = float(temperature)
        ctx.entropy_grad = with_entropy and entropy_grad
        ctx.save_for_backward(logits, targets, lse, ent)
        if not with_entropy:
            ent = torch.zeros_like(lp)
        if not ctx.entropy_grad:
            ctx.mark_non_differentiable(ent)
        return lp, ent

    @staticmethod
    def backward(ctx, grad_lp, grad_ent):
        logits, targets, lse, ent = ctx.saved_tensors
        n, vocab = logits.shape
        grad = torch.empty((n, vocab), device=logits.device, dtype=logits.dtype)
        ent_grad = ctx.entropy_grad and grad_ent is not None
        if grad_lp is None:
            grad_lp = torch.zeros(n, device=logits.device, dtype=torch.float32)
        if n:
            _log_prob_bwd[(n, triton.cdiv(vocab, _BLOCK))](
                logits, targets, lse, ent, grad_lp.float().contiguous(),
                grad_ent.float().contiguous() if ent_grad else grad_lp, grad, vocab, logits.stride(0),
                grad.stride(0), ctx.temperature, ENT_GRAD=ent_grad, BLOCK=_BLOCK, num_warps=8,
            )  # fmt: skip
        return grad, None, None, None, None


def fused_log_probs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``logprobs.local_log_probs`` as Triton kernels, with the same arguments and results.

    Float32 ``[N]`` log-probs of ``targets`` under ``softmax(logits / temperature)`` and the entropy (zeros without
    ``with_entropy``).

    ``logits`` must be ``[N, V]`` with a contiguous last dim (bf16/fp16/fp32); the gradient comes back in its dtype.
    """
    assert logits.dim() == 2 and logits.stride(-1) == 1
    return _FusedLogProbs.apply(logits, targets, temperature, with_entropy, entropy_grad)
