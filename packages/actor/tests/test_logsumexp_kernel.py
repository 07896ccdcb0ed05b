"""The Triton LM-head log-softmax kernels (CUDA, TP = 1) against ``local_log_probs``: values and gradients, under
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
    from tidal.actor.logprobs import local_log_probs
    from tidal.actor.logsumexp_kernel import fused_log_probs

    def run(fn, x, t, temperature, with_entropy, entropy_grad, g_lp, g_ent):
        x = x.clone().requires_grad_()
        lp, ent = fn(x, t, temperature=temperature, with_entropy=with_entropy, entropy_grad=entropy_grad)
        loss = (lp * g_lp).sum() + ((ent * g_ent).sum() if with_entropy and entropy_grad else 0.0)
        loss.backward()
        return lp, ent, x.grad

    checked = 0
    for dtype in (torch.float32, torch.bfloat16):
        for n, vocab in ((5, 9000), (3, 4096), (2, 100)):  # several blocks, one full block, one partial block
            for temperature in (1.0, 0.7):
                gen = torch.Generator().manual_seed(n)
                x = (torch.randn(n, vocab, generator=gen) * 4).to(dtype)
                x[0, -7:] = -1e30  # tidal's padded-vocabulary logits
                t = torch.randint(0, vocab - 7, (n,), generator=gen)
                g_lp, g_ent = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
                with torch.no_grad():  # the log-prob pass: no autograd, no entropy
                    got, zeros = fused_log_probs(x, t, temperature=temperature)
                    ref, _ = local_log_probs(x, t, temperature=temperature)
                assert got.dtype == torch.float32 and got.shape == (n,) and not zeros.any()
                torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-6)
                for with_entropy, entropy_grad in ((True, True), (True, False), (False, True)):
                    args = (x, t, temperature, with_entropy, entropy_grad, g_lp, g_ent)
                    ref_lp, ref_ent, ref_grad = run(local_log_probs, *args)
                    lp, ent, grad = run(fused_log_probs, *args)
                    torch.testing.assert_close(lp, ref_lp, atol=1e-5, rtol=1e-6)
                    torch.testing.assert_close(ent, ref_ent, atol=2e-5, rtol=1e-5)
                    assert grad.dtype == dtype and grad.shape == x.shape
                    tol = 1e-5 if dtype == torch.float32 else 8e-3  # bf16: one rounding of the gradient
                    torch.testing.assert_close(grad.float(), ref_grad.float(), atol=tol, rtol=tol)
                    assert grad.float().abs().sum() > 0
                    checked += 1
    assert checked == 36
    print("OK")
    """
)


def test_triton_log_probs_entropy_and_gradients_equal_local_log_probs():
    env = os.environ | {"TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("OK"), out.stderr[-3000:]
