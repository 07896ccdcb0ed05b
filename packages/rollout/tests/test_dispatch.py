"""A server killed mid-rollout, or whose requests fail every retry, is restarted and no sample is lost."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
from tidal.rollout import RolloutError, SGLangEngine, generate_samples
from tidal.rollout.server_process import ManagedServer, process_group_alive

MAX_NEW = 40


def test_dead_engine_beyond_its_restarts_raises_with_port_and_log(tmp_path: Path, free_port) -> None:
    port = free_port()
    engine = SGLangEngine(tmp_path / "model", port=port, log_dir=tmp_path / "logs")  # never started: refused
    with pytest.raises(RolloutError, match=rf"SGLang server at http://127.0.0.1:{port} \(port {port}, ") as info:
        generate_samples(engine, [[3, 4]], {"max_new_tokens": 2}, max_restarts=0)
    message = str(info.value)
    assert "died during generation (POST " in message and "connection refused" in message
    assert "(--use-fault-tolerance restarts it)" in message
    assert message.endswith(f"its log: {engine.log_path}") and "\n" not in message


class _ProcessBehindProxy(ManagedServer):
    """A launched process that stays up, reached at the URL of a proxy in front of the real SGLang server."""

    kind = "test server"

    def command(self) -> list[str]:
        return [sys.executable, "-c", "import time; time.sleep(600)"]


def _behind(url: str, tmp_path: Path) -> ManagedServer:
    server = _ProcessBehindProxy(url, log_path=tmp_path / "server.log", startup_timeout_s=60, max_retries=1)
    server.retry_backoff_s = 0.05
    server.start(wait=False)
    return server


def test_a_running_server_that_fails_every_retry_is_restarted_or_named_with_its_log(proxy, tmp_path: Path) -> None:
    # Two resets use up the first request's retries (max_retries=1); the restart's first /health meets the
    # third; then the proxy relays and the resent request succeeds on the new process.
    server = _behind(proxy(["reset"] * 3).url, tmp_path)
    first_pid = server.pid
    try:
        params = {"n": 2, "max_new_tokens": 3, "ignore_eos": True}  # 3 tokens each, whatever the weights sample
        samples = generate_samples(server, [[3, 4]], params, max_restarts=1)
        assert len(samples) == 2 and all(len(s.response_ids) == 3 for s in samples)
        assert server.pid != first_pid and server.http_retries == 1
    finally:
        server.shutdown()
    server = _behind(proxy(["reset"] * 10).url, tmp_path)
    try:
        with pytest.raises(RolloutError) as info:
            generate_samples(server, [[3, 4]], {"max_new_tokens": 3}, max_restarts=0)
    finally:
        server.shutdown()
    message = str(info.value)
    assert "is running but stopped answering during generation (POST " in message
    assert "failed after 2 attempts: connection reset by peer" in message
    assert message.endswith(f"(--use-fault-tolerance restarts it); its log: {tmp_path / 'server.log'}")
    assert "\n" not in message


@pytest.mark.slow
def test_engine_killed_mid_rollout_is_restarted_and_no_sample_is_lost(
    sglang_server: SGLangEngine, tiny_model_dir: Path
) -> None:
    prompts = [[3, 4, 5], [6, 7], [8, 9, 10, 11], [12, 13]]
    params = {"n": 3, "max_new_tokens": MAX_NEW, "temperature": 1.0, "ignore_eos": True}
    sglang_server.update_weights_from_disk(tiny_model_dir, weight_version="before-kill")
    sglang_server.call("/slow_down", {"forward_sleep_time": 0.1})  # keep the requests in flight for seconds
    old_pid = sglang_server.pid
    box: dict = {"hook": []}

    def resync() -> None:  # what the app does: the current weights go in before any request is resent
        box["hook"].append(sglang_server.health_ok())
        time.sleep(3.0)  # a request resent now would finish all its tokens under "before-kill" (no slow-down)
        sglang_server.update_weights_from_disk(tiny_model_dir, weight_version="resynced")

    sglang_server.on_restart = resync

    def run() -> None:
        try:
            box["samples"] = generate_samples(sglang_server, prompts, params, progress_every_s=5.0)
        except BaseException as e:
            box["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout=2.0)
    assert thread.is_alive(), "generation finished before the kill; the slow-down did not take"
    os.killpg(old_pid, signal.SIGKILL)  # the whole server: launcher, scheduler, detokenizer
    try:
        thread.join(timeout=900.0)  # a restart takes 65-240 s on two shared cores
    finally:
        sglang_server.on_restart = None
    assert not thread.is_alive(), "generation did not come back after the restart"
    assert "error" not in box, box.get("error")
    samples = box["samples"]
    assert len(samples) == len(prompts) * 3
    assert [s.group_index for s in samples] == [g for g in range(len(prompts)) for _ in range(3)]
    for s in samples:
        assert s.finish_reason == "length" and len(s.response_ids) == MAX_NEW
        assert len(s.response_log_probs) == MAX_NEW
        # Every response was cut by the kill (40 tokens at 0.1 s each) and ended after on_restart put the weights
        # of version "resynced" in: nothing was resent before it returned.
        assert s.weight_version == "resynced"
        assert s.token_weight_versions[-1] == "resynced" and set(s.token_weight_versions) <= {"before-kill", "resynced"}
    assert box["hook"] == [True]  # called once, on the healthy restarted server
    assert sglang_server.is_running() and sglang_server.pid != old_pid
    assert not process_group_alive(old_pid)
