"""A save SIGKILLed at any step leaves the previous checkpoint loadable; the next save cleans up after it.

Sync saves are killed at five points; async saves while the forked writer is writing (the writer dies with the
trainer) and while the trainer publishes in ``wait()``.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import signal
import time
from pathlib import Path

import pytest
import tidal.ckpt.atomic
import tidal.ckpt.checkpoint
import torch
import torch.distributed as dist
from megatron.core.dist_checkpointing import ShardedTensor
from tidal.ckpt import TRACKER_FILENAME, load_checkpoint, resolve_checkpoint, save_checkpoint
from tidal.ckpt.checkpoint import CheckpointSaver


def _state(value: float) -> dict:
    return {"model": {"w": ShardedTensor.from_rank_offsets("w", torch.full((64, 64), value))}}


def _die(*_args, **_kwargs):
    os.kill(os.getpid(), signal.SIGKILL)


def _kill_when(module, name: str, predicate):
    original = getattr(module, name)

    def hooked(*args, **kwargs):
        if predicate(*args):
            _die()
        return original(*args, **kwargs)

    setattr(module, name, hooked)


def _install(point: str) -> None:
    if point == "tmp_dir_created":  # the temp dir exists, nothing written into it
        tidal.ckpt.checkpoint.dist_checkpointing.save = _die
    elif point == "data_written":  # shards written, megatron's metadata.json not yet
        import megatron.core.dist_checkpointing.serialization as serialization

        serialization.save_config = _die
    elif point == "before_rename":  # complete and fsynced in the temp dir, not yet renamed
        _kill_when(tidal.ckpt.atomic.os, "rename", lambda src, dst: Path(src).name == ".iter_0000002.tmp")
    elif point == "before_tracker":  # iter_0000002 published, tracker still names 1
        _kill_when(tidal.ckpt.atomic.os, "replace", lambda src, dst: str(dst).endswith(TRACKER_FILENAME))
    elif point == "mid_prune":  # tracker names 2, iter_0000001 renamed to its trash name, not yet deleted
        _kill_when(shutil, "rmtree", lambda path, *a: str(path).endswith(".deleting"))


def _wait_for(path: Path, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} did not appear within {timeout_s} s"
        time.sleep(0.01)


def _child(save_dir: Path, point: str, store: Path, gate_writer) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    save_checkpoint(save_dir, 1, _state(1.0))
    if point == "async_writing":  # the trainer dies while its writer process is busy writing
        writer_pid = save_dir.parent / "writer.pid"
        gate_writer(save_dir.parent / "never", writer_pid)
        CheckpointSaver(save_dir, keep_last=1, async_save=True).save(2, _state(2.0))
        _wait_for(writer_pid)
        _die()
    elif point == "async_publishing":  # the data is durable; the trainer dies in wait() before the rename
        handle = CheckpointSaver(save_dir, keep_last=1, async_save=True).save(2, _state(2.0))
        _install("before_rename")
        handle.wait()
    else:
        _install(point)
        save_checkpoint(save_dir, 2, _state(2.0), keep_last=1)
    os._exit(3)  # not reached: the hook kills the process


def _gone(pid: int, timeout_s: float = 30.0) -> bool:
    """Whether ``pid`` exits (or is a zombie awaiting its reaper) within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except FileNotFoundError:
            return True
        if "\nState:\tZ" in status:
            return True
        time.sleep(0.05)
    return False


def _load_w(save_dir: Path, store: Path, queue) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    loaded, _ = load_checkpoint(save_dir, _state(0.0))
    queue.put(float(loaded["model"]["w"].mean()))
    save_checkpoint(save_dir, 3, _state(3.0))  # the next save must cope with the leftovers
    queue.put(sorted(p.name for p in save_dir.iterdir()))
    queue.close()
    queue.join_thread()
    os._exit(0)


_WRITTEN = [".metadata", "__0_0.distcp"]
LEFTOVERS = {
    "tmp_dir_created": {".iter_0000002.tmp": []},
    "data_written": {".iter_0000002.tmp": _WRITTEN},
    "before_rename": {".iter_0000002.tmp": sorted([*_WRITTEN, "metadata.json"])},
    "before_tracker": {".latest_checkpointed_iteration.txt.tmp": "2\n"},
    "mid_prune": {".iter_0000001.deleting": sorted([*_WRITTEN, "metadata.json"])},
    "async_writing": {".iter_0000002.tmp": []},
    "async_publishing": {".iter_0000002.tmp": sorted([*_WRITTEN, "metadata.json"])},
}


@pytest.mark.parametrize(
    ("point", "survivor", "kept"),
    [
        ("tmp_dir_created", 1, {1}),
        ("data_written", 1, {1}),
        ("before_rename", 1, {1}),
        ("before_tracker", 1, {1, 2}),  # iter 2 was published before the kill: complete, not yet the latest
        ("mid_prune", 2, {2}),
        ("async_writing", 1, {1}),
        ("async_publishing", 1, {1}),
    ],
)
def test_save_killed_part_way_leaves_a_loadable_checkpoint(tmp_path, point, survivor, kept, gate_writer):
    ctx = mp.get_context("fork")
    save_dir = tmp_path / "ckpt"
    child = ctx.Process(target=_child, args=(save_dir, point, tmp_path / "store1", gate_writer))
    child.start()
    child.join(timeout=120)
    assert child.exitcode == -signal.SIGKILL, f"the save was not killed at {point} (exit code {child.exitcode})"
    if point == "async_writing":  # the writer must not outlive the trainer and write into a later save's dir
        assert _gone(int((tmp_path / "writer.pid").read_text())), "the async writer outlived the killed trainer"

    leftovers = {
        p.name: sorted(q.name for q in p.iterdir()) if p.is_dir() else p.read_text()
        for p in save_dir.iterdir()
        if p.name.startswith(".")
    }
    assert leftovers == LEFTOVERS[point], leftovers  # the kill landed where intended

    iteration, iter_dir = resolve_checkpoint(save_dir)
    assert iteration == survivor and iter_dir == save_dir / f"iter_{survivor:07d}"

    queue = ctx.Queue()
    loader = ctx.Process(target=_load_w, args=(save_dir, tmp_path / "store2", queue))
    loader.start()
    mean, names = queue.get(timeout=120), queue.get(timeout=120)
    loader.join(timeout=30)
    assert mean == float(survivor)
    # No temp/trash directory survives the next save; the interrupted iteration is simply absent.
    assert set(names) == {"iter_0000003", TRACKER_FILENAME} | {f"iter_{i:07d}" for i in kept}, names
