"""Transient HTTP failures against the session's real SGLang server: retried, counted, and bounded.

Failures are made for real: a keep-alive connection the server has closed, and a TCP proxy in front of the
server (``proxy`` in conftest.py) that resets, stalls or answers 503 on its first connections before it
forwards bytes untouched.
"""

from __future__ import annotations

import time

import pytest
import urllib3.connectionpool
from tidal.rollout import EngineUnavailableError, RolloutError, SGLangClient, SGLangEngine, generate_samples

PARAMS = {"n": 2, "max_new_tokens": 3, "temperature": 0.0, "ignore_eos": True}
FAST = {"retry_backoff_s": 0.05}


def test_a_connection_the_server_closed_on_keep_alive_is_never_fatal(
    sglang_server: SGLangEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The race: urllib3 checks that a pooled connection is open, then the server's keep-alive
    # closes it, then the request is written into it. Wait past the server's keep-alive and make the check
    # miss the close, as it does when the two happen in the same instant.
    assert sglang_server.keep_alive_s <= 2, "the session server runs with a short keep-alive (conftest.py)"
    unbounded = SGLangClient(sglang_server.url, max_idle_s=None, **FAST)  # reuses idle connections however old
    for client in (unbounded, sglang_server):
        assert client.generate([[3, 4]], PARAMS)
    retries_before = sglang_server.http_retries
    time.sleep(sglang_server.keep_alive_s + 1.0)
    monkeypatch.setattr(urllib3.connectionpool, "is_connection_dropped", lambda conn: False)

    # Root cause closed: the engine's client drops connections idle for half the server's keep-alive.
    assert len(sglang_server.generate([[3, 4]], PARAMS)) == 2
    assert sglang_server.http_retries == retries_before
    # Without that bound the request hits the closed connection, and one retry saves it.
    assert len(unbounded.generate([[3, 4]], PARAMS)) == 2
    assert unbounded.http_retries == 1


@pytest.mark.parametrize("fault", ["reset", "503"])
def test_resets_and_5xx_are_retried_on_the_generation_path(proxy, fault: str) -> None:
    flaky = proxy([fault, fault])
    client = SGLangClient(flaky.url, max_retries=3, **FAST)
    samples = generate_samples(client, [[3, 4], [5, 6]], PARAMS, max_concurrency=1)
    assert len(samples) == 4 and all(len(s.response_ids) == 3 for s in samples)
    assert client.http_retries == 2


def test_a_timed_out_generate_is_sent_again(proxy) -> None:
    flaky = proxy(["stall"], stall_s=5.0)
    client = SGLangClient(flaky.url, request_timeout_s=1.0, **FAST)
    assert len(client.generate([[3, 4]], PARAMS)) == 2
    assert client.http_retries == 1


def test_exhausted_retries_give_one_line_naming_the_endpoint(proxy) -> None:
    flaky = proxy(["reset"] * 10)
    client = SGLangClient(flaky.url, max_retries=2, **FAST)
    with pytest.raises(EngineUnavailableError, match=r"POST .*/generate failed after 3 attempts: connection reset"):
        client.generate([[3, 4]], PARAMS)
    assert client.http_retries == 2 and flaky.connections == 3
    with pytest.raises(RolloutError) as info:
        generate_samples(SGLangClient(flaky.url, max_retries=1, **FAST), [[3, 4]], PARAMS)
    assert f"SGLang endpoint {flaky.url} stopped answering during generation" in str(info.value)
    assert "\n" not in str(info.value)


def test_a_weight_update_session_call_is_resent_only_if_it_never_left(proxy, free_port) -> None:
    # begin_weight_update may have reached the server before the reset: sending it twice is not safe.
    flaky = proxy(["reset"])
    client = SGLangClient(flaky.url, **FAST)
    with pytest.raises(EngineUnavailableError, match="failed: connection reset"):
        client.call("/begin_weight_update", {})
    assert client.http_retries == 0
    # A refused connection sent nothing: retried (here until the retries run out, nothing listens).
    refused = SGLangClient(f"http://127.0.0.1:{free_port()}", max_retries=2, **FAST)
    with pytest.raises(EngineUnavailableError, match="after 3 attempts: connection refused"):
        refused.call("/begin_weight_update", {})
    assert refused.http_retries == 2
    # An idempotent control call is retried after a reset too.
    flaky = proxy(["reset"])
    client = SGLangClient(flaky.url, **FAST)
    client.flush_cache()
    assert client.http_retries == 1
