"""HTTP transport of the SGLang clients: idle connections dropped before the server's keep-alive; transient failures.

This module also says which failures of one request are transient (worth sending again) and when sending
again is safe. SGLang's HTTP server (uvicorn) closes a keep-alive connection ``SGLANG_TIMEOUT_KEEP_ALIVE`` seconds (5 by
default) after its last answer. urllib3 checks that a pooled connection is still open before reusing it, but
a request written in the instant between that check and the server's close is answered by a reset ("Connection
reset by peer", "Remote end closed connection without response"). :class:`IdleBoundedAdapter` closes a pooled
connection that has been idle for ``max_idle_s`` (below the server's keep-alive) instead of reusing it, so the
race cannot happen; the clients' retries cover what is left (a restart, a proxy, a slow answer).
"""

from __future__ import annotations

import time
from typing import Any, ClassVar

import requests
from requests.adapters import HTTPAdapter
from urllib3.connectionpool import HTTPConnectionPool, HTTPSConnectionPool
from urllib3.exceptions import ConnectTimeoutError, MaxRetryError, NewConnectionError
from urllib3.poolmanager import PoolManager

# SGLang's default keep-alive (SGLANG_TIMEOUT_KEEP_ALIVE, sglang/srt/environ.py in 0.5.23).
SGLANG_DEFAULT_KEEP_ALIVE_S = 5
# A client of a server whose keep-alive it does not know drops idle connections at half of SGLang's default.
DEFAULT_MAX_IDLE_S = SGLANG_DEFAULT_KEEP_ALIVE_S / 2
DEFAULT_RETRIES = 5
DEFAULT_BACKOFF_S = 0.5
MAX_BACKOFF_S = 8.0
# Control endpoints that may be sent twice with the same effect as once. /generate is not listed: sending it
# again samples again, which is what a retry wants (the lost answer never reached anyone).
IDEMPOTENT_ENDPOINTS = frozenset(
    {
        "/generate",
        "/health",
        "/health_generate",
        "/get_model_info",
        "/get_server_info",
        "/flush_cache",
        "/update_weights_from_disk",
        "/abort_request",
        "/workers",
    }
)


class _IdleBoundedPoolMixin:
    """Stamps each connection as it goes back to the pool; closes one idle too long instead of reusing it."""

    max_idle_s: float | None = None

    def _get_conn(self, timeout: float | None = None) -> Any:
        conn = super()._get_conn(timeout)  # type: ignore[misc]
        since = getattr(conn, "tidal_idle_since", None)
        if self.max_idle_s is not None and since is not None and time.monotonic() - since > self.max_idle_s:
            conn.close()  # reconnects on use: the server may close it at any instant now
        return conn

    def _put_conn(self, conn: Any) -> None:
        if conn is not None:
            conn.tidal_idle_since = time.monotonic()
        super()._put_conn(conn)  # type: ignore[misc]


class _IdleBoundedHTTPPool(_IdleBoundedPoolMixin, HTTPConnectionPool):
    pass


class _IdleBoundedHTTPSPool(_IdleBoundedPoolMixin, HTTPSConnectionPool):
    pass


class _IdleBoundedPoolManager(PoolManager):
    def __init__(self, *args: Any, max_idle_s: float | None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.max_idle_s = max_idle_s
        self.pool_classes_by_scheme = {"http": _IdleBoundedHTTPPool, "https": _IdleBoundedHTTPSPool}

    def _new_pool(self, scheme: str, host: str, port: int, request_context: dict | None = None) -> Any:
        pool = super()._new_pool(scheme, host, port, request_context)
        pool.max_idle_s = self.max_idle_s
        return pool


class IdleBoundedAdapter(HTTPAdapter):
    """A requests adapter whose pooled connections are closed, not reused, once idle longer than ``max_idle_s``."""

    __attrs__: ClassVar[list[str]] = [
        *HTTPAdapter.__attrs__,
        "max_idle_s",
    ]  # pickled with the adapter (requests re-inits the pools)

    def __init__(self, *, max_idle_s: float | None, pool_maxsize: int) -> None:
        """``max_idle_s`` None: reuse idle connections however old (requests' own behaviour)."""
        self.max_idle_s = max_idle_s
        super().__init__(pool_connections=4, pool_maxsize=pool_maxsize)

    def init_poolmanager(self, connections: int, maxsize: int, block: bool = False, **pool_kwargs: Any) -> None:
        """Build the pool manager (requests' hook), with idle-bounded pools."""
        self._pool_connections, self._pool_maxsize, self._pool_block = connections, maxsize, block
        self.poolmanager = _IdleBoundedPoolManager(
            num_pools=connections, maxsize=maxsize, block=block, max_idle_s=self.max_idle_s, **pool_kwargs
        )


def _root_cause(error: BaseException) -> BaseException:
    """The urllib3/socket error under a requests exception (``MaxRetryError.reason``, else the exception)."""
    inner = error.args[0] if error.args else None
    if isinstance(inner, MaxRetryError) and inner.reason is not None:
        return inner.reason
    return inner if isinstance(inner, BaseException) else error


def never_sent(error: requests.RequestException) -> bool:
    """Whether the request failed before any byte of it left (refused or timed-out connect): always safe to resend."""
    return isinstance(error, requests.ConnectTimeout) or isinstance(
        _root_cause(error), NewConnectionError | ConnectTimeoutError
    )


def is_transient(error: requests.RequestException) -> bool:
    """Refused, reset, cut mid-answer or timed out: the same request may well succeed if sent again."""
    return isinstance(error, requests.ConnectionError | requests.Timeout | requests.exceptions.ChunkedEncodingError)


def describe_failure(error: requests.RequestException, timeout_s: float) -> str:
    """One short line for a failed request, e.g. ``connection refused``, ``read timed out after 600 s``."""
    if isinstance(error, requests.ReadTimeout):
        return f"no answer within {timeout_s:g} s (read timeout)"
    if isinstance(error, requests.ConnectTimeout):
        return "connect timed out"
    cause = _root_cause(error)
    for inner in (cause, getattr(cause, "__context__", None), *getattr(cause, "args", ())):
        if isinstance(inner, ConnectionRefusedError):
            return "connection refused"
        if isinstance(inner, ConnectionResetError):
            return "connection reset by peer"
    text = str(cause)
    if isinstance(cause, NewConnectionError) and "refused" in text.lower():
        return "connection refused"
    return f"{type(cause).__name__}: {text}"[:300]


def backoff_s(attempt: int, base_s: float) -> float:
    """Seconds to wait before retry number ``attempt`` (1, 2, ...): ``base_s`` doubling, at most ``MAX_BACKOFF_S``."""
    return min(MAX_BACKOFF_S, base_s * 2 ** (attempt - 1))
