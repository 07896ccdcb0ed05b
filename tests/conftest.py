"""Session fixtures of the cross-package tests: one SGLang server on the embedded model, shared by the `train` runs.

Each `train` run that launches its own engine pays an SGLang start-up (~80 s on two cores); the runs that test
something other than the launch (resume, the debug modes) attach to this one server instead, through
``--rollout-external-engine-addrs``, as a user with a separately deployed server would.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _embedded_server(tmp_path_factory: pytest.TempPathFactory, name: str, *, grace_s: float = 15.0) -> Iterator[str]:
    """A real SGLang server on the embedded model (float32, as `train` would launch it); ``HOST:PORT``.

    Stopped with SIGTERM, then SIGKILL after ``grace_s`` (a server of the tests has nothing to save).
    """
    from tidal.rollout import SGLangEngine
    from tidal.train.embedded_model import ensure_embedded_model

    model = ensure_embedded_model()
    port = _free_port()
    engine = SGLangEngine(
        model,
        port=port,
        nccl_port=_free_port(),
        log_dir=tmp_path_factory.mktemp(name),
        extra_server_args=("--dtype", "float32"),
        startup_timeout_s=900,
    )
    engine.start(wait=True)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        engine.shutdown(timeout_s=grace_s)


@pytest.fixture(scope="session")
def external_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``HOST:PORT`` of the session's SGLang server on the embedded model."""
    yield from _embedded_server(tmp_path_factory, "external_sglang")


@pytest.fixture(scope="module")
def second_external_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A second server like ``external_engine``, for a module's runs with two engines (one more start-up, ~40 s)."""
    yield from _embedded_server(tmp_path_factory, "second_sglang", grace_s=2.0)  # 15 s took 14.6 s at the end
