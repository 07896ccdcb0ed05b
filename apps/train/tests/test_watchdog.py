"""The watchdog kills what a driver left behind, whatever ended it; SIGTERM and a killed `uv` stop a run cleanly.

Real processes, no Ray: a stand-in driver starts the watchdog, then a tree shaped like a run's (a server in its
own session, a grandchild, a process that ignores SIGTERM), and is killed.
"""

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="the watchdog needs /proc")

DRIVER = textwrap.dedent(
    """
    import os, subprocess, sys, time
    from tidal.train.watchdog import start_watchdog

    start_watchdog()
    stubborn = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(300)"
    server = subprocess.Popen([sys.executable, "-c", stubborn], start_new_session=True)  # own session, as SGLang
    tree = subprocess.Popen(["sh", "-c", "sleep 300 & sleep 300 & wait"])  # grandchildren
    time.sleep(1.5)  # the watchdog has seen them (it looks every 0.5 s)
    pids = [server.pid, tree.pid] + [int(p) for p in open(f"/proc/{tree.pid}/task/{tree.pid}/children").read().split()]
    print(" ".join(map(str, pids)), flush=True)
    if sys.argv[1] == "exit":
        os._exit(0)  # a driver that returns without stopping what it started
    time.sleep(300)
    """
)


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(map(_alive, pids)):
        time.sleep(0.1)
    return [p for p in pids if _alive(p)]


@pytest.mark.parametrize("ending", ["SIGKILL", "exit"])
def test_nothing_the_driver_started_outlives_it(ending):
    driver = subprocess.Popen([sys.executable, "-c", DRIVER, ending], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in driver.stdout.readline().split()]
        assert len(pids) == 4 and all(map(_alive, pids))
        if ending == "SIGKILL":
            driver.kill()
        driver.wait(timeout=30)
        left = _wait_gone(pids, timeout_s=10)
        assert not left, f"still alive after {ending}: {left}"
    finally:
        driver.kill()
        for pid in pids if "pids" in locals() else []:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


STOPPABLE = textwrap.dedent(
    """
    import sys, time
    from tidal.train.watchdog import follow_launcher, stop_on_sigterm

    stop_on_sigterm()
    follow_launcher(poll_s=0.1)
    try:
        print("ready", flush=True)
        time.sleep(60)
    except KeyboardInterrupt as e:
        print(f"stopped cleanly: {e}", flush=True)
    """
)


def test_sigterm_stops_the_driver_like_ctrl_c():
    proc = subprocess.Popen([sys.executable, "-c", STOPPABLE], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "ready\n"
    proc.terminate()
    assert proc.stdout.readline() == "stopped cleanly: signal SIGTERM\n"
    assert proc.wait(timeout=30) == 0


def test_a_run_started_by_uv_stops_when_uv_is_killed(tmp_path):
    # uv passes SIGINT/SIGTERM on to `train`, but SIGKILL cannot be passed on: its child would run on, orphaned.
    fake_uv = tmp_path / "uv"  # the process name is what follow_launcher looks at
    shutil.copy("/bin/sh", fake_uv)
    script = tmp_path / "driver.py"
    script.write_text(STOPPABLE)
    out = tmp_path / "out.txt"
    uv = subprocess.Popen([str(fake_uv), "-c", f'"{sys.executable}" "{script}" > "{out}"; exit 0'])
    deadline = time.monotonic() + 60
    while "ready" not in (out.read_text() if out.exists() else "") and time.monotonic() < deadline:
        time.sleep(0.1)
    uv.kill()
    uv.wait()
    while "stopped" not in out.read_text() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert out.read_text() == "ready\nstopped cleanly: signal SIGTERM\n"
