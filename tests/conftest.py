"""Session fixtures of the cross-package tests: SGLang servers on the embedded model, shared by the `train` runs.

Each `train` run that launches its own engine pays an SGLang start-up (~80 s on two cores); the runs that test
something other than the launch (resume, the debug modes) attach to the session's server instead, through
``--rollout-external-engine-addrs``, as a user with a separately deployed server would; a run with two engines
attaches to it and to a second one, started beside it.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator

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
