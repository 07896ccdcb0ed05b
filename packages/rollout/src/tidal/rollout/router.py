"""sglang-router in front of several engines: one URL for generation, cache-aware request placement.

With several engines, requests go through the real ``sglang_router`` (its Rust router, run by
``python -m tidal.rollout.router_launcher``: ``launch_router``'s arguments without its 50 s import). Its
``cache_aware`` policy sends a request to the engine whose radix cache already holds the longest prefix of
it, and balances load when engines drift apart. It forwards
``/generate``, ``/health``, ``/get_model_info`` and fans out ``/flush_cache``; it does NOT forward
``/abort_request`` or weight updates (404), so :meth:`RolloutRouter.abort` calls every engine itself and
weight updates go to each engine directly. With one engine, talk to it directly (no router process).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import requests
from tidal.rollout.client import SGLangClient
from tidal.rollout.config import ROUTER_POLICIES
from tidal.rollout.server_process import ManagedServer
from tidal.rollout.transport import DEFAULT_RETRIES

if TYPE_CHECKING:
    from tidal.rollout.config import RolloutConfig

logger = logging.getLogger(__name__)


class RolloutRouter(ManagedServer):
    """An sglang-router process over ``engine_urls``; generate through it like through one engine."""

    kind = "sglang-router"

    def __init__(
        self,
        engine_urls: Sequence[str],
        *,
        host: str = "127.0.0.1",
        port: int,
        log_dir: str | os.PathLike[str],
        policy: str = "cache_aware",
        extra_router_args: Sequence[str] = (),
        startup_timeout_s: float = 300.0,
        request_timeout_s: float = 600.0,
        api_key: str | None = None,
        max_retries: int = DEFAULT_RETRIES,
    ) -> None:
        """Describe the router; nothing starts until :meth:`start`.

        Args:
            engine_urls: Base URLs of the running engines (``SGLangEngine.url``).
            host: Address to listen on.
            port: HTTP port of the router.
            log_dir: Directory for the router log.
            policy: ``cache_aware`` (default), ``round_robin``, ``random`` or ``power_of_two``.
            extra_router_args: More ``sglang_router.launch_router`` arguments (``--sglang-router-*`` flags
                mapped by :func:`tidal.rollout.pass_through.sglang_router_args`), passed through verbatim.
            startup_timeout_s: Longest wait for a healthy ``/health``.
            request_timeout_s: Timeout of one HTTP request.
            api_key: Key the engines demand; the router forwards it and every request carries it.
            max_retries: Times a request is sent again after a transient failure (5xx included) while the
                router process lives.

        Raises:
            ValueError: No engine, a bad policy or port.
        """
        if not engine_urls:
            raise ValueError("a router needs at least one engine URL")
        if policy not in ROUTER_POLICIES:
            raise ValueError(f"--sglang-router-policy must be one of {list(ROUTER_POLICIES)}, got {policy!r}")
        if port <= 0 or port > 65535:
            raise ValueError(f"router port must be in 1..65535, got {port}")
        if host not in ("127.0.0.1", "localhost", "::1") and not api_key:
            raise ValueError(
                f"router host {host!r} is reachable from other machines and would forward any request; "
                "set --sglang-api-key (or keep the default host 127.0.0.1)"
            )
        super().__init__(
            f"http://{host}:{port}",
            log_path=Path(log_dir) / f"router_{host}_{port}.log",
            startup_timeout_s=startup_timeout_s,
            request_timeout_s=request_timeout_s,
            api_key=api_key,
            max_retries=max_retries,
        )
        self.engine_urls = [url.rstrip("/") for url in engine_urls]
        self.host = host
        self.port = port
        self.policy = policy
        self.extra_router_args = tuple(extra_router_args)
        self._engines = [
            SGLangClient(url, api_key=api_key, request_timeout_s=request_timeout_s, max_retries=max_retries)
            for url in self.engine_urls
        ]

    @classmethod
    def from_config(
        cls, cfg: RolloutConfig, engine_urls: Sequence[str], *, port: int, log_dir: str | os.PathLike[str]
    ) -> RolloutRouter:
        """A router over ``engine_urls`` as ``cfg`` describes it: policy, ``--sglang-router-*`` flags, timeouts.

        The port and log folder are the caller's placement; nothing starts until :meth:`start`.
        """
        return cls(
            engine_urls,
            port=port,
            log_dir=log_dir,
            policy=cfg.sglang_router_policy,
            extra_router_args=cfg.sglang_router_args,
            request_timeout_s=cfg.rollout_request_timeout_s,
            max_retries=cfg.rollout_request_retries,
            api_key=cfg.sglang_api_key,
        )

    def command(self) -> list[str]:
        """The router command line."""
        cmd = [sys.executable, "-m", "tidal.rollout.router_launcher", "--host", self.host, "--port", str(self.port)]
        cmd += ["--worker-urls", *self.engine_urls, "--policy", self.policy]
        if self._api_key:
            cmd += ["--api-key", self._api_key]
        return cmd + list(self.extra_router_args)

    def health_ok(self, timeout_s: float = 5.0) -> bool:
        """Whether the router answers ``/health`` AND lists every engine as healthy.

        The router answers ``/health`` a moment before it has registered its engines (that runs in the
        background), and a ``/generate`` sent then fails with 503 "no_available_workers".
        """
        if not super().health_ok(timeout_s):
            return False
        try:
            healthy = {w["url"].rstrip("/") for w in self.workers() if w.get("is_healthy")}
        except (requests.RequestException, ValueError, KeyError):
            return False
        return healthy >= set(self.engine_urls)

    def workers(self) -> list[dict]:
        """The router's view of its engines (``/workers``: url, health, load)."""
        response = self._session.get(f"{self.url}/workers", timeout=self.request_timeout_s)
        response.raise_for_status()
        return response.json()["workers"]

    @property
    def http_retries(self) -> int:
        """Retries of requests to the router and (aborts) to its engines."""
        return super().http_retries + sum(engine.http_retries for engine in self._engines)

    def abort(self, rid: str | None = None) -> None:
        """Abort in-flight requests on every engine (the router does not forward ``/abort_request``)."""
        for engine in self._engines:
            engine.abort(rid)
