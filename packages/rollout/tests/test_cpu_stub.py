"""The sgl_kernel stand-in: still needed upstream, and serves every submodule without computing anything."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from tidal.rollout.engine import CPU_STUB_DIR

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="the stand-in is only used without CUDA")


def _python(code: str, *, stub: bool) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if stub:
        env["PYTHONPATH"] = str(CPU_STUB_DIR)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)


@no_cuda
def test_real_sgl_kernel_still_fails_to_import_without_cuda() -> None:
    result = _python("import sgl_kernel", stub=False)
    assert result.returncode != 0, (
        "sgl_kernel now imports without CUDA: the stand-in in tidal/rollout/cpu_stub/sitecustomize.py may be "
        "unnecessary; try serving without it and remove it if SGLang starts"
    )
    assert "libcuda" in result.stderr or "common_ops" in result.stderr, result.stderr[-2000:]


def test_stub_serves_submodules_and_every_call_raises() -> None:
    code = """
import sgl_kernel
from sgl_kernel.elementwise import rmsnorm
from sgl_kernel.quantization.deeply.nested import anything
assert sgl_kernel.__tidal_cpu_stub__
assert sgl_kernel.scalar_types.uint4b8 is not None  # attribute chains used at import time resolve
for fn in (rmsnorm, anything, sgl_kernel.fused_add_rmsnorm):
    try:
        fn(1, 2)
    except NotImplementedError as e:
        assert "CPU stand-in" in str(e), e
    else:
        raise SystemExit(f"{fn} did not raise")
import json  # ordinary imports are untouched
print("ok")
"""
    result = _python(code, stub=True)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "ok"
    assert "[tidal cpu_stub] serving sgl_kernel" in result.stderr


@no_cuda
def test_release_patch_is_still_needed_and_makes_synchronize_a_no_op_only_inside_release() -> None:
    # Why CpuMemoryReleaseFinder exists: SGLang's release_memory_occupation ends with
    # torch.get_device_module().synchronize(), torch.cuda.synchronize() here, which raises on a machine without
    # CUDA. When either stops holding, the patch in cpu_stub/sitecustomize.py may go.
    code = """
import inspect, torch, sitecustomize
from sglang.srt.managers.scheduler_components import weight_updater as w
patched = w.SchedulerWeightUpdaterManager.release_memory_occupation
assert "torch.get_device_module().synchronize()" in inspect.getsource(patched.__wrapped__), "drop the patch"
assert torch.get_device_module() is torch.cuda
try:
    torch.cuda.synchronize()
except (RuntimeError, AssertionError):
    pass
else:
    raise SystemExit("torch.cuda.synchronize() works without CUDA now: drop the patch")
seen = []
def fake_release(self, req):
    torch.get_device_module().synchronize()  # the call SGLang ends with
    seen.append(req)
    return "released"
w.SchedulerWeightUpdaterManager.release_memory_occupation = fake_release
sitecustomize._patch_release(w)
sync = torch.cuda.synchronize
assert w.SchedulerWeightUpdaterManager.release_memory_occupation(None, "req") == "released" and seen == ["req"]
assert torch.cuda.synchronize is sync  # restored afterwards
print("ok")
"""
    result = _python(code, stub=True)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "ok"
    assert "[tidal cpu_stub] release_memory_occupation without torch.cuda.synchronize" in result.stderr
