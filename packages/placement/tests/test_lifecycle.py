import json
import signal
import time
from pathlib import Path

import pytest
from tidal.placement import PlacementConfig
from tidal.placement.lifecycle import runtime_env, uv_run_propagation


def _processes_of(session):
    """Command lines of live (non-zombie) processes that name the Ray session."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().decode(errors="replace")
            status = (proc / "status").read_text()
        except OSError:
            continue
        if session in cmdline and "State:\tZ" not in status:
            found.append(cmdline)
    return found


def test_runtime_env_carries_ray_env():
    assert runtime_env(PlacementConfig(ray_env={"A": "1"})) == {"env_vars": {"A": "1"}}
    assert runtime_env(PlacementConfig()) == {}


def test_ray_ships_the_uv_environment_only_with_the_flag(monkeypatch):
    """--ray-propagate-uv-env: the switch Ray's init reads to `uv run` every worker is off inside start_ray's
    ray.init unless the flag is given (and Ray's own environment variable leaves it on); restored after."""
    from ray._private import ray_constants

    monkeypatch.setattr(ray_constants, "RAY_ENABLE_UV_RUN_RUNTIME_ENV", True)
    for flag in (False, True):
        with uv_run_propagation(PlacementConfig(ray_propagate_uv_env=flag)):
            assert ray_constants.RAY_ENABLE_UV_RUN_RUNTIME_ENV is flag
        assert ray_constants.RAY_ENABLE_UV_RUN_RUNTIME_ENV is True
    monkeypatch.setattr(ray_constants, "RAY_ENABLE_UV_RUN_RUNTIME_ENV", False)  # RAY_ENABLE_UV_RUN_RUNTIME_ENV=0
    with uv_run_propagation(PlacementConfig(ray_propagate_uv_env=True)):
        assert ray_constants.RAY_ENABLE_UV_RUN_RUNTIME_ENV is False


@pytest.mark.slow
def test_local_ray_starts_places_and_leaves_no_process_after_ctrl_c(ray_cluster, local_ray_driver):
    proc = local_ray_driver
    line = proc.stdout.readline()  # the driver's own waits are bounded; the fixture kills it if this test fails
    assert line, Path(proc.stderr_path).read_text()[-3000:]
    info = json.loads(line)
    assert info["gpus"] == 2 and info["bundles"] == [0, 1]
    running = _processes_of(info["session"])
    assert any("gcs_server" in c for c in running) and any("raylet" in c for c in running), running
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=60) != 0
    deadline = time.monotonic() + 30
    while (left := _processes_of(info["session"])) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, f"processes of {info['session']} still alive: {[c[:200] for c in left]}"
