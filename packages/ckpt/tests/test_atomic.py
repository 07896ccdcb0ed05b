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


# In-process checks of the file-system steps the saves above are built from (the kills run them in children).


def _tree(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): p.read_text() for p in sorted(root.rglob("*")) if p.is_file()}


def test_publish_dir_moves_a_new_directory_into_place_and_replaces_an_old_one(tmp_path):
    target = tmp_path / "iter_0000001"
    first = tidal.ckpt.atomic.fresh_tmp_dir(target)
    assert first == tmp_path / ".iter_0000001.tmp" and first.is_dir() and not any(first.iterdir())
    (first / "sub").mkdir()
    (first / "sub" / "a.bin").write_text("one")
    tidal.ckpt.atomic.publish_dir(first, target)
    assert _tree(target) == {"sub/a.bin": "one"} and not first.exists()

    (tmp_path / ".iter_0000001.old").mkdir()  # a stale aside copy of an earlier crash
    (tmp_path / ".iter_0000001.old" / "stale").write_text("x")
    second = tidal.ckpt.atomic.fresh_tmp_dir(target)
    (second / "b.bin").write_text("two")
    tidal.ckpt.atomic.publish_dir(second, target)
    assert _tree(target) == {"b.bin": "two"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000001"]


def test_fresh_tmp_dir_empties_what_a_crashed_save_left(tmp_path, caplog):
    target = tmp_path / "out"
    left = tmp_path / ".out.tmp"
    (left / "deep").mkdir(parents=True)
    (left / "deep" / "half.bin").write_text("half")
    tmp = tidal.ckpt.atomic.fresh_tmp_dir(target)
    assert tmp == left and tmp.is_dir() and not any(tmp.iterdir())
    assert f"removing {left} left by an interrupted save" in caplog.text
    nested = tidal.ckpt.atomic.fresh_tmp_dir(tmp_path / "a" / "b" / "out")  # parents are created
    assert nested == tmp_path / "a" / "b" / ".out.tmp" and nested.is_dir()


def test_replace_text_sets_the_content_and_leaves_no_temp_file(tmp_path):
    path = tmp_path / "latest_checkpointed_iteration.txt"
    tidal.ckpt.atomic.replace_text(path, "1\n")
    tidal.ckpt.atomic.replace_text(path, "20\n")
    assert path.read_text() == "20\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]


def test_sweep_restores_a_displaced_original_and_drops_only_leftovers(tmp_path, caplog):
    for name in (".iter_0000001.old", ".iter_0000002.old", "iter_0000002", ".iter_0000003.tmp",
                 ".iter_0000004.deleting", ".cache"):  # fmt: skip
        (tmp_path / name).mkdir()
        (tmp_path / name / "f").write_text(name)
    (tmp_path / ".notes.tmp").write_text("a file, not a save")
    (tmp_path / ".a").write_text("a file sorted before every directory: the sweep goes on past it")
    tidal.ckpt.atomic.sweep_interrupted(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".a", ".cache", ".notes.tmp", "iter_0000001", "iter_0000002"]
    assert (tmp_path / "iter_0000001" / "f").read_text() == ".iter_0000001.old"  # moved back whole
    assert (tmp_path / "iter_0000002" / "f").read_text() == "iter_0000002"  # the published one wins
    assert "restoring iter_0000001 displaced by an interrupted save" in caplog.text
    assert f"removing {tmp_path / '.iter_0000003.tmp'} left by an interrupted save" in caplog.text
