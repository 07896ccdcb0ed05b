"""The run folder: each run without ``--output-dir`` gets a fresh one, and no run writes over another's records.

``uv run train`` writes to ``runs/YYYYMMDD-HHMMSS`` and points the symlink ``runs/latest`` at it, so running it
twice keeps both runs (what a Hydra or W&B user expects of a default). A folder given with ``--output-dir`` that
already holds a run's records (a ``metrics.jsonl`` with records, or a checkpoint in ``--save``) is refused before
anything starts, unless ``--load`` resumes a run into it or ``--overwrite-output-dir`` says to write over it.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

logger = logging.getLogger(__name__)

RUNS_ROOT = Path("runs")
"""Where runs without ``--output-dir`` go (relative to the working directory)."""
LATEST = "latest"
"""Name of the symlink in ``RUNS_ROOT`` that points at the newest run folder there."""
_TRACKER = "latest_checkpointed_iteration.txt"  # tidal.ckpt's tracker file (not imported: this runs at parse time)


def default_output_dir(root: Path = RUNS_ROOT, *, now: float | None = None) -> Path:
    """``root/YYYYMMDD-HHMMSS`` of the local time, with ``-2``, ``-3``, ... when that folder exists already."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    candidate, n = root / stamp, 2
    while candidate.exists() or candidate.is_symlink():
        candidate, n = root / f"{stamp}-{n}", n + 1
    return candidate


def earlier_records(output_dir: Path, save_dir: Path) -> list[Path]:
    """The records of an earlier run that a new run in ``output_dir`` (checkpoints in ``save_dir``) would replace."""
    found = []
    metrics = output_dir / "metrics.jsonl"
    if metrics.is_file() and metrics.stat().st_size > 0:
        found.append(metrics)
    if (save_dir / _TRACKER).is_file():
        found.append(save_dir)
    return found


def check_output_dir(output_dir: Path, save_dir: Path, *, resuming: bool, overwrite: bool) -> None:
    """Refuse a run folder that holds an earlier run's records, unless ``resuming`` (--load) or ``overwrite``.

    Raises:
        ValueError: One line naming the folder, what is in it, and both ways on.
    """
    if resuming or overwrite:
        return
    found = earlier_records(output_dir, save_dir)
    if found:
        raise ValueError(
            f"--output-dir {output_dir} holds an earlier run ({' and '.join(map(str, found))}): resume it with "
            f"--load {save_dir}, write over it with --overwrite-output-dir, or choose another --output-dir"
        )


def link_latest(output_dir: Path, root: Path = RUNS_ROOT) -> None:
    """Point ``root/latest`` at ``output_dir`` when that is a folder directly in ``root`` (replaced atomically).

    A real folder named ``latest`` (an earlier tidal's default run folder) is left as it is.
    """
    link = root / LATEST
    if output_dir.name == LATEST or output_dir.parent.resolve() != root.resolve():
        return
    if link.exists() and not link.is_symlink():
        logger.warning("%s is a folder of an earlier run, not a link: it stays; this run is in %s", link, output_dir)
        return
    tmp = root / f".{LATEST}.{os.getpid()}"
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(output_dir.name)  # relative: the runs folder can be moved or copied whole
    tmp.replace(link)
