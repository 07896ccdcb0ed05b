"""What the terminal shows of a run besides its log lines: a live line for start-up and one for the rollouts.

On a terminal (stderr is a TTY) a rich progress line rewrites itself: while the cluster starts, a spinner naming
what it waits for; then the rollout under way, its phase (generate, train, sync weights, evaluate, checkpoint),
the rollouts done, the elapsed time and an ETA. Log lines print above it, and it is gone when the run ends.
Redirected to a file or a pipe there is none of it: only the log lines, plain, no escape codes.
"""

from __future__ import annotations

import sys
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, Self


def is_terminal() -> bool:
    """Whether stderr (where the log lines go) is a terminal a person watches."""
    return sys.stderr.isatty()


def waiting(what: str) -> AbstractContextManager[Any]:
    """A spinner saying ``what`` the run waits for, while the block runs (on a terminal; else nothing)."""
    if not is_terminal():
        return nullcontext()
    return _spinner(what)


@contextmanager
def _spinner(what: str):
    from rich.console import Console

    with Console(stderr=True).status(what, spinner="dots"):
        yield


class RolloutBar:
    """The live rollout line: ``rollout 7/110: train ━━━━━━━━━━━━━━━━━━━━━━━╸━━━━  6/110 0:00:21 ETA 0:04:40``.

    A no-op unless stderr is a terminal (``live`` forces it either way).
    """

    def __init__(self, num_rollout: int, *, live: bool | None = None) -> None:
        """A bar over ``num_rollout`` rollouts; it shows from the first :meth:`phase` until the block ends."""
        self.num_rollout = num_rollout
        self.live = is_terminal() if live is None else live
        self._progress: Any = None
        self._task: Any = None

    def __enter__(self) -> Self:
        if self.live:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                SpinnerColumn,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            self._progress = Progress(
                SpinnerColumn(),
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TextColumn("ETA"),
                TimeRemainingColumn(),
                console=Console(stderr=True),
                transient=True,  # the finished run leaves its rollout lines, not a bar
                speed_estimate_period=600.0,
            )
            self._progress.start()
        return self

    def phase(self, rollout_id: int, name: str) -> None:
        """Rollout ``rollout_id`` (0-based) is in phase ``name``; the rollouts before it are done."""
        if self._progress is None:
            return
        description = f"rollout {rollout_id + 1}/{self.num_rollout}: {name}"
        if self._task is None:  # a resumed run starts part-way: its ETA counts only this run's rollouts
            self._task = self._progress.add_task(description, total=self.num_rollout, completed=rollout_id)
        else:
            self._progress.update(self._task, description=description, completed=rollout_id)
        self._progress.refresh()  # drawn now: a phase may end before the next timed redraw

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
