"""A Hugging Face checkpoint's ``config.json``, read once per process while the file stays the same.

The driver's flag checks, each actor rank's model, its reference model and the converter all want the same small
file; each process parses it once (keyed by path, modification time and size, so a rewritten file is read again)
and hands out copies. Standard library only: the command-line checks use it before torch is imported.
"""

from __future__ import annotations

import copy
import functools
import json
import os
from pathlib import Path
from typing import Any


def read_hf_config_json(hf_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """``hf_dir/config.json`` as a dict (a copy: the caller may change it).

    Raises:
        FileNotFoundError: no ``config.json`` in ``hf_dir``.
        OSError: the file cannot be read.
        ValueError: the file is not JSON.
    """
    path = (Path(hf_dir) / "config.json").resolve()
    stat = path.stat()
    return copy.deepcopy(_parsed(str(path), stat.st_mtime_ns, stat.st_size))


@functools.lru_cache(maxsize=16)
def _parsed(path: str, mtime_ns: int, size: int) -> dict[str, Any]:
    """The parsed file; ``mtime_ns`` and ``size`` are only the cache key (a changed file is a new entry)."""
    return json.loads(Path(path).read_text(encoding="utf-8"))
