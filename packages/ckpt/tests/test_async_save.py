"""Async saves on megatron-core's async path (forked writer), on real gloo ranks.

The ``gate_writer`` fixture holds megatron's writer (in its forked process) until the test opens the gate: a slow
disk on demand, so "the caller got control back before the data was written" is a fact, not a race.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from megatron.core.dist_checkpointing import ShardedTensor
from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync
from tidal.ckpt import (
    TRACKER_FILENAME,
    CheckpointError,
    TrainerState,
    load_checkpoint,
    save_checkpoint,
)
from tidal.ckpt.async_save import AsyncSave
from tidal.ckpt.checkpoint import CheckpointSaver

FULL_W = torch.arange(8 * 6, dtype=torch.float32).reshape(8, 6)
FULL_V = torch.arange(4 * 10, dtype=torch.bfloat16).reshape(4, 10)


def _state(rank: int, world: int, *, zeros: bool = False) -> dict:
    w, v = FULL_W.chunk(world, dim=0)[rank].clone(), FULL_V.chunk(world, dim=1)[rank].clone()
    if zeros:
        w, v = torch.zeros_like(w), torch.zeros_like(v)
    return {
        "model": {
            "w": ShardedTensor.from_rank_offsets("decoder.w", w, (0, rank, world)),
            "v": ShardedTensor.from_rank_offsets("decoder.v", v, (1, rank, world)),
        },
        "optimizer": {"lr_scheduler": {"num_steps": 7}},
    }


def _read_when_written(path: Path, timeout_s: float = 60.0) -> str:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} did not appear within {timeout_s} s"
        time.sleep(0.01)
    return path.read_text()


def _visible(save_dir: Path) -> list[str]:
    return sorted(p.name for p in save_dir.iterdir() if not p.name.startswith("."))


def test_caller_regains_control_before_the_write_and_the_result_equals_a_sync_save(ranks, tmp_path, gate_writer):
    """--async-save returns before the write, and writes what a sync save does."""

    def body(rank, world, root):
        trainer = TrainerState(rollout_id=2, weight_version=3).to_dict()
        state = _state(rank, world)
        save_checkpoint(root / "sync", 2, state, common_state=trainer)
        gate_writer(root / "gate", root / f"writer{rank}.pid")
        handle = CheckpointSaver(root / "async", async_save=True).save(2, state, common_state=trainer)
        seen = {
            "handle": isinstance(handle, AsyncSave),
            "listing": _visible(root / "async"),  # neither the iteration nor the tracker yet
            "done": handle.done(),
            "writer_pid": int(_read_when_written(root / f"writer{rank}.pid")),
        }
        for tensor in state["model"].values():  # training goes on and changes the live tensors
            tensor.data.mul_(-1)
        dist.barrier()
        if rank == 0:
            (root / "gate").touch()
        seen["path"] = handle.wait()
        seen["done_after"] = handle.done()
        seen["tracker"] = (root / "async" / TRACKER_FILENAME).read_text()
        loaded = {name: load_checkpoint(root / name, _state(rank, world, zeros=True)) for name in ("sync", "async")}
        return seen, loaded, os.getpid()

    for rank, (seen, loaded, pid) in enumerate(ranks(2, body, tmp_path)):
        assert seen["handle"] and seen["listing"] == [] and seen["done"] is False, seen
        assert seen["writer_pid"] != pid  # the data is written by another process
        assert seen["path"] == tmp_path / "async" / "iter_0000002" and seen["done_after"] is True
        assert seen["tracker"] == "2\n"
        (sync_state, sync_common), (async_state, async_common) = loaded["sync"], loaded["async"]
        assert torch.equal(async_state["model"]["w"], FULL_W.chunk(2, dim=0)[rank])  # the snapshot, not -W
        assert torch.equal(async_state["model"]["v"], FULL_V.chunk(2, dim=1)[rank])
        for key in ("w", "v"):
            assert torch.equal(async_state["model"][key], sync_state["model"][key])
        assert async_state["optimizer"] == sync_state["optimizer"] and async_common == sync_common
    sync_files = sorted(p.name for p in (tmp_path / "sync" / "iter_0000002").iterdir())
    assert sorted(p.name for p in (tmp_path / "async" / "iter_0000002").iterdir()) == sync_files


def test_pending_saves_publish_in_order_and_keep_last_prunes_after_publishing(ranks, tmp_path):
    def body(rank, world, save_dir):
        listings = []
        saver = CheckpointSaver(save_dir, keep_last=2, async_save=True)
        for iteration in (1, 2, 3):
            handle = saver.save(iteration, _state(rank, world))
            listings.append(_visible(save_dir))  # each save first publishes the one before it
        published = saver.finalize()
        return listings, published, saver.finalize(), handle.done(), _visible(save_dir)

    listings, published, again, done, final = ranks(1, body, tmp_path / "ckpt")[0]
    assert listings == [
        [],
        ["iter_0000001", TRACKER_FILENAME],
        ["iter_0000001", "iter_0000002", TRACKER_FILENAME],
    ]
    assert published == [tmp_path / "ckpt" / "iter_0000003"] and again == [] and done is True
    assert final == ["iter_0000002", "iter_0000003", TRACKER_FILENAME]
    assert (tmp_path / "ckpt" / TRACKER_FILENAME).read_text() == "3\n"


def _disk_full(*_args, **_kwargs):
    raise OSError(28, "No space left on device")


@pytest.mark.parametrize("failure", ["write_error", "timeout"])
def test_a_failed_async_save_raises_on_every_rank_and_publishes_nothing(ranks, tmp_path, failure, gate_writer):
    def body(rank, world, save_dir):
        save_checkpoint(save_dir, 1, _state(rank, world))
        if failure == "write_error":
            FileSystemWriterAsync.write_preloaded_data = staticmethod(_disk_full)
        else:
            gate_writer(save_dir.parent / "never", save_dir.parent / f"writer{rank}.pid")
        saver = CheckpointSaver(save_dir, async_save=True)
        handle = saver.save(2, _state(rank, world))
        with pytest.raises(CheckpointError) as e:
            handle.wait(timeout_s=0.5 if failure == "timeout" else 60.0)
        return str(e.value), saver.finalize(), _visible(save_dir)

    for message, pending, listing in ranks(2, body, tmp_path / "ckpt"):
        expected = "No space left on device" if failure == "write_error" else "did not finish within 0.5 s"
        assert expected in message and "still names the previous checkpoint" in message, message
        assert pending == [] and listing == ["iter_0000001", TRACKER_FILENAME]
    assert (tmp_path / "ckpt" / TRACKER_FILENAME).read_text() == "1\n"


@pytest.mark.gpu
def test_async_save_of_cuda_tensors_over_nccl_snapshots_before_returning(ranks, tmp_path):
    """The GPU path: megatron copies device tensors to host before forking its writer; NCCL finalization."""

    def body(rank, world, root):
        state = _state(rank, world)
        for tensor in state["model"].values():
            tensor.data = tensor.data.cuda()
        save_checkpoint(root / "sync", 2, state)
        handle = CheckpointSaver(root / "async", async_save=True).save(2, state)
        for tensor in state["model"].values():  # training goes on, on the GPU
            tensor.data.mul_(-1)
        handle.wait()
        request = _state(rank, world, zeros=True)
        for tensor in request["model"].values():
            tensor.data = tensor.data.cuda()
        loaded = {name: load_checkpoint(root / name, request)[0]["model"] for name in ("sync", "async")}
        return {name: {k: v.cpu() for k, v in model.items()} for name, model in loaded.items()}

    (loaded,) = ranks(1, body, tmp_path, backend="nccl")
    assert torch.equal(loaded["async"]["w"], FULL_W) and torch.equal(loaded["async"]["v"], FULL_V)
    assert torch.equal(loaded["sync"]["w"], FULL_W)
