"""Engine, client and router built from RolloutConfig carry its flags (no server is started)."""

from __future__ import annotations

from pathlib import Path

from tidal.rollout import RolloutConfig, RolloutRouter, SGLangClient, SGLangEngine

CFG = RolloutConfig(
    sglang_host="localhost",
    sglang_server_args=("--mem-fraction-static", "0.7"),
    sglang_router_policy="round_robin",
    sglang_router_args=("--cache-threshold", "0.5"),
    sglang_startup_timeout_s=42.0,
    rollout_request_timeout_s=7.0,
    rollout_request_retries=2,
)


def test_engine_from_config(tmp_path: Path) -> None:
    engine = SGLangEngine.from_config(CFG, "/m", port=1234, nccl_port=1235, log_dir=tmp_path, env={"A": "1"})
    cmd = engine.command()
    assert cmd[cmd.index("--host") + 1] == "localhost" and cmd[cmd.index("--nccl-port") + 1] == "1235"
    assert cmd[-2:] == ["--mem-fraction-static", "0.7"]
    assert (engine.startup_timeout_s, engine.request_timeout_s, engine.max_retries) == (42.0, 7.0, 2)
    assert engine.env["A"] == "1"


def test_client_and_router_from_config(tmp_path: Path) -> None:
    client = SGLangClient.from_config(CFG, "http://10.0.0.5:30000")
    assert (client.url, client.request_timeout_s, client.max_retries) == ("http://10.0.0.5:30000", 7.0, 2)
    router = RolloutRouter.from_config(CFG, ["http://127.0.0.1:1"], port=2, log_dir=tmp_path)
    cmd = router.command()
    assert cmd[cmd.index("--policy") + 1] == "round_robin" and cmd[-2:] == ["--cache-threshold", "0.5"]
    assert (router.request_timeout_s, router.max_retries) == (7.0, 2)
