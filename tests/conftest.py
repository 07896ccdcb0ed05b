"""Session fixtures of the cross-package tests: SGLang servers on the embedded model, shared by the `train` runs.

Each `train` run that launches its own engine pays an SGLang start-up (~80 s on two cores); the runs that test
something other than the launch (resume, the debug modes) attach to the session's server instead, through
``--rollout-external-engine-addrs``, as a user with a separately deployed server would; a run with two engines
attaches to it and to a second one, started beside it.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _embedded_server(tmp_path_factory: pytest.TempPathFactory, name: str):
    """A real SGLang server on the embedded model (float32, as `train` would launch it), not started."""
    from tidal.rollout import SGLangEngine
    from tidal.train.embedded_model import ensure_embedded_model

    return SGLangEngine(
        ensure_embedded_model(),
        port=_free_port(),
        nccl_port=_free_port(),
        log_dir=tmp_path_factory.mktemp(name),
        extra_server_args=("--dtype", "float32"),
        startup_timeout_s=900,
    )


@pytest.fixture(scope="session")
def _external_servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list]:
    """Two servers, started at once: the second's start-up overlaps the first's wait.

    The --max-staleness run of test_train_modes_e2e.py broadcasts to both (each engine gets every pipeline stage's
    tensors), its rollout-only run and the run of test_train_router_e2e.py reach both through the router; every
    other run attaches to the first alone.
    """
    engines = [_embedded_server(tmp_path_factory, name) for name in ("external_sglang", "second_sglang")]
    try:
        for engine in engines:
            engine.start(wait=False)
        for engine in engines:
            engine.wait_healthy()
        yield engines
    finally:
        for engine, grace_s in zip(engines, (15.0, 2.0), strict=True):  # the second took 14.6 s of SIGTERM grace
            engine.shutdown(timeout_s=grace_s)


@pytest.fixture(scope="session")
def _external_engines(_external_servers: list) -> list[str]:
    return [f"127.0.0.1:{engine.port}" for engine in _external_servers]


@pytest.fixture(scope="session")
def external_engine_logs(_external_servers: list) -> dict[str, object]:
    """The server log (a Path) of ``external_engine`` and ``second_external_engine``, by ``HOST:PORT``."""
    return {f"127.0.0.1:{engine.port}": engine.log_path for engine in _external_servers}


@pytest.fixture(scope="session")
def external_engine(_external_engines: list[str]) -> str:
    """``HOST:PORT`` of the session's SGLang server on the embedded model."""
    return _external_engines[0]


@pytest.fixture(scope="session")
def second_external_engine(_external_engines: list[str]) -> str:
    """``HOST:PORT`` of a second server like ``external_engine``, for runs with two engines."""
    return _external_engines[1]


SFT_ROWS = 192
"""Rows of the shipped addition task the SFT stage's run trains on (6 steps of 32 per epoch)."""


@pytest.fixture(scope="session")
def sft_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str], str]:
    """`train --stage sft` on the embedded model: 2 epochs over 192 addition rows, evaluated on 64 of them.

    ``(run folder, its arguments, its output)``. Its --save-hf folder is the --hf-checkpoint of the --debug-train-only
    run of test_train_modes_e2e.py (an RL run starting from the SFT stage's weights), so the RL side costs no run.
    """
    import subprocess
    import sys

    from tidal.train.task_data import TRAIN_FILE, shipped_path

    root = tmp_path_factory.mktemp("sft")
    rows = shipped_path(TRAIN_FILE).read_text().splitlines()[:SFT_ROWS]
    (root / "train.jsonl").write_text("\n".join(rows) + "\n")
    (root / "held_out.jsonl").write_text("\n".join(rows[:64]) + "\n")  # the NLL of training rows: it must drop
    out = root / "run"
    args = ["--stage", "sft", "--sft-data", str(root / "train.jsonl"), "--sft-eval-data", str(root / "held_out.jsonl"),
            "--global-batch-size", "32", "--num-epoch", "2", "--lr", "1e-3", "--eval-interval", "6",
            "--save-interval", "4", "--save-hf", str(out / "hf")]  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-m", "tidal.train.cli", *args, "--output-dir", str(out)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    return out, args, proc.stdout + proc.stderr
