"""Import-time stand-in for ``sgl_kernel`` in SGLang server processes on a machine without CUDA.

Why: SGLang imports ``sgl_kernel`` (distribution ``sglang-kernel``) unconditionally in many modules, but
the real package loads ``common_ops`` at import time, which needs ``libcuda.so.1``; without a GPU driver
the import fails ("libcuda.so.1 ... No module named 'common_ops'") and the server cannot start. On the
CPU path (``--device cpu --attention-backend torch_native``) none of its kernels is ever called for a
Qwen2-style model, so a stand-in that only satisfies the imports is enough.

How: tidal-rollout puts THIS directory on the server's ``PYTHONPATH`` only when
``torch.cuda.is_available()`` is false; Python then runs this file at start-up in the server process
and in every process it spawns (they inherit the environment). It installs a meta-path finder that
serves ``sgl_kernel`` and every ``sgl_kernel.*`` submodule. Any attribute of those modules is a
callable that raises ``NotImplementedError`` naming itself, so an unexpected call fails loudly instead
of computing garbage. ``tests/test_cpu_stub.py`` fails when upstream changes make this unnecessary.

It also holds tidal's patches of SGLang's own code on CPU, each applied as SGLang imports its module:

* :class:`CpuMemoryReleaseFinder`: SGLang 0.5.23's ``release_memory_occupation`` ends with
  ``torch.get_device_module().synchronize()``, which is ``torch.cuda.synchronize()`` on a CPU machine with a CUDA
  build of torch and raises "Found no NVIDIA driver", killing the scheduler. There is nothing to wait for on CPU, so
  inside that one method the call is a no-op.
* :class:`CpuHostPoolFinder`: ``--enable-return-routed-experts`` keeps the routed experts in a host buffer allocated
  through ``ALLOC_MEMORY_FUNCS[device]``, whose default pins the memory with ``cudaHostRegister`` ("Found no NVIDIA
  driver" on CPU). A CPU server's "device" memory is host memory already, so for device "cpu" the buffer is
  allocated unpinned.

This file must stay importable with the standard library only: it runs before anything else.
"""

import importlib.abc
import importlib.machinery
import sys
import types

_ROOT = "sgl_kernel"
_STUB_VERSION = "0.0.0+tidal.cpu.stub"
# Written once per process to stderr (the server log) when SGLang first imports sgl_kernel, so that a
# test can tell the stand-in is still in use.
MARKER = "[tidal cpu_stub] serving sgl_kernel with CPU stand-ins"


class _Unavailable:
    """Stands for one ``sgl_kernel`` attribute: calling it raises, attribute access nests."""

    def __init__(self, qualname):
        self._qualname = qualname

    def __call__(self, *args, **kwargs):
        raise NotImplementedError(
            f"{self._qualname} is a CPU stand-in installed by tidal.rollout (no CUDA here); "
            "this SGLang code path needs the real sgl_kernel on a GPU machine"
        )

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Unavailable(f"{self._qualname}.{name}")

    def __repr__(self):
        return f"<tidal CPU stand-in {self._qualname}>"


class _StubModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Unavailable(f"{self.__name__}.{name}")


class _StubLoader(importlib.abc.Loader):
    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []  # a package, so that every submodule import also reaches the finder
        if spec.name == _ROOT:
            module.__version__ = _STUB_VERSION
            sys.stderr.write(MARKER + "\n")
        module.__tidal_cpu_stub__ = True
        return module

    def exec_module(self, module):
        return None


class SglKernelStubFinder(importlib.abc.MetaPathFinder):
    """Serves ``sgl_kernel`` and ``sgl_kernel.*`` before the real (CUDA-only) package is found."""

    def find_spec(self, fullname, path=None, target=None):
        """A stand-in spec for ``sgl_kernel`` and its submodules; None (not ours) for anything else."""
        if fullname == _ROOT or fullname.startswith(_ROOT + "."):
            return importlib.machinery.ModuleSpec(fullname, _StubLoader(), is_package=True)
        return None


# The module whose release_memory_occupation synchronizes the (absent) CUDA device, and what marks the patch.
WEIGHT_UPDATER = "sglang.srt.managers.scheduler_components.weight_updater"
RELEASE_MARKER = "[tidal cpu_stub] release_memory_occupation without torch.cuda.synchronize"


class _PatchingLoader(importlib.abc.Loader):
    """Runs the real loader, then patches the module it made."""

    def __init__(self, loader, patch):
        self._loader, self._patch = loader, patch

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        self._patch(module)


def _patch_release(module):
    """``release_memory_occupation`` with ``torch.cuda.synchronize`` a no-op while it runs (CPU: nothing to wait)."""
    import torch

    cls = module.SchedulerWeightUpdaterManager
    release = cls.release_memory_occupation

    def release_memory_occupation(self, recv_req):
        synchronize = torch.cuda.synchronize
        torch.cuda.synchronize = lambda device=None: None
        try:
            return release(self, recv_req)
        finally:
            torch.cuda.synchronize = synchronize

    release_memory_occupation.__wrapped__ = release
    cls.release_memory_occupation = release_memory_occupation
    sys.stderr.write(RELEASE_MARKER + "\n")


# The module whose host-buffer allocators pin memory through CUDA, and what marks the patch.
HOST_POOL = "sglang.srt.mem_cache.pool_host.common"
HOST_POOL_MARKER = "[tidal cpu_stub] unpinned host buffers for device cpu"


def _alloc_unpinned(dims, dtype, device, pin_memory, allocator, registration_granularity_bytes=None):
    """``ALLOC_MEMORY_FUNCS``'s signature: the allocator's buffer, never pinned (no CUDA to register it with)."""
    return allocator.allocate(dims, dtype=dtype, device=device)


def _patch_host_pool(module):
    """Host buffers for device "cpu" allocated without ``cudaHostRegister``."""
    module.ALLOC_MEMORY_FUNCS["cpu"] = _alloc_unpinned
    sys.stderr.write(HOST_POOL_MARKER + "\n")


class _ModulePatchFinder(importlib.abc.MetaPathFinder):
    """Finds ``MODULE`` where Python would, with a loader that applies ``patch`` once the module has run."""

    MODULE = ""

    @staticmethod
    def patch(module):
        raise NotImplementedError

    def find_spec(self, fullname, path=None, target=None):
        """The real spec of ``MODULE`` with a loader that patches it; None for anything else."""
        if fullname != self.MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _PatchingLoader(spec.loader, self.patch)
        return spec


class CpuMemoryReleaseFinder(_ModulePatchFinder):
    """Patches SGLang's weight updater as it is imported, so that memory release works on a CPU server."""

    MODULE = WEIGHT_UPDATER
    patch = staticmethod(_patch_release)


class CpuHostPoolFinder(_ModulePatchFinder):
    """Patches SGLang's host-buffer allocators as they are imported, so that routed experts can be captured on CPU."""

    MODULE = HOST_POOL
    patch = staticmethod(_patch_host_pool)


# SGLang's LoRA layers (--enable-lora), whose import marks the pinned-memory patch, and what marks it.
LORA_LAYERS = "sglang.srt.lora.layers"
PIN_MARKER = "[tidal cpu_stub] pin_memory is a no-op (LoRA serving on CPU)"
_PINNING_FACTORIES = ("tensor", "empty", "zeros", "ones", "full", "arange", "ones_like", "zeros_like", "empty_like")


def _drop_pin_memory(factory):
    def make(*args, **kwargs):
        kwargs.pop("pin_memory", None)
        return factory(*args, **kwargs)

    make.__wrapped__ = factory
    return make


def _patch_pin_memory(module):
    """Pinned host memory is a CUDA notion: without CUDA, ``pin_memory`` (argument or method) leaves a tensor as is.

    SGLang's LoRA serving pins its small index and offset tensors unconditionally (``pin_memory=True`` in
    ``sglang/srt/lora/layers.py`` and ``backend/torch_backend.py``), which raises "Found no NVIDIA driver" here. Applied
    to the whole server process once its LoRA layers are imported; nothing else there can pin without CUDA either.
    """
    import torch

    if torch.cuda.is_available():
        return
    torch.Tensor.pin_memory = lambda self, device=None: self
    for name in _PINNING_FACTORIES:
        setattr(torch, name, _drop_pin_memory(getattr(torch, name)))
    sys.stderr.write(PIN_MARKER + "\n")


class CpuLoRAFinder(importlib.abc.MetaPathFinder):
    """Makes ``pin_memory`` a no-op as SGLang's LoRA layers are imported, so that LoRA serving runs on a CPU server."""

    def find_spec(self, fullname, path=None, target=None):
        """The real spec of ``LORA_LAYERS`` with a loader that patches first; None for anything else."""
        if fullname != LORA_LAYERS:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _PatchingLoader(spec.loader, _patch_pin_memory)
        return spec


def install():
    """Put the finders first on ``sys.meta_path`` (idempotent)."""
    for finder in (SglKernelStubFinder, CpuMemoryReleaseFinder, CpuHostPoolFinder, CpuLoRAFinder):
        if not any(isinstance(f, finder) for f in sys.meta_path):
            sys.meta_path.insert(0, finder())


install()
