"""Heartbeat against the session's real SGLang server, a real proxy that stops answering, and a dead engine."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from tidal.rollout import Heartbeat, SGLangClient, SGLangEngine


def _wait_for(condition, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_a_healthy_server_passes_its_heartbeats(sglang_server: SGLangEngine) -> None:
    failures: list[str] = []
    heartbeat = Heartbeat(sglang_server, interval_s=0.1, timeout_s=10.0, on_failure=failures.append)
    heartbeat.start()
    try:
        _wait_for(lambda: heartbeat.checks >= 2, 30.0)
    finally:
        heartbeat.stop()
    assert failures == [] and heartbeat.failures == 0


def test_a_server_that_stops_answering_fails_once_until_resumed(proxy) -> None:
    hung = SGLangClient(proxy(["stall"] * 10, stall_s=5.0).url)  # accepts connections, never answers
    reasons: list[str] = []
    failed = threading.Event()
    heartbeat = Heartbeat(hung, interval_s=0.1, timeout_s=0.5, on_failure=lambda r: (reasons.append(r), failed.set()))
    heartbeat.start()
    try:
        assert failed.wait(10.0)
        assert reasons == ["no healthy /health answer within 0.5 s"]
        checks = heartbeat.checks
        time.sleep(0.5)
        assert heartbeat.checks == checks  # paused after a failure: its owner is dealing with it
        failed.clear()
        heartbeat.resume()
        assert failed.wait(10.0) and heartbeat.failures == 2
    finally:
        heartbeat.stop()


def test_the_health_check_flags_set_the_heartbeat(proxy) -> None:
    """--rollout-health-check-interval is the beat (0: no heartbeat), --rollout-health-check-timeout how long a
    beat may go unanswered: a server that stops answering fails after it."""
    from tidal.rollout import RolloutConfig

    hung = SGLangClient(proxy(["stall"] * 10, stall_s=5.0).url)
    assert Heartbeat.from_config(RolloutConfig(rollout_health_check_interval=0), hung, on_failure=print) is None
    cfg = RolloutConfig(rollout_health_check_interval=0.2, rollout_health_check_timeout=0.3)
    reasons: list[str] = []
    failed = threading.Event()
    heartbeat = Heartbeat.from_config(cfg, hung, on_failure=lambda r: (reasons.append(r), failed.set()))
    assert (heartbeat.interval_s, heartbeat.timeout_s) == (0.2, 0.3)
    heartbeat.start()
    try:
        assert failed.wait(10.0)
        assert reasons == ["no healthy /health answer within 0.3 s"]
    finally:
        heartbeat.stop()


def test_a_launched_server_whose_process_is_gone_fails_at_once(tmp_path: Path, free_port) -> None:
    engine = SGLangEngine(tmp_path / "model", port=free_port(), log_dir=tmp_path)  # never started: no process
    with pytest.raises(ValueError, match="must be > 0"):
        Heartbeat(engine, interval_s=0, timeout_s=1.0, on_failure=print)
    assert Heartbeat(engine, interval_s=1.0, timeout_s=1.0, on_failure=print).check() == "its process exited"
