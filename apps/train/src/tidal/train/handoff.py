"""The log of how a co-located actor and its engines hand the GPU to each other, call by call.

The plan itself is ``tidal.train.weight_sync.SyncPlan``. The order of one rollout with --offload (slime's):

    generate -> engines release weights + KV cache -> actor onload -> train
    -> engines resume weights -> sync -> engines resume KV cache -> actor offload -> (evaluate) -> generate ...

:class:`HandOffLog` writes each of those calls, with its rollout, to ``RUN/handoff.jsonl``: what the end-to-end
tests read to check the order, and what a user reads when a co-located run runs out of memory.
"""

from __future__ import annotations

import json
import time
from pathlib import Path


class HandOffLog:
    """Appends ``{"rollout", "event", "t"}`` lines to a JSONL file (None: keeps nothing) as the calls happen."""

    def __init__(self, path: Path | None) -> None:
        """Log into ``path`` (appended to: a resumed run continues the file)."""
        self.path = path
        self.rollout: int | None = None
        """The rollout the next events belong to (set when its generation starts; None before the first)."""

    def add(self, event: str, **info: float) -> None:
        """Record ``event`` (e.g. ``"engines.release"``) with numbers about it."""
        if self.path is None:
            return
        line = {"rollout": self.rollout, "event": event, "t": round(time.time(), 3), **info}
        with self.path.open("a") as f:
            f.write(json.dumps(line) + "\n")
