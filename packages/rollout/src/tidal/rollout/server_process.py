"""A server as a child process in its own process group: launch, health wait, shutdown with no orphan, log tail.

:class:`ManagedServer` is what an SGLang engine and an sglang-router have in common; each subclass says
which command to run.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import os
import signal
import subprocess
import sys
import time
import weakref
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Self

from tidal.rollout.client import SGLangClient
from tidal.rollout.crash_cause import crash_cause
from tidal.rollout.errors import RolloutError
from tidal.rollout.transport import DEFAULT_MAX_IDLE_S, DEFAULT_RETRIES

logger = logging.getLogger(__name__)

_LOG_TAIL_LINES = 40
_HEALTH_POLL_S = 0.5
_PROGRESS_EVERY_S = 30.0
_SHUTDOWN_GRACE_S = 15.0


def cause_in_log(path: Path, returncode: int | None = None) -> str:
    """``"; cause: ..."`` when the log (and exit code) name why the server died, else ``""``."""
    cause = crash_cause(log_tail(path, 200), returncode)
    return f"; cause: {cause}" if cause else ""


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


_PR_SET_PDEATHSIG = 1


@functools.cache
def _spawner() -> ThreadPoolExecutor:
    """One thread that lives as long as this process, to fork servers from.

    The kernel sends the parent-death signal when the *thread* that forked the child ends, not the process: a
    server forked from a request's pool thread (a restart under --use-fault-tolerance) would be killed when that
    pool shuts down.
    """
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="tidal-spawner")


def _die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` that makes the child get SIGKILL when this process dies, whatever kills it (Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up before the fork: the child only calls it
    parent = os.getpid()

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the line above: nobody would signal us
            os._exit(1)

    return preexec


def spawn_owned(cmd: list[str], **popen_kwargs) -> subprocess.Popen:
    """``subprocess.Popen(cmd, **popen_kwargs)`` in a child that dies with this process (SIGKILL included).

    Forked from one long-lived thread, with ``PR_SET_PDEATHSIG``; SGLang's own worker processes set the same
    on themselves, so a whole server goes when its owner goes.
    """
    return _spawner().submit(subprocess.Popen, cmd, preexec_fn=_die_with_parent(), **popen_kwargs).result()


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


class ManagedServer(SGLangClient):
    """An HTTP server this process launches, owns and stops; subclasses give :meth:`command`.

    The server runs in its own session (process group), so :meth:`shutdown` reaches every helper process
    it forks; a ``weakref.finalize`` kills the group if the owner never calls :meth:`shutdown`, and the
    parent-death signal (:func:`spawn_owned`) kills the server if the owner dies without either. Its stdout
    and stderr go to ``log_path``, whose tail is quoted in every start-up error.
    """

    kind = "server"
    """What the server is called in logs and errors."""

    def __init__(
        self,
        url: str,
        *,
        log_path: Path,
        startup_timeout_s: float,
        request_timeout_s: float = 600.0,
        api_key: str | None = None,
        max_retries: int = DEFAULT_RETRIES,
        max_idle_s: float | None = DEFAULT_MAX_IDLE_S,
    ) -> None:
        """Describe the server; nothing starts until :meth:`start` (request options: see SGLangClient)."""
        if startup_timeout_s <= 0:
            raise ValueError(f"startup_timeout_s must be > 0, got {startup_timeout_s}")
        super().__init__(
            url, api_key=api_key, request_timeout_s=request_timeout_s, max_retries=max_retries, max_idle_s=max_idle_s
        )
        self.log_path = log_path
        self.startup_timeout_s = startup_timeout_s
        self._process: subprocess.Popen[bytes] | None = None
        self._finalizer: weakref.finalize | None = None
        self.starting = False
        """True from launch until healthy (a heartbeat leaves a starting server alone)."""

    def command(self) -> list[str]:
        """The command line that runs the server."""
        raise NotImplementedError

    def server_env(self) -> Mapping[str, str]:
        """Environment of the server process (this process's by default)."""
        return dict(os.environ)

    def describe(self) -> str:
        """How errors name this server: kind, URL and pid."""
        return f"{self.kind} at {self.url} (pid {self.pid})"

    @property
    def pid(self) -> int | None:
        """Process id of the server's launcher (also its process group id), None when not started."""
        return None if self._process is None else self._process.pid

    def is_running(self) -> bool:
        """Whether the launched server process is still alive."""
        return self._process is not None and self._process.poll() is None

    def may_retry(self) -> bool:
        """A failed request is sent again only while the server process lives (a dead one needs a restart)."""
        return self.is_running()

    def dead_error(self, what: str) -> RolloutError:
        """A one-line RolloutError: this server ``what``, with its pid and log file (whose tail is logged here)."""
        logger.error("%s at %s %s; %s", self.kind, self.url, what, log_tail(self.log_path))
        code = self._process.poll() if self._process is not None else None
        return RolloutError(f"{self.describe()} {what}{cause_in_log(self.log_path, code)}; its log: {self.log_path}")

    def start(self, *, wait: bool = True) -> None:
        """Launch the server; with ``wait`` also block until it is healthy (see :meth:`wait_healthy`).

        Raises:
            RolloutError: The server is already running, died during start-up or timed out.
        """
        if self.is_running():
            raise RolloutError(f"{self.kind} at {self.url} is already running (pid {self.pid})")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        cmd = self.command()
        shown = " ".join("***" if prev == "--api-key" else arg for prev, arg in zip(["", *cmd[:-1]], cmd, strict=True))
        logger.info("starting %s at %s: %s (log: %s)", self.kind, self.url, shown, self.log_path)
        with self.log_path.open("ab") as log:
            self._process = spawn_owned(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=dict(self.server_env()),
                start_new_session=True,  # own process group: shutdown() reaches every helper process
            )
        # Kill the group even if the owner forgets shutdown() or the interpreter exits first.
        self._finalizer = weakref.finalize(self, kill_process_group, self._process.pid, signal.SIGKILL)
        if wait:
            self.starting = True
            try:
                self.wait_healthy()
            finally:
                self.starting = False

    def kill(self) -> None:
        """SIGKILL the server's process group now, from any thread (a hung server); :meth:`restart` starts it again."""
        process = self._process
        if process is not None:
            logger.warning("killing %s at %s (pid %d)", self.kind, self.url, process.pid)
            kill_process_group(process.pid, signal.SIGKILL)

    def wait_healthy(self, timeout_s: float | None = None) -> None:
        """Poll ``/health`` until it answers 200, the process dies, or the timeout passes.

        Args:
            timeout_s: Longest wait; defaults to ``startup_timeout_s``.

        Raises:
            RolloutError: The process exited or the timeout passed; the message quotes the server log.
        """
        if self._process is None:
            raise RolloutError(f"{self.kind} at {self.url} was never started; call start() first")
        timeout_s = self.startup_timeout_s if timeout_s is None else timeout_s
        start = time.monotonic()
        next_report = start + _PROGRESS_EVERY_S
        while True:
            if self.health_ok():
                logger.info("%s at %s healthy after %.1f s", self.kind, self.url, time.monotonic() - start)
                return
            now = time.monotonic()
            if now - start > timeout_s:
                self.shutdown()
                raise RolloutError(
                    f"{self.kind} at {self.url} not healthy after {timeout_s:.0f} s (startup_timeout_s); "
                    f"raise it on a slow machine or read the log.\n{log_tail(self.log_path)}"
                )
            if now >= next_report:
                logger.info("waiting for %s at %s: %.0f s / %.0f s", self.kind, self.url, now - start, timeout_s)
                next_report = now + _PROGRESS_EVERY_S
            try:  # the poll interval doubles as a wait on the process: a crash is seen at once
                code = self._process.wait(timeout=_HEALTH_POLL_S)
            except subprocess.TimeoutExpired:
                continue
            self.shutdown()
            raise RolloutError(
                f"{self.kind} at {self.url} exited with code {code} during start-up"
                f"{cause_in_log(self.log_path, code)}.\n{log_tail(self.log_path)}"
            )

    def shutdown(self, timeout_s: float = _SHUTDOWN_GRACE_S) -> None:
        """Stop the server and every process in its group; SIGKILL what outlives ``timeout_s``. Idempotent."""
        process = self._process
        if process is None:
            return
        pgid = process.pid
        kill_process_group(pgid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            logger.warning("%s pid %d ignored SIGTERM for %.0f s; killing it", self.kind, pgid, timeout_s)
        while process_group_alive(pgid) and time.monotonic() < deadline:
            time.sleep(0.1)  # children leave the group a moment after the launcher
        kill_process_group(pgid, signal.SIGKILL)
        process.wait(timeout=timeout_s)
        if self._finalizer is not None:
            self._finalizer.detach()
        self._process = None
        logger.info("%s at %s stopped", self.kind, self.url)

    def restart(self) -> None:
        """Stop the server if anything is left of it, then start it again and wait until it is healthy."""
        logger.warning("restarting %s at %s", self.kind, self.url)
        self.shutdown()
        self.start()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
