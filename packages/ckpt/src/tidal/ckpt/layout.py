"""Megatron's directory layout and the rules that find the one iteration to load.

``DIR/iter_0000123/`` holds one checkpoint (complete once its ``metadata.json`` exists) and
``DIR/latest_checkpointed_iteration.txt`` names the newest. Every way a directory can fail to name a loadable
iteration is a distinct error that says what was found and which flag fixes it; nothing is silently skipped.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

from tidal.ckpt.errors import (
    CheckpointNotFoundError,
    IterationNotFoundError,
    NotAMegatronCheckpointError,
    TrackerFileMissingError,
)

logger = logging.getLogger(__name__)

TRACKER_FILENAME = "latest_checkpointed_iteration.txt"
BEST_FILENAME = "best_checkpointed_iteration.txt"
"""Names the iteration with the best ``--keep-best-by`` metric; ``--keep-last`` never deletes it."""
COMPLETE_MARKER = "metadata.json"
"""Written by megatron dist_checkpointing as the last step of a save."""
_ITER_RE = re.compile(r"^iter_(\d{7,})$")


def iteration_dir_name(iteration: int) -> str:
    """Megatron's name for an iteration directory: ``iter_0000123``."""
    return f"iter_{iteration:07d}"


def is_complete(iter_dir: Path) -> bool:
    """Whether ``iter_dir`` is a finished dist_checkpointing save."""
    return (iter_dir / COMPLETE_MARKER).is_file()


def list_iterations(load_dir: Path) -> list[int]:
    """Sorted iterations with a complete ``iter_XXXXXXX`` directory in ``load_dir``."""
    found = []
    for child in load_dir.iterdir():
        match = _ITER_RE.match(child.name)
        if match and child.is_dir() and is_complete(child):
            found.append(int(match.group(1)))
    return sorted(found)


def _describe(iterations: list[int]) -> str:
    names = [iteration_dir_name(i) for i in iterations]
    if len(names) <= 1:
        return "".join(names)
    shown = names if len(names) <= 6 else [*names[:2], "...", *names[-3:]]
    return ", ".join(shown[:-1]) + " and " + shown[-1]


def _hf_files(path: Path) -> list[str]:
    if not (path / "config.json").is_file():
        return []
    weights = sorted(p.name for p in path.glob("*.safetensors"))
    index = (path / "model.safetensors.index.json").is_file()
    return weights if weights or index else []


def _check_directory(load_dir: Path, flag: str) -> None:
    if not load_dir.exists():
        raise CheckpointNotFoundError(
            f"{flag} {load_dir} does not exist. Point {flag} at the --save directory of an earlier run (it holds "
            f"{TRACKER_FILENAME} and iter_XXXXXXX/), or leave {flag} unset to start from --hf-checkpoint."
        )
    if not load_dir.is_dir():
        raise CheckpointNotFoundError(f"{flag} {load_dir} is a file, not a checkpoint directory.")
    weights = _hf_files(load_dir)
    if weights:
        raise NotAMegatronCheckpointError(
            f"{flag} {load_dir} is a Hugging Face checkpoint (config.json + {len(weights)} *.safetensors file(s)), "
            f"not a Megatron checkpoint. Pass it as --hf-checkpoint {load_dir} instead, and set {flag} only to "
            f"a directory written by --save."
        )
    match = _ITER_RE.match(load_dir.name)
    if match and is_complete(load_dir):
        raise NotAMegatronCheckpointError(
            f"{flag} {load_dir} is a single iteration directory, not a checkpoint directory. Pass its parent: "
            f"{flag} {load_dir.parent} --ckpt-step {int(match.group(1))}."
        )


def _read_tracker(load_dir: Path, available: list[int]) -> int:
    tracker = load_dir / TRACKER_FILENAME
    text = tracker.read_text(encoding="utf-8").strip()
    if not (text.isascii() and text.isdigit()):  # "²".isdigit() is True, and int() refuses it
        hint = f"--ckpt-step {available[-1]}" if available else "--ckpt-step N"
        raise IterationNotFoundError(
            f"{tracker} holds {text!r}, expected an iteration number; {load_dir} holds "
            f"{_describe(available) or 'no complete iteration'}. Pass {hint} to choose one."
        )
    return int(text)


def resolve_checkpoint(load_dir: str | Path, *, ckpt_step: int | None = None, flag: str = "--load") -> tuple[int, Path]:
    """Find the iteration to load from a Megatron checkpoint directory, or say exactly why there is none.

    Args:
        load_dir: the directory given to ``--load`` / ``--ref-load`` (holds ``iter_XXXXXXX/`` and the tracker).
        ckpt_step: load this iteration instead of the one named by ``latest_checkpointed_iteration.txt``.
        flag: the flag ``load_dir`` came from, named in error messages (``--load`` or ``--ref-load``).

    Returns:
        ``(iteration, iteration_dir)`` of a complete checkpoint.

    Raises:
        CheckpointNotFoundError: ``load_dir`` is missing, a file, or holds no checkpoint.
        NotAMegatronCheckpointError: ``load_dir`` is an HF checkpoint or a single iteration directory.
        TrackerFileMissingError: iterations exist but no tracker file (and no ``ckpt_step``).
        IterationNotFoundError: the tracker or ``ckpt_step`` names a missing or incomplete iteration.
    """
    load_dir = Path(load_dir)
    _check_directory(load_dir, flag)
    available = list_iterations(load_dir)
    tracker = load_dir / TRACKER_FILENAME
    if ckpt_step is not None:
        iteration, source = ckpt_step, f"--ckpt-step {ckpt_step}"
    elif tracker.is_file():
        iteration, source = _read_tracker(load_dir, available), f"{tracker} names iteration"
        source = f"{source} {iteration}"
    elif available:
        raise TrackerFileMissingError(
            f"{load_dir} holds {_describe(available)} but no {TRACKER_FILENAME}; pass --ckpt-step {available[-1]} "
            f"to load the newest (or another listed step)."
        )
    else:
        contents = sorted(p.name for p in load_dir.iterdir())
        seen = ", ".join(contents[:8]) + (", ..." if len(contents) > 8 else "") if contents else "nothing"
        raise CheckpointNotFoundError(
            f"{flag} {load_dir} holds no checkpoint (no {TRACKER_FILENAME}, no complete iter_XXXXXXX/; it "
            f"contains: {seen}). Point {flag} at the --save directory of an earlier run, or leave {flag} unset "
            f"to start from --hf-checkpoint."
        )
    iter_dir = load_dir / iteration_dir_name(iteration)
    if iteration not in available:
        state = "is incomplete (no metadata.json: its save did not finish)" if iter_dir.is_dir() else "does not exist"
        hint = f"Pass --ckpt-step {available[-1]} to load the newest complete one." if available else ""
        raise IterationNotFoundError(
            f"{source} but {iter_dir} {state}; {load_dir} holds {_describe(available) or 'no complete iteration'}. "
            f"{hint}".rstrip()
        )
    logger.info("resolved %s %s to iteration %d (%s)", flag, load_dir, iteration, iter_dir)
    return iteration, iter_dir


def mark_best_iteration(save_dir: str | Path, iteration: int) -> None:
    """Name ``iteration`` the best one of ``save_dir`` (``--keep-best-by``): ``--keep-last`` keeps it beyond its K.

    Written atomically (before or after that iteration is saved); a driver-side call, not collective.
    """
    Path(save_dir).mkdir(parents=True, exist_ok=True)
    from tidal.ckpt import atomic

    atomic.replace_text(Path(save_dir) / BEST_FILENAME, f"{iteration}\n")


def best_iteration(save_dir: str | Path) -> int | None:
    """The iteration :func:`mark_best_iteration` named last in ``save_dir``; None when none was."""
    path = Path(save_dir) / BEST_FILENAME
    try:
        return int(path.read_text(encoding="utf-8").strip())
    except (FileNotFoundError, ValueError):
        return None
