"""Megatron checkpoints: save and load sharded state dicts with megatron-core dist_checkpointing (torch_dist).

A save goes to a hidden temp directory beside ``iter_XXXXXXX``, is fsynced and renamed into place, and only then
does ``latest_checkpointed_iteration.txt`` move on (see ``atomic``). A load resolves the iteration with
``resolve_checkpoint``, then checks the request against the checkpoint's metadata on every rank before reading a
byte: a model key the checkpoint lacks, a checkpoint key the model does not use, or a shape mismatch raises
``CheckpointMismatchError`` on all ranks alike. Because tensors are stored by global shape and offset, a
checkpoint saved at one TP/DP size loads at another.
"""

from __future__ import annotations

import contextlib
import io
import logging
import pickle
import shutil
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.dist_checkpointing.serialization import load_sharded_metadata
from tidal.ckpt import atomic
from tidal.ckpt.async_save import DEFAULT_WAIT_TIMEOUT_S, AsyncSave, start_async_save
from tidal.ckpt.errors import CheckpointError
from tidal.ckpt.layout import (
    TRACKER_FILENAME,
    best_iteration,
    iteration_dir_name,
    list_iterations,
    resolve_checkpoint,
)
from tidal.ckpt.matching import check_request, requested_keys
from tidal.ckpt.shims import sync_save_shims, weights_only_unpickling
from torch.distributed.checkpoint.api import CheckpointException as DCPCheckpointException

logger = logging.getLogger(__name__)

META_KEY = "_tidal"
"""Top-level key of tidal's own entry in megatron's common state: format, iteration, sections, common_state."""
_FORMAT_VERSION = 1
_RESERVED = (META_KEY, "common_state", "content_metadata")


def _require_distributed() -> None:
    if not (dist.is_available() and dist.is_initialized()):
        raise CheckpointError(
            "torch.distributed is not initialized; megatron dist_checkpointing needs a process group. Call "
            "torch.distributed.init_process_group('gloo' or 'nccl', ...) first (a world of 1 process is fine)."
        )


def _check_weights_only(common_state: dict[str, Any]) -> None:
    buffer = io.BytesIO()
    torch.save(common_state, buffer)
    buffer.seek(0)
    try:
        torch.load(buffer, weights_only=True)
    except pickle.UnpicklingError as e:
        raise ValueError(
            "common_state must hold only plain Python values (dict, list, tuple, str, int, float, bool, None) and "
            f"tensors, since it is loaded with torch.load(weights_only=True); this one does not: {e}"
        ) from e


def save_checkpoint(
    save_dir: str | Path,
    iteration: int,
    sharded_state_dict: dict[str, Any],
    *,
    common_state: dict[str, Any] | None = None,
    keep_last: int | None = None,
) -> Path:
    """Save ``DIR/iter_XXXXXXX/`` and point ``DIR/latest_checkpointed_iteration.txt`` at it; collective, atomic.

    A one-off synchronous save. A job that saves repeatedly, or asynchronously, uses a ``CheckpointSaver``.

    Args:
        save_dir: the ``--save`` directory (created if missing).
        iteration: the iteration number (tidal uses the rollout id).
        sharded_state_dict: top-level sections (``"model"``, ``"optimizer"``, ``"rng_state"``, ...) holding
            megatron ``ShardedTensor`` / ``ShardedObject`` values; a load may omit whole sections
            (``--no-load-optim``) but must match the sections it asks for exactly.
        common_state: plain values shared by all ranks (e.g. ``TrainerState.to_dict()``), written once.
        keep_last: after publishing, delete all but the newest ``keep_last`` iterations (never the new one).

    Returns:
        The published iteration directory.
    """
    saved = _save(save_dir, iteration, sharded_state_dict, common_state=common_state, keep_last=keep_last)
    assert isinstance(saved, Path)
    return saved


class CheckpointSaver:
    """Saves one job's checkpoints into ``save_dir``, in order, and holds its async saves until they are published.

    Every rank makes the same calls (they are collective). With ``async_save`` (``--async-save``) ``save`` returns
    as soon as megatron's writer process is started; the data is a snapshot taken then, published by the next
    ``save`` or by ``finalize()``, which every rank must call before the job exits.

    Args:
        save_dir: the ``--save`` directory (created if missing).
        keep_last: after publishing, delete all but the newest ``keep_last`` iterations (``--keep-last``).
        async_save: write in a forked process and publish later (``--async-save``).
    """

    def __init__(self, save_dir: str | Path, *, keep_last: int | None = None, async_save: bool = False) -> None:
        self.save_dir = Path(save_dir)
        self.keep_last = keep_last
        self.async_save = async_save
        self._pending: list[AsyncSave] = []

    def save(
        self, iteration: int, sharded_state_dict: dict[str, Any], *, common_state: dict[str, Any] | None = None
    ) -> Path | AsyncSave:
        """Save ``iteration`` (arguments as ``save_checkpoint``'s); collective.

        A pending async save is published first: saves publish in order, and this save's sweep of interrupted
        temp directories must not take its directory.

        Returns:
            The published iteration directory, or with ``async_save`` the save's ``AsyncSave`` handle.
        """
        self.finalize()
        saved = _save(
            self.save_dir,
            iteration,
            sharded_state_dict,
            common_state=common_state,
            keep_last=self.keep_last,
            async_save=self.async_save,
        )
        if isinstance(saved, AsyncSave):
            self._pending.append(saved)
        return saved

    def finalize(self, *, timeout_s: float = DEFAULT_WAIT_TIMEOUT_S) -> list[Path]:
        """Wait for and publish every async save still pending, oldest first; collective. Call it before exit.

        Returns:
            The published iteration directories (empty when none was pending).
        """
        published = []
        while self._pending:
            handle = self._pending.pop(0)
            if handle.pending:
                published.append(handle.wait(timeout_s))
        return published


def _save(
    save_dir: str | Path,
    iteration: int,
    sharded_state_dict: dict[str, Any],
    *,
    common_state: dict[str, Any] | None,
    keep_last: int | None,
    async_save: bool = False,
) -> Path | AsyncSave:
    _require_distributed()
    if iteration < 0:
        raise ValueError(f"iteration must be >= 0, got {iteration}")
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"--keep-last must be >= 1, got {keep_last}; leave it unset to keep every iteration")
    clash = [key for key in _RESERVED if key in sharded_state_dict]
    if clash:
        raise ValueError(f"sharded_state_dict uses reserved top-level key(s) {clash}; rename them")
    common_state = dict(common_state or {})
    _check_weights_only(common_state)

    save_dir = Path(save_dir)
    target = save_dir / iteration_dir_name(iteration)
    tmp = target.with_name(f".{target.name}.tmp")
    if dist.get_rank() == 0:
        save_dir.mkdir(parents=True, exist_ok=True)
        atomic.sweep_interrupted(save_dir)
        atomic.fresh_tmp_dir(target)
    dist.barrier()

    sections = _gather_sections(sharded_state_dict)
    meta = {"format": _FORMAT_VERSION, "iteration": iteration, "sections": sections, "common_state": common_state}
    to_save = {**sharded_state_dict, META_KEY: meta}
    publish = partial(_publish, tmp, target, keep_last=keep_last)
    if async_save:
        save = partial(dist_checkpointing.save, to_save, str(tmp), async_sharded_save=True, async_strategy="mcore")
        return start_async_save(save, iteration=iteration, path=target, publish=publish)
    with sync_save_shims():
        dist_checkpointing.save(to_save, str(tmp))
    publish()
    return target


def _publish(tmp: Path, target: Path, *, keep_last: int | None) -> None:
    """Collective: rank 0 renames ``tmp`` to ``target``, moves the tracker, prunes; every rank sees its outcome."""
    dist.barrier()
    error = None
    if dist.get_rank() == 0:
        try:
            atomic.publish_dir(tmp, target)
            atomic.replace_text(target.parent / TRACKER_FILENAME, f"{_iteration_of(target)}\n")
            if keep_last is not None:
                _prune(target.parent, keep=keep_last, current=_iteration_of(target))
        except OSError as e:
            error = f"{type(e).__name__}: {e}"
    outcome = [error]
    dist.broadcast_object_list(outcome, src=0)  # a rank-0 failure must not leave the others waiting
    if outcome[0] is not None:
        raise CheckpointError(f"publishing {target} failed on rank 0: {outcome[0]}")
    logger.info("saved checkpoint %s", target)


def _iteration_of(iter_dir: Path) -> int:
    return int(iter_dir.name.removeprefix("iter_"))


def _gather_sections(sharded_state_dict: dict[str, Any]) -> dict[str, list[str]]:
    local = {section: sorted(requested_keys(value)) for section, value in sharded_state_dict.items()}
    gathered: list[dict[str, list[str]] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    merged: dict[str, set[str]] = {}
    for part in gathered:
        assert part is not None
        for section, keys in part.items():
            merged.setdefault(section, set()).update(keys)
    return {section: sorted(keys) for section, keys in merged.items() if keys}


def _prune(save_dir: Path, *, keep: int, current: int) -> None:
    """Delete the oldest iterations beyond ``keep`` but the best; once ``current`` and the tracker are durable."""
    tracked = (save_dir / TRACKER_FILENAME).read_text(encoding="utf-8").strip()
    assert tracked == str(current), f"the tracker names {tracked}, not the just-saved {current}"
    best = best_iteration(save_dir)
    others = [i for i in list_iterations(save_dir) if i not in (current, best)]
    doomed = others[: max(0, len(others) - (keep - 1))]
    for iteration in doomed:
        path = save_dir / iteration_dir_name(iteration)
        # Rename first so a crash mid-delete never leaves a half-deleted directory that looks complete.
        trash = path.with_name(f".{path.name}.deleting")
        path.rename(trash)
        shutil.rmtree(trash)
        logger.info("--keep-last %d: removed %s", keep, path)


@contextlib.contextmanager
def _readable(iter_dir: Path) -> Iterator[None]:
    """Turn unreadable-checkpoint exceptions from megatron/DCP into a CheckpointError that says why."""
    try:
        yield
    except (pickle.UnpicklingError, DCPCheckpointException, CheckpointingException) as e:
        if "Weights only load failed" in str(e):
            raise CheckpointError(
                f"{iter_dir} holds pickled objects that torch.load(weights_only=True) refuses (a checkpoint not "
                f"written by tidal, or a crafted one); tidal never unpickles arbitrary objects. Convert it to "
                f"plain values, or start from --hf-checkpoint."
            ) from e
        raise CheckpointError(f"{iter_dir} could not be read (corrupt or truncated?): {e}") from e


def load_checkpoint(
    load_dir: str | Path,
    sharded_state_dict: dict[str, Any],
    *,
    ckpt_step: int | None = None,
    flag: str = "--load",
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Load exactly the sections of ``sharded_state_dict`` from a Megatron checkpoint; collective.

    Args:
        load_dir: the ``--load`` / ``--ref-load`` directory.
        sharded_state_dict: what to load, shaped like the saved dict; omit a section (e.g. ``"optimizer"``
            under ``--no-load-optim``, ``"rng_state"`` under ``--no-load-rng``) to skip it.
        ckpt_step: iteration to load instead of the tracker's (``--ckpt-step``).
        flag: the flag ``load_dir`` came from, named in error messages.

    Returns:
        ``(state_dict, common_state)``: the loaded sections (tensors in place of ShardedTensors) and the
        ``common_state`` given to ``save_checkpoint``.

    Raises:
        CheckpointError: a subclass saying why nothing was loaded (see ``resolve_checkpoint``), or
            ``CheckpointMismatchError`` when the request and the checkpoint differ.
    """
    _require_distributed()
    iteration, iter_dir = resolve_checkpoint(load_dir, ckpt_step=ckpt_step, flag=flag)
    with weights_only_unpickling(), _readable(iter_dir):
        common = dist_checkpointing.load_common_state_dict(str(iter_dir))
        meta = common.get(META_KEY)
        if meta is None:
            logger.warning("%s was not written by tidal: unused checkpoint tensors cannot be detected", iter_dir)
        ckpt_metadata = load_sharded_metadata(str(iter_dir))
        check_request(sharded_state_dict, ckpt_metadata, meta, iter_dir=iter_dir, flag=flag, load_dir=load_dir)
        loaded = dist_checkpointing.load(sharded_state_dict, str(iter_dir))
    # Megatron merges the whole common state in; return only the sections asked for.
    loaded = {key: value for key, value in loaded.items() if key in sharded_state_dict}
    logger.info("loaded iteration %d from %s (sections: %s)", iteration, iter_dir, sorted(sharded_state_dict))
    return loaded, dict(meta["common_state"]) if meta else {}
