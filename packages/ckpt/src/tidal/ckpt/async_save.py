"""Asynchronous saves on megatron-core's own async path: plan now, write in a forked process, publish later.

``dist_checkpointing.save(..., async_sharded_save=True, async_strategy="mcore")`` does the collective planning
in the caller and returns an ``AsyncRequest`` whose write function megatron's ``AsyncCallsQueue`` runs in a
forked process (``TemporalAsyncCaller``); the caller gets control back as soon as the process is started. The
tensors it writes are a snapshot: GPU tensors are copied to host memory before the fork (megatron's
``preload_fn``), CPU tensors are the fork's copy-on-write pages, so training may change the live tensors at once.

Finalization is collective and happens in ``AsyncSave.wait()`` / ``done()`` (``CheckpointSaver`` holds the handles
of the saves it started and waits on them before its next save and in ``finalize()``):
megatron writes ``.metadata`` and ``metadata.json``, then tidal publishes the directory by rename and moves the
tracker. Until then the tracker names the previous checkpoint, so killing the process at any moment of an
async save leaves that one loadable. The writer process dies with its parent (``PR_SET_PDEATHSIG`` on Linux), so
a killed trainer leaves no writer behind scribbling into a directory the next save reuses.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import logging
import multiprocessing as mp
import os
import signal
import sys
import time
from collections.abc import Callable
from functools import partial
from multiprocessing.managers import SyncManager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue, AsyncRequest
from tidal.ckpt.errors import CheckpointError
from tidal.ckpt.shims import cuda_free_save, results_queue_from
from torch.distributed.checkpoint.api import CheckpointException as DCPCheckpointException

logger = logging.getLogger(__name__)

DEFAULT_WAIT_TIMEOUT_S = 3600.0
_PROGRESS_EVERY_S = 30.0
_PR_SET_PDEATHSIG = 1


def _die_with_parent(parent_pid: int) -> None:
    """In a child process: get SIGKILL when the parent dies (Linux), and exit if it already has."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:
        os._exit(1)


def _collective_device() -> torch.device:
    """Where a tensor for an all-reduce must live: the current GPU under NCCL, else the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _writer_main(parent_pid: int, write_fn: Callable[..., None], *args: Any, **kwargs: Any) -> None:
    _die_with_parent(parent_pid)
    write_fn(*args, **kwargs)


def start_results_manager() -> Any:
    """A forked multiprocessing Manager to carry write results from the writer process back (dies with us).

    Megatron's default spawns a Manager, whose child re-imports the main module (20-50 s here); a forked one
    starts in ~50 ms.
    """
    manager = SyncManager(ctx=mp.get_context("fork"))
    manager.start(_die_with_parent, (os.getpid(),))
    return manager


class AsyncSave:
    """Handle of an asynchronous ``save_checkpoint``; ``wait()`` (collective) publishes the checkpoint."""

    def __init__(self, *, iteration: int, path: Path, calls: AsyncCallsQueue, manager: Any) -> None:
        self.iteration = iteration
        """The iteration being saved."""
        self.path = path
        """``DIR/iter_XXXXXXX``: exists, and the tracker names it, only once the save is finalized."""
        self._calls = calls
        self._manager = manager
        self._finalized = False
        self._closed = False

    def __repr__(self) -> str:
        state = "finalized" if self._finalized else "pending"
        return f"AsyncSave(iteration={self.iteration}, path={str(self.path)!r}, {state})"

    @property
    def pending(self) -> bool:
        """Neither published nor given up (failed or timed out)."""
        return not (self._finalized or self._closed)

    def _writers_alive(self) -> bool:
        return any(
            getattr(call.async_caller, "process", None) is not None and call.async_caller.process.is_alive()
            for call in self._calls.async_calls
        )

    def done(self) -> bool:
        """Whether the save is published; finalizes it if every rank's writer has finished. Collective."""
        if self._finalized:
            return True
        flags = torch.tensor([int(self._writers_alive())], dtype=torch.int64, device=_collective_device())
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        if flags.item():
            return False
        self._finalize()
        return True

    def wait(self, timeout_s: float = DEFAULT_WAIT_TIMEOUT_S) -> Path:
        """Block until the data is durable on every rank, then publish it and move the tracker. Collective.

        Raises:
            CheckpointError: the write failed on some rank or did not finish within ``timeout_s``; the previous
                checkpoint stays the tracker's.
        """
        start = last_log = time.monotonic()
        pause = 0.01
        while not self._finalized:
            elapsed = time.monotonic() - start
            # Agree on "still writing" and "out of time" in one collective, so every rank takes the same branch.
            alive_late = [int(self._writers_alive()), int(elapsed > timeout_s)]
            flags = torch.tensor(alive_late, dtype=torch.int64, device=_collective_device())
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
            if flags[1].item():
                self._abort()
                raise CheckpointError(
                    f"async save of iteration {self.iteration} to {self.path.parent} did not finish within "
                    f"{timeout_s:g} s; its writer was stopped and {self.path.parent} still names the previous "
                    f"checkpoint. Check the file system, or save synchronously (drop --async-save)."
                )
            if not flags[0].item():
                self._finalize()
                break
            if time.monotonic() - last_log >= _PROGRESS_EVERY_S:
                logger.info("waiting for the async save of %s: %.0f s so far", self.path, elapsed)
                last_log = time.monotonic()
            time.sleep(pause)
            pause = min(pause * 2, 0.5)
        return self.path

    def _finalize(self) -> None:
        try:
            with cuda_free_save():
                self._calls.maybe_finalize_async_calls(blocking=True)
        except (DCPCheckpointException, Exception) as e:
            raise CheckpointError(
                f"async save of iteration {self.iteration} to {self.path.parent} failed: {_describe_failure(e)}; "
                f"nothing was published and {self.path.parent} still names the previous checkpoint."
            ) from e
        finally:
            self._close()
        self._finalized = True

    def _abort(self) -> None:
        with contextlib.suppress(Exception):
            for call in self._calls.async_calls:
                call.async_caller.close(abort=True)
        self._close()

    def _close(self) -> None:
        with contextlib.suppress(Exception):
            self._manager.shutdown()
        self._closed = True
        atexit.unregister(self._warn_if_pending)

    def _warn_if_pending(self) -> None:
        if self.pending:
            logger.warning(
                "the async save of %s was never finalized (call wait() or CheckpointSaver.finalize() before exit); "
                "%s still names the previous checkpoint",
                self.path,
                self.path.parent,
            )


def _describe_failure(error: BaseException) -> str:
    """The writers' errors, the same on every rank (megatron raises details on the coordinator only)."""
    if not isinstance(error, DCPCheckpointException):
        return f"{type(error).__name__}: {error}"
    # Megatron raises this on every rank (after a broadcast), so the all-gather below cannot hang.
    local = "; ".join(f"rank {rank}: {exc}" for rank, (exc, _tb) in sorted(error.failures.items()))
    gathered: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    return next((text for text in gathered if text), "a writer failed (no details)")


def start_async_save(
    save: Callable[[], AsyncRequest], *, iteration: int, path: Path, publish: Callable[[], None]
) -> AsyncSave:
    """Run megatron's async ``save`` (planning, collective), then fork its writer; ``publish`` runs at finalize.

    Args:
        save: calls ``dist_checkpointing.save(..., async_sharded_save=True)`` into the temp directory.
        iteration: the iteration being saved.
        path: the final ``iter_XXXXXXX`` directory.
        publish: collective; renames the temp directory into place and moves the tracker.
    """
    manager = start_results_manager()
    try:
        with results_queue_from(manager.Queue), cuda_free_save():
            request = save()
            if request.async_fn is not None:
                request = request._replace(async_fn=partial(_writer_main, os.getpid(), request.async_fn))
            request.add_finalize_fn(publish)
            calls = AsyncCallsQueue(persistent=False)
            calls.schedule_async_request(request)
    except BaseException:
        manager.shutdown()
        raise
    handle = AsyncSave(iteration=iteration, path=path, calls=calls, manager=manager)
    atexit.register(handle._warn_if_pending)
    logger.info("async save of %s started; call wait() or CheckpointSaver.finalize() to publish it", path)
    return handle
