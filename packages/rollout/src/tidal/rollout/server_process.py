"""The server's process group and log: what shutdown and start-up errors need."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

_LOG_TAIL_LINES = 40


def log_tail(path: Path, num_lines: int = _LOG_TAIL_LINES) -> str:
    """The last ``num_lines`` lines of a server log, framed for an error message."""
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 256 * 1024))  # enough for 40 lines; SGLang prints one huge args line
            lines = f.read().decode("utf-8", errors="replace").splitlines()[-num_lines:]
    except OSError as e:
        return f"(no server log at {path}: {e})"
    body = "\n".join(line if len(line) <= 2000 else line[:2000] + " ..." for line in lines)
    return f"--- last {len(lines)} lines of {path} ---\n{body}\n--- end of server log ---"


def kill_process_group(pgid: int, sig: int) -> None:
    """Send ``sig`` to every process in group ``pgid``; nothing if the group is gone."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)


def process_group_alive(pgid: int) -> bool:
    """Whether any process is left in group ``pgid``."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # a pid reused by someone else's group: not ours any more
        return False
    return True
