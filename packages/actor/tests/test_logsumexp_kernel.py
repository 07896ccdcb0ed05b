"""The Triton log-prob reduction (CUDA log-prob pass at TP = 1) against ``local_log_probs``, under Triton's
interpreter on CPU in a child process (``TRITON_INTERPRET`` must be set before the kernel is defined)."""

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
    from tidal.actor.logsumexp_kernel import target_log_probs

    for dtype in (torch.float32, torch.bfloat16):
        for n, vocab in ((5, 9000), (3, 4096), (2, 100)):  # several blocks, one full block, one partial block
            for temperature in (1.0, 0.7):
                gen = torch.Generator().manual_seed(n)
                x = (torch.randn(n, vocab, generator=gen) * 4).to(dtype)
                x[0, -7:] = -1e30  # tidal's padded-vocabulary logits
                t = torch.randint(0, vocab - 7, (n,), generator=gen)
                with torch.no_grad():
                    got = target_log_probs(x, t, temperature)
                    ref, _ = local_log_probs(x, t, temperature=temperature)
                assert got.dtype == torch.float32 and got.shape == (n,)
                torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-6)
    print("OK")
    """
)


def test_triton_target_log_probs_equal_local_log_probs():
    env = os.environ | {"TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("OK"), out.stderr[-3000:]
