"""Progress of a long generation: samples done out of the total, samples/s and ETA.

One log line every ``log_every_s`` seconds and one at the end, so that a job whose output goes to a file still
shows that it moves; a tqdm bar on stderr when asked (off by default: an app that owns the terminal, such as
``train`` with its live rollout line, draws its own).
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from typing import Any, Self

logger = logging.getLogger(__name__)

DEFAULT_LOG_EVERY_S = 30.0


class GenerationProgress:
    """Counts finished samples of one generation call and reports rate and ETA."""

    def __init__(
        self, total: int, *, desc: str = "generate", log_every_s: float = DEFAULT_LOG_EVERY_S, bar: bool = False
    ) -> None:
        """Start the clock.

        Args:
            total: Samples the call will produce.
            desc: Name of the operation in the log line and bar.
            log_every_s: Seconds between log lines (0: a line at every update).
            bar: Also show a tqdm bar on stderr.
        """
        self.total = total
        self.done = 0
        self.desc = desc
        self.log_every_s = log_every_s
        self._start = time.monotonic()
        self._next_log = self._start + log_every_s
        self._bar: Any = None
        self._lock = threading.Lock()  # updates may come from worker threads
        if bar:
            from tqdm import tqdm  # deferred: only interactive runs draw a bar

            self._bar = tqdm(total=total, desc=desc, unit="sample", file=sys.stderr, leave=False, dynamic_ncols=True)

    @property
    def rate(self) -> float:
        """Samples per second so far."""
        elapsed = time.monotonic() - self._start
        return self.done / elapsed if elapsed > 0 else 0.0

    def line(self) -> str:
        """``generate: 48/128 samples (37%), 12.5 samples/s, ETA 6 s``."""
        rate = self.rate
        eta = (self.total - self.done) / rate if rate > 0 else float("inf")
        share = 100.0 * self.done / self.total if self.total else 100.0
        return f"{self.desc}: {self.done}/{self.total} samples ({share:.0f}%), {rate:.1f} samples/s, ETA {eta:.0f} s"

    def update(self, num_samples: int) -> None:
        """Count ``num_samples`` more finished samples; log a line if ``log_every_s`` has passed."""
        with self._lock:
            self.done += num_samples
            if self._bar is not None:
                self._bar.update(num_samples)
            now = time.monotonic()
            if now >= self._next_log:
                logger.info("%s", self.line())
                self._next_log = now + self.log_every_s

    def close(self) -> None:
        """Log the final line and remove the bar."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        logger.info("%s (%.1f s)", self.line(), time.monotonic() - self._start)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
