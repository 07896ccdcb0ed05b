"""sglang-router in front of the session's real SGLang server: generation, cache flush, abort, shutdown."""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from tidal.rollout import (
    RolloutConfig,
    SGLangEngine,
    generate_samples,
    sglang_router_args,
    sglang_server_args,
)
from tidal.rollout.router import RolloutRouter
from tidal.rollout.server_process import process_group_alive

PROMPTS = [[3, 4, 5], [6, 7], [8, 9, 10, 11]]
GREEDY = {"n": 2, "max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def router(_sglang_engine: SGLangEngine, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RolloutRouter]:
    if not _sglang_engine.is_running():
        _sglang_engine.start()
    router = RolloutRouter(
        [_sglang_engine.url],
        port=_free_port(),
        log_dir=tmp_path_factory.mktemp("router_logs"),
        policy="cache_aware",
        startup_timeout_s=300,
    )
    router.start()
    yield router
    router.shutdown()


def test_generation_through_the_router_matches_the_engine(
    router: RolloutRouter, sglang_server: SGLangEngine, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="tidal.rollout.progress")
    direct = generate_samples(sglang_server, PROMPTS, GREEDY)
    routed = generate_samples(router, PROMPTS, GREEDY)
    by_url = generate_samples(router.url, PROMPTS, GREEDY)  # a router started elsewhere: just its URL
    for samples in (routed, by_url):
        assert [s.group_index for s in samples] == [0, 0, 1, 1, 2, 2]
        assert [list(s.response_ids) for s in samples] == [list(s.response_ids) for s in direct]
        for a, b in zip(samples, direct, strict=True):
            assert a.response_log_probs == pytest.approx(b.response_log_probs, abs=1e-4)
    assert any("generate: 6/6 samples (100%)" in r.getMessage() for r in caplog.records)
    (worker,) = router.workers()
    assert worker["url"] == sglang_server.url and worker["is_healthy"]
    assert router.get_model_info()["model_path"] == sglang_server.model_path


FLUSHED = "Cache flushed successfully!"  # what SGLang's scheduler logs for each /flush_cache it runs


def test_router_fans_out_flush_and_abort(router: RolloutRouter, sglang_server: SGLangEngine, slowed_generation) -> None:
    flushes = sglang_server.log_path.read_text().count(FLUSHED)
    router.flush_cache()  # forwarded to every engine by the router itself
    deadline = time.monotonic() + 30
    while sglang_server.log_path.read_text().count(FLUSHED) == flushes and time.monotonic() < deadline:
        time.sleep(0.1)
    assert sglang_server.log_path.read_text().count(FLUSHED) == flushes + 1
    # The router answers 404 to /abort_request: RolloutRouter calls each engine, which cuts its in-flight requests.
    params = {"n": 2, "max_new_tokens": 200, "temperature": 1.0, "ignore_eos": True}
    with slowed_generation(sglang_server, lambda: generate_samples(router, PROMPTS[:2], params)) as (thread, box):
        router.abort()
        thread.join(timeout=60.0)
    assert not thread.is_alive() and "error" not in box
    assert [s.finish_reason for s in box["result"]] == ["abort"] * 4
    assert all(len(s.response_ids) < 200 for s in box["result"])


def test_router_flags_split_from_server_flags() -> None:
    flags = ["--sglang-mem-fraction-static", "0.7", "--sglang-router-cache-threshold", "0.5", "--sglang-enable-metrics"]
    assert sglang_server_args(flags) == ("--mem-fraction-static", "0.7", "--enable-metrics")
    assert sglang_router_args(flags) == ("--cache-threshold", "0.5")
    cfg = RolloutConfig()
    assert not cfg.router_wanted(1) and cfg.router_wanted(2)
    assert RolloutConfig(use_router=True).router_wanted(1)
    with pytest.raises(ValueError, match="--sglang-router-policy must be one of"):
        RolloutConfig(sglang_router_policy="fastest")


def test_router_command_and_checks(tmp_path: Path) -> None:
    router = RolloutRouter(
        ["http://127.0.0.1:1/"], port=2, log_dir=tmp_path, extra_router_args=["--cache-threshold", "0.5"]
    )
    cmd = router.command()
    assert cmd[1:3] == ["-m", "tidal.rollout.router_launcher"]
    assert cmd[cmd.index("--worker-urls") + 1] == "http://127.0.0.1:1"
    assert cmd[cmd.index("--policy") + 1] == "cache_aware" and cmd[-2:] == ["--cache-threshold", "0.5"]
    with pytest.raises(ValueError, match="set --sglang-api-key"):
        RolloutRouter(["http://127.0.0.1:1"], host="0.0.0.0", port=2, log_dir=tmp_path)
    with pytest.raises(ValueError, match="at least one engine"):
        RolloutRouter([], port=2, log_dir=tmp_path)


def test_router_shutdown_leaves_no_process(router: RolloutRouter, sglang_server: SGLangEngine) -> None:
    pgid = router.pid
    assert pgid is not None and router.health_ok()
    router.shutdown()
    assert not process_group_alive(pgid)
    assert not router.health_ok() and sglang_server.health_ok()  # the engines are not the router's to stop
