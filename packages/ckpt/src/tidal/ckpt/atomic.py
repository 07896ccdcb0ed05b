"""Crash-safe file-system steps: fsync a tree, publish a directory by rename, replace a small file.

A checkpoint is written into a hidden temporary directory beside its target, flushed to disk, and only then
renamed into place; the tracker file is updated last, by write-temp-then-``os.replace``. A crash (even
``kill -9``) at any moment therefore leaves the previous checkpoint and tracker intact.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

logger = logging.getLogger(__name__)


def fsync_dir(path: Path) -> None:
    """Flush a directory's entries (new names, renames) to disk."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """Flush every file and directory under ``root`` (inclusive) to disk."""
    for dirpath, _dirnames, filenames in os.walk(root):
        for name in filenames:
            fd = os.open(Path(dirpath) / name, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(dirpath))


def publish_dir(tmp_dir: Path, target: Path) -> None:
    """Move a fully written ``tmp_dir`` to ``target`` (same parent), replacing any existing ``target``.

    The data is fsynced before the rename. When ``target`` exists it is first renamed aside and removed only
    after the new directory is in place, so some complete copy exists at every moment.
    """
    fsync_tree(tmp_dir)
    old = target.with_name(f".{target.name}.old")
    if old.exists():
        shutil.rmtree(old)
    if target.exists():
        os.rename(target, old)
    os.rename(tmp_dir, target)
    fsync_dir(target.parent)
    if old.exists():
        shutil.rmtree(old)


def replace_text(path: Path, text: str) -> None:
    """Atomically set the content of ``path`` to ``text`` (write a temp file, fsync, ``os.replace``)."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def fresh_tmp_dir(target: Path) -> Path:
    """Return an empty hidden temp directory beside ``target``, removing one left by a crashed save."""
    tmp = target.with_name(f".{target.name}.tmp")
    if tmp.exists():
        logger.warning("removing %s left by an interrupted save", tmp)
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def sweep_interrupted(parent: Path) -> None:
    """Clean up after saves killed part-way in ``parent``: drop temp/trash dirs, restore a displaced original.

    ``publish_dir`` over an existing target renames it to ``.NAME.old`` for an instant; if the process died
    right then, the old copy is moved back. Call it only while no other save into ``parent`` is running.
    """
    for path in sorted(parent.glob(".*")):
        if not path.is_dir():
            continue
        if path.name.endswith(".old") and not (parent / path.name[1:-4]).exists():
            logger.warning("restoring %s displaced by an interrupted save", path.name[1:-4])
            os.rename(path, parent / path.name[1:-4])
        elif path.name.endswith((".tmp", ".old", ".deleting")):
            logger.warning("removing %s left by an interrupted save", path)
            shutil.rmtree(path)
