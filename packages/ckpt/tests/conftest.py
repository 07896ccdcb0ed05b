"""Run functions on N real gloo ranks: forked processes, each with its own process group.

Forking (not spawning) reuses the parent's imported megatron/torch, which take tens of seconds to import on a
busy two-core box. A child inherits the parent's Python objects but none of its threads: a process group object
left in the parent (the default group, or one in megatron's ``parallel_state`` globals after another package's tests
ran in this process) would hang the child when it is destroyed there, joining gloo threads the child does not have.
``run_ranks`` refuses to fork over one, naming it.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

RANK_TIMEOUT_S = 300  # a rank builds a GPTModel after importing megatron: ~2 min on a loaded 2-core box


def _rank_main(
    fn: Callable[..., Any], rank: int, world_size: int, store: str, queue: Any, args: tuple, backend: str
) -> None:
    import torch
    import torch.distributed as dist

    try:
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        dist.barrier()
        dist.destroy_process_group()
        # Plain pickle: torch's queue reducers would pass tensors by shared memory owned by this exiting process.
        queue.put((rank, "ok", pickle.dumps(result)))
    except BaseException as e:
        queue.put((rank, "error", (type(e).__name__, str(e), traceback.format_exc())))
    finally:
        queue.close()
        queue.join_thread()  # flush the result before the hard exit below
        os._exit(0)


class RankError(Exception):
    """An exception raised on a rank, re-raised in the test with its type name, message and traceback."""

    def __init__(self, rank: int, type_name: str, message: str, tb: str) -> None:
        super().__init__(f"rank {rank}: {type_name}: {message}\n{tb}")
        self.rank, self.type_name, self.message = rank, type_name, message


def run_ranks(world_size: int, fn: Callable[..., Any], *args: Any, tmp_path: Path, backend: str = "gloo") -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks; return results by rank or raise.

    ``backend="nccl"`` needs GPUs, and a parent process that has not initialized CUDA (it forks).
    """
    inherited = _inherited_groups()
    if inherited:
        raise RuntimeError(
            f"this process holds process groups ({', '.join(inherited)}): forked ranks would hang destroying them; "
            "the test that created them must tear them down (tidal.actor.destroy_distributed does)"
        )
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    store = tmp_path / f"store-{os.urandom(4).hex()}"
    procs = [
        ctx.Process(target=_rank_main, args=(fn, rank, world_size, str(store), queue, args, backend))
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    outcomes: dict[int, tuple[str, Any]] = {}
    try:
        for _ in procs:
            rank, status, payload = queue.get(timeout=RANK_TIMEOUT_S)
            outcomes[rank] = (status, payload)
            if status == "error":
                break
    finally:
        for p in procs:
            p.join(timeout=5 if len(outcomes) == world_size else 0.5)
            if p.is_alive():
                p.kill()
                p.join()
    for rank in sorted(outcomes):
        status, payload = outcomes[rank]
        if status == "error":
            raise RankError(rank, *payload)
    return [pickle.loads(outcomes[r][1]) for r in range(world_size)]


def _inherited_groups() -> list[str]:
    """Process groups this process holds, which a forked rank would inherit without their threads."""
    import torch.distributed as dist

    found = ["the default process group"] if dist.is_initialized() else []
    state = sys.modules.get("megatron.core.parallel_state")
    if state is not None:
        found += [f"parallel_state.{k}" for k, v in vars(state).items() if isinstance(v, dist.ProcessGroup)]
    return found


@pytest.fixture
def ranks(tmp_path: Path) -> Callable[..., list[Any]]:
    """``ranks(world_size, fn, *args, backend="gloo")`` runs fn on that many ranks (see run_ranks)."""

    def run(world_size: int, fn: Callable[..., Any], *args: Any, backend: str = "gloo") -> list[Any]:
        return run_ranks(world_size, fn, *args, tmp_path=tmp_path, backend=backend)

    return run


GATE_TIMEOUT_S = 60.0


def install_writer_gate(gate: Path, started: Path) -> None:
    """In this rank process: megatron's checkpoint writer records its pid in ``started``, then waits for ``gate``.

    The writer runs in the process megatron forks for an async save, so this is a slow disk on demand: the test
    decides when (or whether) the data gets written.
    """
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    original = FileSystemWriterAsync.write_preloaded_data_multithread

    def gated(*args: Any, **kwargs: Any) -> Any:
        partial = started.with_name(f".{started.name}.tmp")
        partial.write_text(str(os.getpid()))
        os.replace(partial, started)  # a reader never sees an empty file
        deadline = time.monotonic() + GATE_TIMEOUT_S
        while not gate.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{gate} did not appear within {GATE_TIMEOUT_S} s")
            time.sleep(0.01)
        return original(*args, **kwargs)

    FileSystemWriterAsync.write_preloaded_data_multithread = staticmethod(gated)


@pytest.fixture
def gate_writer() -> Callable[[Path, Path], None]:
    """``gate_writer(gate, started)``, to call inside a rank process (see install_writer_gate)."""
    return install_writer_gate
