"""The Triton q/k/v split + RoPE kernels (CUDA path of ``fused.split_rope_qkv``) against the eager function.

Run on CPU under Triton's interpreter in a child process (``TRITON_INTERPRET`` must be set before the kernels are
defined). fp32 must match exactly (to 1e-5 with qk-norm, whose sums run in another order); bf16 to one bf16
ulp (the interpreter rounds bf16 differently from the GPU).
"""

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

CHECK = textwrap.dedent(
    """
    import torch
    from tidal.actor.fused import QKNorm, positions, rope_table, split_rope_qkv
    from tidal.actor.rope_kernel import split_rope_qkv_triton

    def check(dtype, with_bias, norm=False, tokens=45, groups=2, r=3, dim=16):
        gen = torch.Generator().manual_seed(0)
        mixed = torch.randn(tokens, groups, (r + 2) * dim, generator=gen).to(dtype)
        bias = torch.randn(groups * (r + 2) * dim, generator=gen).to(dtype) if with_bias else None
        inv = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
        ang = torch.outer(torch.arange(64).float(), inv)
        freqs = torch.cat([ang, ang], -1)[:, None, None, :]
        cos, sin = rope_table(freqs, positions(torch.tensor([0, 20, 45]), tokens, mixed.device))
        shapes = ((tokens, groups * r, dim), (tokens, groups, dim), (tokens, groups, dim))  # k/v grouped
        grads = [torch.randn(s, generator=gen).to(dtype) for s in shapes]
        weights = [(1 + 0.3 * torch.randn(dim, generator=gen)).to(dtype) for _ in range(2)]
        results = []
        for fn in (split_rope_qkv, split_rope_qkv_triton):
            m = mixed.clone().requires_grad_()
            b = bias.clone().requires_grad_() if with_bias else None
            w = [x.clone().requires_grad_() for x in weights]
            out = fn(m, b, cos, sin, r, QKNorm(w[0], w[1], 1e-6) if norm else None)
            assert all(o.is_contiguous() for o in out)
            torch.autograd.backward(out, grads)
            results.append([*out, m.grad] + ([b.grad] if with_bias else []) + ([x.grad for x in w] if norm else []))
        tol = (1e-5 if norm else 0.0) if dtype == torch.float32 else 1e-2  # the norm's sums run in another order
        for ref, got in zip(*results, strict=True):
            assert got.shape == ref.shape and got.dtype == ref.dtype
            torch.testing.assert_close(got.float(), ref.float(), atol=tol * 8, rtol=tol)

    for dtype in (torch.float32, torch.bfloat16):
        for with_bias in (True, False):
            for norm in (False, True):
                check(dtype, with_bias, norm)
    print("OK")
    """
)


def test_triton_split_rope_equals_eager():
    env = os.environ | {"TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("OK"), out.stderr[-3000:]
