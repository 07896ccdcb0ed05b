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


def test_release_patch_is_still_needed_and_makes_synchronize_a_no_op_only_inside_release() -> None:
    # Why CpuMemoryReleaseFinder exists: SGLang's release_memory_occupation ends with
    # torch.get_device_module().synchronize(), torch.cuda.synchronize() on a CUDA build of torch, which raises on a
    # machine without CUDA. When either stops holding, the patch in cpu_stub/sitecustomize.py may go. SGLang's
    # source is read, not imported (that takes ~30 s); test_engine.py runs the patched release on a real server.
    code = """
import ast, importlib.util, pathlib, torch, types, sitecustomize
folder = pathlib.Path(importlib.util.find_spec("sglang").submodule_search_locations[0])
folder = folder / "srt" / "managers" / "scheduler_components"
src = (folder / "weight_updater.py").read_text()
assert "class SchedulerWeightUpdaterManager" in src
fn = next(n for n in ast.walk(ast.parse(src))
          if isinstance(n, ast.FunctionDef) and n.name == "release_memory_occupation")
assert "torch.get_device_module().synchronize()" in ast.get_source_segment(src, fn), "drop the patch"
if not torch.cuda.is_available():
    assert torch.get_device_module() is torch.cuda
    try:
        torch.cuda.synchronize()
    except (RuntimeError, AssertionError):
        pass
    else:
        raise SystemExit("torch.cuda.synchronize() works without CUDA now: drop the patch")
spec = sitecustomize.CpuMemoryReleaseFinder().find_spec(sitecustomize.WEIGHT_UPDATER, [str(folder)])
assert isinstance(spec.loader, sitecustomize._PatchingLoader) and spec.origin.endswith("weight_updater.py")
seen = []
class SchedulerWeightUpdaterManager:
    def release_memory_occupation(self, req):
        torch.get_device_module().synchronize()  # the call SGLang ends with
        seen.append(req)
        return "released"
fake = types.ModuleType("fake")
fake.SchedulerWeightUpdaterManager = SchedulerWeightUpdaterManager
sitecustomize._patch_release(fake)
sync = torch.cuda.synchronize
assert SchedulerWeightUpdaterManager().release_memory_occupation("req") == "released" and seen == ["req"]
assert torch.cuda.synchronize is sync  # restored afterwards
print("ok")
"""
    result = _python(code, stub=True)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "ok"
    assert "[tidal cpu_stub] release_memory_occupation without torch.cuda.synchronize" in result.stderr


def test_host_pool_patch_is_still_needed_and_allocates_cpu_buffers_unpinned() -> None:
    # Why CpuHostPoolFinder exists: --enable-return-routed-experts allocates its host buffer through
    # ALLOC_MEMORY_FUNCS[device], whose default pins it with cudaHostRegister (torch.cuda.cudart(): raises without
    # CUDA). When SGLang stops doing that for device "cpu", the patch in cpu_stub/sitecustomize.py may go. The real
    # module is imported through the finder (it imports in seconds); test_routing_replay.py serves a model with it.
    code = """
import importlib, importlib.util, sys, torch, sitecustomize
assert any(isinstance(f, sitecustomize.CpuHostPoolFinder) for f in sys.meta_path)
spec = importlib.util.find_spec(sitecustomize.HOST_POOL)
src = open(spec.origin).read()
assert "_cuda_host_register(buffer" in src and "lambda: alloc_with_host_register" in src, "drop the patch"
module = importlib.import_module(sitecustomize.HOST_POOL)
assert module.ALLOC_MEMORY_FUNCS["cpu"] is sitecustomize._alloc_unpinned
assert module.ALLOC_MEMORY_FUNCS["cuda"] is module.alloc_with_host_register  # other devices untouched
buf = module.ALLOC_MEMORY_FUNCS["cpu"]((4, 3, 2), dtype=torch.int32, device="cpu", pin_memory=True,
                                       allocator=module.HostTensorAllocator())
assert buf.shape == (4, 3, 2) and buf.dtype == torch.int32 and not buf.is_pinned()
if not torch.cuda.is_available():
    try:
        module.alloc_with_host_register((4,), dtype=torch.int32, device="cpu", pin_memory=True,
                                        allocator=module.HostTensorAllocator())
    except (RuntimeError, AssertionError):
        pass
    else:
        raise SystemExit("pinned host buffers work without CUDA now: drop the patch")
print("ok")
"""
    result = _python(code, stub=True)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "ok"
    assert "[tidal cpu_stub] unpinned host buffers for device cpu" in result.stderr


def test_pin_memory_patch_is_still_needed_and_leaves_tensors_as_they_are() -> None:
    # Why CpuLoRAFinder exists: SGLang's LoRA layers pin small tensors (pin_memory=True) unconditionally, which
    # raises without CUDA. When that stops holding, the patch may go; test_lora_adapters.py serves LoRA on CPU with it.
    code = """
import importlib.util, pathlib, types, torch, sitecustomize
folder = pathlib.Path(importlib.util.find_spec("sglang").submodule_search_locations[0]) / "srt" / "lora"
assert "pin_memory=True" in (folder / "layers.py").read_text(), "drop the patch"
if torch.cuda.is_available():
    raise SystemExit("ok-cuda")
try:
    torch.tensor([0, 1], pin_memory=True)
except RuntimeError:
    pass
else:
    raise SystemExit("pin_memory works without CUDA now: drop the patch")
spec = sitecustomize.CpuLoRAFinder().find_spec(sitecustomize.LORA_LAYERS, [str(folder)])
assert isinstance(spec.loader, sitecustomize._PatchingLoader) and spec.origin.endswith("layers.py")
sitecustomize._patch_pin_memory(types.ModuleType("fake"))
t = torch.tensor([0, 1], dtype=torch.int32, pin_memory=True)
assert t.tolist() == [0, 1] and t.dtype == torch.int32 and t.pin_memory() is t
assert torch.empty(3, pin_memory=True).shape == (3,) and torch.zeros(2, pin_memory=True).tolist() == [0.0, 0.0]
print("ok")
"""
    result = _python(code, stub=True)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "ok"
    assert "[tidal cpu_stub] pin_memory is a no-op (LoRA serving on CPU)" in result.stderr
