"""A server process dies with the process that launched it, whatever kills that one (SIGKILL included)."""

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")

OWNER = textwrap.dedent(
    """
    import subprocess, time
    from concurrent.futures import ThreadPoolExecutor
    from tidal.rollout.server_process import spawn_owned

    # Launched from a short-lived pool thread, as a restart under --use-fault-tolerance is: the parent-death
    # signal must not fire when that thread ends, only when this process does.
    with ThreadPoolExecutor(1) as pool:
        server = pool.submit(spawn_owned, ["sleep", "300"], start_new_session=True).result()
    time.sleep(1.0)
    print(server.pid, server.poll(), flush=True)
    time.sleep(300)
    """
)


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def test_a_server_outlives_the_thread_that_launched_it_but_not_its_owner():
    owner = subprocess.Popen([sys.executable, "-c", OWNER], stdout=subprocess.PIPE, text=True)
    try:
        pid, code = owner.stdout.readline().split()
        assert code == "None", "the server died with the pool thread that launched it"
        owner.kill()
        owner.wait(timeout=30)
        deadline = time.monotonic() + 10
        while _alive(int(pid)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(int(pid)), "the server outlived its SIGKILLed owner"
    finally:
        owner.kill()
