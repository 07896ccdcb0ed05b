"""Two scoped workarounds around megatron-core 0.19.2 and torch.distributed.checkpoint.

Each is active only inside a ``with`` block and undone on exit (no import-time patching, no global state left).

1. ``sync_save_shims``: (a) megatron's synchronous save calls ``torch.cuda.synchronize()``
   (FileSystemWriterAsync.preload_tensors) and builds a flag tensor on ``torch.cuda.current_device()``
   (state_dict_saver.save_state_dict_async_finalize), both of which raise "Found no NVIDIA driver" on a CPU-only
   machine; replaced only when CUDA is unavailable. (b) Its first save starts a ``multiprocessing`` Manager
   with the *spawn* method (filesystem_async.get_write_results_queue) only to pass write results between
   threads of this one process; the spawned child re-imports the main module (20-50 s with megatron on a busy
   box). A synchronous save needs no process: it gets a plain ``queue.Queue``; an async save gets the queue of
   a *forked* Manager (``async_save.start_results_manager``), which starts in ~50 ms. (a) also covers the async
   path: megatron's ``TemporalAsyncCaller`` and ``AsyncCallsQueue`` call the same two CUDA functions.
2. ``weights_only_unpickling``: torch DCP's ``DefaultLoadPlanner.load_bytes`` unpickles every non-tensor item
   (megatron's common state, ShardedObjects such as RNG states) with ``torch.load(weights_only=False)``, which
   runs arbitrary code from a crafted checkpoint. Inside the block that call gets ``weights_only=True``.
"""

from __future__ import annotations

import contextlib
import queue
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed.checkpoint.default_planner as _dcp_default_planner
from megatron.core.dist_checkpointing.strategies import filesystem_async as _mcore_filesystem_async


@contextlib.contextmanager
def results_queue_from(make_queue: Callable[[], Any]) -> Iterator[None]:
    """Hand megatron's save writer ``make_queue()`` instead of a spawned Manager's queue."""
    saved = _mcore_filesystem_async.get_write_results_queue
    _mcore_filesystem_async.get_write_results_queue = lambda mp_mode="spawn": make_queue()
    try:
        yield
    finally:
        _mcore_filesystem_async.get_write_results_queue = saved


def in_process_results_queue() -> contextlib.AbstractContextManager[None]:
    """Hand megatron's synchronous save a ``queue.Queue`` (results pass between threads of this process)."""
    return results_queue_from(queue.Queue)


@contextlib.contextmanager
def cuda_free_save() -> Iterator[None]:
    """Make the two CUDA calls of megatron's synchronous save harmless; a no-op when CUDA is available."""
    if torch.cuda.is_available():
        yield
        return
    saved = torch.cuda.synchronize, torch.cuda.current_device
    torch.cuda.synchronize = lambda device=None: None
    torch.cuda.current_device = lambda: "cpu"  # only used as a `device=` argument on this path
    try:
        yield
    finally:
        torch.cuda.synchronize, torch.cuda.current_device = saved


@contextlib.contextmanager
def sync_save_shims() -> Iterator[None]:
    """Both save-side shims: an in-process results queue and, without CUDA, CUDA-free synchronization."""
    with in_process_results_queue(), cuda_free_save():
        yield


class _WeightsOnlyTorch(types.ModuleType):
    """Stands in for ``torch`` inside DCP's default planner: everything is torch's, but ``load`` is safe."""

    def __init__(self) -> None:
        super().__init__("torch")

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    @staticmethod
    def load(f: Any, *args: Any, **kwargs: Any) -> Any:
        kwargs["weights_only"] = True
        return torch.load(f, *args, **kwargs)


@contextlib.contextmanager
def weights_only_unpickling() -> Iterator[None]:
    """Make DCP unpickle non-tensor checkpoint items with ``torch.load(weights_only=True)``."""
    saved = _dcp_default_planner.torch
    _dcp_default_planner.torch = _WeightsOnlyTorch()
    try:
        yield
    finally:
        _dcp_default_planner.torch = saved
