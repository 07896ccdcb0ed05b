"""--use-wandb with the real W&B client: offline runs read back from their files, online runs up to the server.

No test reaches the internet: W&B's server is a closed loopback port, its error reports are off, and its config and
cache folders are the test's own.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from tidal.train.cli import parse_job
from tidal.train.metrics import MetricsLog
from tidal.train.wandb_run import WandbStartError, wandb_options

CLOSED = "http://127.0.0.1:9"  # the discard port: nothing listens there


@pytest.fixture
def wandb_env(tmp_path, monkeypatch):
    """W&B's settings for a test: its own folders, no key, no error reports, its default server a closed port."""
    for name in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_DIR", "WANDB_PROJECT", "WANDB_RUN_GROUP"):
        monkeypatch.delenv(name, raising=False)
    home = tmp_path / "wandb_home"
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(home / "config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(home / "cache"))
    monkeypatch.setenv("WANDB_DATA_DIR", str(home / "data"))
    monkeypatch.setenv("WANDB_ERROR_REPORTING", "false")
    monkeypatch.setenv("WANDB_BASE_URL", CLOSED)
    monkeypatch.setenv("NETRC", str(home / "netrc"))  # no stored key either
    import wandb

    wandb.teardown()  # W&B reads its environment once per process: from here, this test's
    yield home
    wandb.teardown()


def wandb_records(run_dir: Path) -> list[dict]:
    """The records of a W&B run's transaction log, as the W&B client itself reads them (``wandb leet inspect``)."""
    wandb_cli = Path(sys.executable).parent / "wandb"
    proc = subprocess.run(
        [str(wandb_cli), "leet", "inspect", "--json", str(run_dir)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    return [json.loads(line) for line in proc.stdout.splitlines()]


def _options(tmp_path: Path, *flags: str) -> dict:
    out = tmp_path / "run"
    return wandb_options(parse_job(["--output-dir", str(out), "--use-wandb", *flags]), out)


def test_offline_run_holds_every_rollouts_metrics_and_says_where_it_is(tmp_path, wandb_env):
    options = _options(tmp_path, "--wandb-mode", "offline", "--wandb-project", "proj", "--wandb-group", "grp")
    records = [{"rollout": i, "rollout/reward/mean": i / 4, "train/loss": -i / 8, "note": "text"} for i in range(3)]
    with MetricsLog(tmp_path / "run" / "metrics.jsonl", wandb=options) as log:
        for record in records:
            log.write(record)
    where = log.wandb_run
    assert where["mode"] == "offline" and where["url"] is None
    assert (where["project"], where["group"]) == ("proj", "grp")
    run_dir = Path(where["dir"])
    assert run_dir.parent == tmp_path / "run" / "wandb" and run_dir.name.endswith(where["id"])
    logged = wandb_records(run_dir)
    history = [r["history"] for r in logged if r["type"] == "history"]
    assert [h["step"]["num"] for h in history] == [0, 1, 2]
    for h, record in zip(history, records, strict=True):
        assert h["item"]["rollout/reward/mean"] == record["rollout/reward/mean"]
        assert h["item"]["train/loss"] == record["train/loss"]
        assert "note" not in h["item"] and "rollout" not in h["item"]
    (run,) = [r["run"] for r in logged if r["type"] == "run"]
    assert (run["project"], run["run_group"], run["run_id"]) == ("proj", "grp", where["id"])
    assert run["config"]["update"]["logging"]["wandb_group"] == "grp"  # the job's options travel with the run


def test_disabled_logs_nothing_to_wandb(tmp_path, wandb_env):
    options = _options(tmp_path, "--wandb-mode", "disabled")
    with MetricsLog(tmp_path / "run" / "metrics.jsonl", wandb=options) as log:
        log.write({"rollout": 0, "rollout/reward/mean": 0.5})
    assert log.wandb_run == {"mode": "disabled", "project": "tidal", "group": None}
    assert not (tmp_path / "run" / "wandb").exists()
    assert log.read() == [{"rollout": 0, "rollout/reward/mean": 0.5}]


def test_online_without_a_key_is_one_line_naming_the_ways_on(tmp_path, wandb_env):
    options = _options(tmp_path, "--wandb-mode", "online", "--wandb-host", CLOSED)
    with pytest.raises(WandbStartError) as info:
        MetricsLog(tmp_path / "run" / "metrics.jsonl", wandb=options)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"--use-wandb: W&B did not start an online run at {CLOSED} (")
    assert "API key" in message and "WANDB_API_KEY" in message and "--wandb-mode offline" in message


def test_online_goes_to_the_wandb_host_given(tmp_path, wandb_env, monkeypatch):
    # A key of the right form and a host where nothing listens: the client tries that host (and only it), then fails.
    monkeypatch.setenv("WANDB_API_KEY", "0" * 86)
    monkeypatch.setenv("WANDB_INIT_TIMEOUT", "5")
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:7")  # --wandb-host must win over the environment
    options = _options(tmp_path, "--wandb-mode", "online", "--wandb-host", CLOSED)
    with pytest.raises(WandbStartError) as info:
        MetricsLog(tmp_path / "run" / "metrics.jsonl", wandb=options)
    message = str(info.value)
    assert "127.0.0.1:9/graphql" in message and "127.0.0.1:7" not in message, message
    assert "0" * 86 not in message  # the key is never repeated


@pytest.mark.parametrize("flag", [["--wandb-key", "s3cr3t"], ["--wandb-key=s3cr3t"]])
def test_a_key_flag_is_refused_without_repeating_the_key(flag):
    with pytest.raises(ValueError) as info:
        parse_job(["--use-wandb", *flag])
    message = str(info.value)
    assert "--wandb-key is not taken" in message and "WANDB_API_KEY" in message
    assert "s3cr3t" not in message
