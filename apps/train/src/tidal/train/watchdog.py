"""No orphans: every process a ``train`` run starts dies with it, whatever ends the run (SIGKILL included).

The driver starts one watchdog (``python -m tidal.train.watchdog PID``) in its own session before Ray or SGLang
start. Every half second the watchdog notes the driver's descendants (Ray's GCS, raylet, agents and workers, the
actor ranks, the SGLang servers and the router, and whatever they forked) with their start times. Once the
driver is gone, killed or finished (the watchdog's parent pid changes), it SIGKILLs every noted process that is
still the same process, and whatever those forked since, until none is left; then it exits.

Why a watchdog and not only parent-death signals: Ray's own fate sharing (``PR_SET_PDEATHSIG`` on its GCS and
raylet) leaves its dashboard and runtime-env agents running for a while after a SIGKILL of the driver, and a
child of a Ray worker (an SGLang server in its own session) outlives the worker. Linux only (``/proc``);
elsewhere :func:`start_watchdog` does nothing.

The driver also stops cleanly on SIGTERM (:func:`stop_on_sigterm`) and follows ``uv run`` when uv alone is
killed (:func:`follow_launcher`: uv does not pass SIGKILL on, and its child would run on re-parented to init).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

logger = logging.getLogger(__name__)

POLL_S = 0.5
"""How often the watchdog lists the driver's descendants and checks that the driver is alive."""
_REAP_ROUNDS = 50
_LAUNCHERS = ("uv", "uvx")


def _process_table() -> dict[int, tuple[int, int]]:
    """``{pid: (parent pid, start time in clock ticks)}`` of every live (non-zombie) process."""
    table = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue  # exited meanwhile
        fields = stat[stat.rfind(b")") + 2 :].split()  # the command name may hold spaces and ")"
        if fields[0] in (b"Z", b"X"):
            continue
        table[int(entry.name)] = (int(fields[1]), int(fields[19]))
    return table


def _descendants(roots: set[int], table: dict[int, tuple[int, int]]) -> set[int]:
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    found, stack = set(), list(roots)
    while stack:
        for child in children.get(stack.pop(), ()):
            if child not in found:
                found.add(child)
                stack.append(child)
    return found


def reap(known: dict[int, int], *, exclude: int) -> list[int]:
    """SIGKILL every process of ``known`` (pid -> start time) still alive, and what they forked, until none is left.

    A pid whose start time changed is another process now (the pid was reused) and is left alone.
    Returns the pids killed.
    """
    killed: list[int] = []
    for _ in range(_REAP_ROUNDS):
        table = _process_table()
        alive = {pid for pid, start in known.items() if table.get(pid, (0, -1))[1] == start}
        targets = (alive | _descendants(alive, table)) - {exclude}
        if not targets:
            break
        for pid in targets:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
            known[pid] = table[pid][1]
            if pid not in killed:
                killed.append(pid)
        time.sleep(0.1)
    return killed


def watch(driver: int, *, poll_s: float = POLL_S) -> list[int]:
    """Note ``driver``'s descendants until the driver is gone (this process's parent changes); then reap them."""
    me = os.getpid()
    known: dict[int, int] = {}
    while os.getppid() == driver:
        table = _process_table()
        known = {pid: start for pid, start in known.items() if table.get(pid, (0, -1))[1] == start}
        known |= {pid: table[pid][1] for pid in _descendants({driver}, table) if pid != me}
        time.sleep(poll_s)
    return reap(known, exclude=me)


def start_watchdog() -> subprocess.Popen | None:
    """Start the watchdog of this process (the driver); None where there is no ``/proc``."""
    if not Path("/proc/self/stat").exists():
        logger.warning("no /proc: processes of this run are not watched (they may outlive a killed run)")
        return None
    return subprocess.Popen(
        [sys.executable, "-m", "tidal.train.watchdog", str(os.getpid())],
        stdin=subprocess.DEVNULL,
        start_new_session=True,  # a signal to the driver's process group must not reach the watchdog
    )


STOPPED_BY: list[str] = []
"""The signal that stopped the run (``stop_on_sigterm``): a KeyboardInterrupt re-raised on the way (Ray's ``get``
raises a bare one) loses its message, this keeps it."""


def stop_on_sigterm() -> None:
    """Make SIGTERM stop the run as Ctrl-C does (KeyboardInterrupt): every process is stopped before the exit.

    ``ray.init`` installs Ray's own handler (``sys.exit(SIGTERM)``): the cluster calls this again once Ray is up, so
    that a SIGTERM mid-run checkpoints the newest finished rollout as Ctrl-C does.
    """

    def interrupt(signum: int, _frame: object) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM ends the process at once
        STOPPED_BY.append(f"signal {signal.Signals(signum).name}")
        raise KeyboardInterrupt(STOPPED_BY[-1])

    signal.signal(signal.SIGTERM, interrupt)


def follow_launcher(poll_s: float = 1.0) -> None:
    """When started by ``uv run``, stop (SIGTERM to self) once uv is gone, as if uv had passed the signal on."""
    parent = os.getppid()
    try:
        name = Path(f"/proc/{parent}/comm").read_text().strip()
    except OSError:
        return
    if name not in _LAUNCHERS:
        return  # any other parent (a shell, nohup, a scheduler) may end before the run: that is not a stop

    def follow() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        logger.error("%s (pid %d), which started this run, is gone: stopping", name, parent)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=follow, name="follow-launcher", daemon=True).start()


def main(argv: list[str]) -> None:
    """``python -m tidal.train.watchdog DRIVER_PID``."""
    driver = int(argv[0])
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # only the driver's death ends the watch
    killed = watch(driver)
    if killed:
        with contextlib.suppress(OSError):  # the terminal may be gone with the driver
            sys.stderr.write(
                f"[tidal watchdog] driver {driver} is gone: killed {len(killed)} process(es) it left behind\n"
            )


if __name__ == "__main__":
    main(sys.argv[1:])
