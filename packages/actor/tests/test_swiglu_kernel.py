"""The Triton SwiGLU kernels (CUDA path of ``fused.FusedSwiGLUMLP``) against the eager SwiGLU (megatron's unfused
``glu``) and its autograd, under Triton's interpreter on CPU in a child process (``TRITON_INTERPRET`` must be set
before the kernels are defined)."""

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

CHECK = textwrap.dedent(
    """
    import torch
    from tidal.actor.swiglu_kernel import swiglu

    def eager(y):
        a, b = torch.chunk(y, 2, -1)
        return torch.nn.functional.silu(a) * b

    for dtype in (torch.float32, torch.bfloat16):
        for shape in ((7, 1, 2 * 1500), (3, 2 * 1024), (2, 2 * 10)):  # partial last block, exact blocks, tiny
            gen = torch.Generator().manual_seed(shape[0])
            y = (torch.randn(shape, generator=gen) * 3).to(dtype)
            g = torch.randn((*shape[:-1], shape[-1] // 2), generator=gen).to(dtype)
            grads = []
            for fn in (eager, swiglu):
                x = y.clone().requires_grad_()
                out = fn(x)
                assert out.shape == g.shape and out.dtype == dtype
                out.backward(g)
                grads.append((out.detach(), x.grad))
            (ref_out, ref_grad), (out, grad) = grads
            tol = 1e-6 if dtype == torch.float32 else 1.6e-2  # bf16: eager rounds after each op, the kernel once
            torch.testing.assert_close(out.float(), ref_out.float(), atol=tol, rtol=tol)
            torch.testing.assert_close(grad.float(), ref_grad.float(), atol=tol, rtol=tol)
    print("OK")
    """
)


def test_triton_swiglu_forward_and_backward_equal_eager():
    env = os.environ | {"TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("OK"), out.stderr[-3000:]
