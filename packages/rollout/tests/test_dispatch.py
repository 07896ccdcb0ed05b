"""A server killed mid-rollout is restarted and the rollout completes without losing a sample."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import pytest
from tidal.rollout import RolloutError, SGLangEngine, generate_samples
from tidal.rollout.server_process import process_group_alive

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


@pytest.mark.slow
def test_engine_killed_mid_rollout_is_restarted_and_no_sample_is_lost(
    sglang_server: SGLangEngine, tiny_model_dir: Path
) -> None:
    prompts = [[3, 4, 5], [6, 7], [8, 9, 10, 11], [12, 13]]
    params = {"n": 3, "max_new_tokens": MAX_NEW, "temperature": 1.0, "ignore_eos": True}
    sglang_server.update_weights_from_disk(tiny_model_dir, weight_version="before-kill")
    sglang_server.call("/slow_down", {"forward_sleep_time": 0.1})  # keep the requests in flight for seconds
    old_pid = sglang_server.pid
    box: dict = {}

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
    thread.join(timeout=900.0)  # a restart takes 65-240 s on two shared cores
    assert not thread.is_alive(), "generation did not come back after the restart"
    assert "error" not in box, box.get("error")
    samples = box["samples"]
    assert len(samples) == len(prompts) * 3
    assert [s.group_index for s in samples] == [g for g in range(len(prompts)) for _ in range(3)]
    for s in samples:
        assert s.finish_reason == "length" and len(s.response_ids) == MAX_NEW
        assert len(s.response_log_probs) == MAX_NEW
        assert s.weight_version == "before-kill"  # restart() reloaded the last weights from disk
    assert sglang_server.is_running() and sglang_server.pid != old_pid
    assert not process_group_alive(old_pid)
