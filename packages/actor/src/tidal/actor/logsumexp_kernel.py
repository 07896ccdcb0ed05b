"""Triton kernel for the log-prob pass's LM-head reduction at TP = 1: ``log_softmax(logits)[target]`` per row.

``torch.compile`` of ``local_log_probs`` reads a ``[4096, 151936]`` bf16 chunk at ~1.1 TB/s on the H200 (its online
softmax keeps a max and a sum per lane: two exponentials per element). Here each program streams one row in blocks,
keeps one running max and sum (one exponential per element plus a rescale per block) and writes
``logit[target] - logsumexp(row)`` in fp32. Used without autograd and without entropy (the log-prob pass);
everything else keeps ``local_log_probs``. Tested on CPU against it under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 4096


@triton.jit
def _target_log_prob(logits, targets, out, V, stride, temperature, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    base = logits + row.to(tl.int64) * stride
    m = tl.max(tl.full([BLOCK], float("-inf"), tl.float32), 0)
    s = tl.sum(tl.zeros([BLOCK], tl.float32), 0)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32) / temperature
        m_new = tl.maximum(m, tl.max(x, 0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), 0)
        m = m_new
    target = tl.load(base + tl.load(targets + row)).to(tl.float32) / temperature
    tl.store(out + row, target - (m + tl.log(s)))


def target_log_probs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``log_softmax(logits.float() / temperature, dim=-1).gather(-1, targets)`` for ``logits [N, V]`` (no autograd).

    Args:
        logits: ``[N, V]`` (bf16/fp16/fp32), last dim contiguous.
        targets: int64 ``[N]`` column of each row to read.
        temperature: the logits are divided by it first.

    Returns:
        float32 ``[N]``.
    """
    assert logits.dim() == 2 and logits.stride(-1) == 1 and not torch.is_grad_enabled()
    n, vocab = logits.shape
    out = torch.empty(n, device=logits.device, dtype=torch.float32)
    if n:
        _target_log_prob[(n,)](
            logits, targets.contiguous(), out, vocab, logits.stride(0), float(temperature), BLOCK=_BLOCK, num_warps=8
        )
    return out
