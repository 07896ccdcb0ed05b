"""The Triton RMSNorm kernels (CUDA path of ``fused.FusedRMSNorm``) against torch's RMSNorm and its autograd, under
Triton's interpreter on CPU in a child process (``TRITON_INTERPRET`` must be set before the kernels are defined)."""

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

CHECK = textwrap.dedent(
    """
    import torch
    from tidal.actor.norm_kernel import rms_norm

    for dtype in (torch.float32, torch.bfloat16):
        for shape in ((37, 1, 48), (5, 64), (1, 1, 40)):  # rows not divisible by the programs, exact, one row
            gen = torch.Generator().manual_seed(shape[0])
            x = (torch.randn(shape, generator=gen) * 3).to(dtype)
            w = (1 + torch.randn(shape[-1], generator=gen) / 4).to(dtype)
            g = torch.randn(shape, generator=gen).to(dtype)
            results = []
            for fn in (lambda a, b: torch.nn.functional.rms_norm(a, (shape[-1],), b, 1e-6),
                       lambda a, b: rms_norm(a, b, 1e-6)):
                a, b = x.clone().requires_grad_(), w.clone().requires_grad_()
                out = fn(a, b)
                assert out.shape == x.shape and out.dtype == dtype
                out.backward(g)
                results.append((out.detach(), a.grad, b.grad))
            tol = 2e-5 if dtype == torch.float32 else 2e-2  # bf16: eager rounds per op, the kernels once
            for ref, got in zip(*results, strict=True):
                assert got.dtype == ref.dtype and got.shape == ref.shape
                torch.testing.assert_close(got.float(), ref.float(), atol=tol * 4, rtol=tol)
    print("OK")
    """
)


def test_triton_rms_norm_forward_and_backward_equal_torch():
    env = os.environ | {"TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("OK"), out.stderr[-3000:]
