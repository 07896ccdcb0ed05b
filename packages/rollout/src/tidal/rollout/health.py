"""Heartbeat of a server: ``/health`` every few seconds in a background thread (slime's rollout fault tolerance).

SGLang answers ``/health`` by generating one token (or at once while it is generating anyway), so a server
whose process lives but whose scheduler hangs fails it too. The heartbeat only reports; what to do (stop the
server, so that the next request restarts it) is the owner's ``on_failure``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from tidal.rollout.client import SGLangClient
from tidal.rollout.server_process import ManagedServer

logger = logging.getLogger(__name__)


class Heartbeat:
    """Checks ``server`` every ``interval_s``; calls ``on_failure(reason)`` once when it dies or misses a beat.

    A miss is no healthy ``/health`` answer within ``timeout_s``, or (a server this process launched) its
    process gone. After a failure the heartbeat pauses until :meth:`resume` (e.g. once the server restarted).
    """

    def __init__(
        self,
        server: SGLangClient,
        *,
        interval_s: float,
        timeout_s: float,
        on_failure: Callable[[str], None],
    ) -> None:
        """Describe the heartbeat; nothing runs until :meth:`start`."""
        if interval_s <= 0 or timeout_s <= 0:
            raise ValueError(f"heartbeat interval and timeout must be > 0, got {interval_s} and {timeout_s}")
        self.server, self.interval_s, self.timeout_s, self.on_failure = server, interval_s, timeout_s, on_failure
        self.checks = 0
        """Beats sent so far."""
        self.failures = 0
        """Failures reported so far."""
        self._stop = threading.Event()
        self._paused = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"heartbeat {server.url}", daemon=True)

    @classmethod
    def from_config(cls, cfg, server: SGLangClient, *, on_failure: Callable[[str], None]) -> Heartbeat | None:
        """The heartbeat of ``cfg``'s ``--rollout-health-check-interval``/``-timeout`` (None at interval 0)."""
        if cfg.rollout_health_check_interval <= 0:
            return None
        interval, timeout = cfg.rollout_health_check_interval, cfg.rollout_health_check_timeout
        return cls(server, interval_s=interval, timeout_s=timeout, on_failure=on_failure)

    def start(self) -> None:
        """Start beating (first check after one interval)."""
        self._thread.start()

    def stop(self) -> None:
        """Stop beating and wait for the thread (at most one check's timeout)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.timeout_s + 1.0)

    def resume(self) -> None:
        """Beat again after a reported failure."""
        self._paused.clear()

    def check(self) -> str | None:
        """One beat now: None when healthy, else why not."""
        self.checks += 1
        if isinstance(self.server, ManagedServer):
            if self.server.starting:  # (re)starting: not healthy yet, and not dead
                return None
            if not self.server.is_running():
                return "its process exited"
        if not self.server.health_ok(timeout_s=self.timeout_s):
            return f"no healthy /health answer within {self.timeout_s:g} s"
        return None

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            if self._paused.is_set():
                continue
            reason = self.check()
            if reason is None or self._stop.is_set():
                continue
            self.failures += 1
            self._paused.set()
            logger.warning("heartbeat: %s: %s", self.server.describe(), reason)
            try:
                self.on_failure(reason)
            except Exception:  # the heartbeat must outlive a failing handler; the traceback is logged
                logger.exception("heartbeat: handling the failure of %s failed", self.server.url)
