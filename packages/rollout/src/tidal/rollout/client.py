"""HTTP client of an SGLang server or of an sglang-router in front of several: /generate and control endpoints."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import requests
from tidal.rollout.answers import StreamedAnswer, parse_output, read_chunks
from tidal.rollout.errors import EngineUnavailableError, RolloutError
from tidal.rollout.transport import (
    DEFAULT_BACKOFF_S,
    DEFAULT_MAX_IDLE_S,
    DEFAULT_RETRIES,
    IDEMPOTENT_ENDPOINTS,
    IdleBoundedAdapter,
    backoff_s,
    describe_failure,
    is_transient,
    never_sent,
)

if TYPE_CHECKING:
    from tidal.rollout.config import RolloutConfig

logger = logging.getLogger(__name__)

# Enough pooled connections for a rollout's concurrent requests (requests' default of 10 would reconnect).
_POOL_SIZE = 256
_HEALTH_POLL_S = 0.5
_PROGRESS_EVERY_S = 30.0
_FLUSH_IDLE_TIMEOUT_S = 30.0  # SGLang flushes only once its scheduler is fully idle
_CONNECT_TIMEOUT_S = 10.0
ROUTED_EXPERTS_PARAM = "return_routed_experts"
"""Sampling-parameter key (tidal's, not sent as one) asking ``/generate`` for the routed experts of every token."""
TOP_LOGPROBS_PARAM = "top_logprobs_num"
"""Sampling-parameter key (sent as ``/generate``'s own field of that name): how many of the most likely tokens to
give at each sampled position (answers then hold ``output_top_logprobs``)."""


class SGLangClient:
    """Talks to one SGLang HTTP endpoint: an engine, or a router that forwards ``/generate`` to engines.

    ``SGLangClient("http://127.0.0.1:30000")`` is enough to generate through a router or server started
    elsewhere; :class:`~tidal.rollout.engine.SGLangEngine` and :class:`~tidal.rollout.router.RolloutRouter`
    add the process that serves it.
    """

    def __init__(
        self,
        url: str,
        *,
        api_key: str | None = None,
        request_timeout_s: float = 600.0,
        max_retries: int = DEFAULT_RETRIES,
        retry_backoff_s: float = DEFAULT_BACKOFF_S,
        max_idle_s: float | None = DEFAULT_MAX_IDLE_S,
    ) -> None:
        """Point at ``url`` (e.g. ``http://127.0.0.1:30000``); every request carries ``api_key`` when given.

        Args:
            url: Base URL of the server or router.
            api_key: Bearer key the server demands.
            request_timeout_s: Longest wait for one answer (a whole batched generation); a timed-out request
                counts as a transient failure.
            max_retries: Times one request is sent again after a transient failure (refused, reset, timed
                out, or a 5xx answer to an idempotent call), waiting ``retry_backoff_s`` doubling in between.
            retry_backoff_s: Wait before the first retry.
            max_idle_s: Pooled connections idle longer than this are closed rather than reused; keep it below
                the server's keep-alive (SGLang's default is 5 s). None reuses them however old.
        """
        if request_timeout_s <= 0:
            raise ValueError(f"request_timeout_s must be > 0, got {request_timeout_s}")
        if max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {max_retries}")
        self._url = url.rstrip("/")
        self.request_timeout_s = request_timeout_s
        self.max_retries = max_retries
        self.retry_backoff_s = retry_backoff_s
        self._api_key = api_key
        self._session = requests.Session()
        adapter = IdleBoundedAdapter(max_idle_s=max_idle_s, pool_maxsize=_POOL_SIZE)
        self._session.mount("http://", adapter)
        self._session.mount("https://", adapter)
        if api_key:
            self._session.headers["Authorization"] = f"Bearer {api_key}"
        self._retries = 0
        self._retries_lock = threading.Lock()
        self.lora_name: str | None = None
        """The LoRA adapter every ``/generate`` names (``lora_path``); None: the base model (see ``lora_adapters``)."""

    @classmethod
    def from_config(cls, cfg: RolloutConfig, url: str) -> SGLangClient:
        """A client of ``url`` with ``cfg``'s request timeout and retries (an external server, or one engine)."""
        return cls(
            url,
            api_key=cfg.sglang_api_key,
            request_timeout_s=cfg.rollout_request_timeout_s,
            max_retries=cfg.rollout_request_retries,
        )

    @property
    def http_retries(self) -> int:
        """Requests sent again after a transient failure, since this client was made (a metric: only grows)."""
        return self._retries

    def may_retry(self) -> bool:
        """Whether a failed request is worth sending again (a server this process launched says no once it died)."""
        return True

    @property
    def url(self) -> str:
        """Base URL, e.g. ``http://127.0.0.1:30000``."""
        return self._url

    def describe(self) -> str:
        """How errors name this endpoint."""
        return f"SGLang endpoint {self.url}"

    def health_ok(self, timeout_s: float = 5.0) -> bool:
        """Whether ``/health`` answers 200 within ``timeout_s`` (a probe: never retried)."""
        try:
            return self._session.get(f"{self.url}/health", timeout=timeout_s).status_code == 200
        except requests.RequestException:
            return False

    def wait_healthy(self, timeout_s: float) -> None:
        """Poll ``/health`` until it answers 200 (a server started elsewhere: its answer is all there is to watch).

        Raises:
            RolloutError: No healthy answer within ``timeout_s``.
        """
        start = time.monotonic()
        next_report = start + _PROGRESS_EVERY_S
        while not self.health_ok():
            now = time.monotonic()
            if now - start > timeout_s:
                raise RolloutError(
                    f"{self.describe()} not healthy after {timeout_s:.0f} s: is a server running there? "
                    "Check the address and that GET /health answers 200"
                )
            if now >= next_report:
                logger.info("waiting for %s: %.0f s / %.0f s", self.describe(), now - start, timeout_s)
                next_report = now + _PROGRESS_EVERY_S
            time.sleep(_HEALTH_POLL_S)
        logger.info("%s healthy after %.1f s", self.describe(), time.monotonic() - start)

    def _post(self, endpoint: str, payload: Mapping[str, Any] | None = None) -> requests.Response:
        return self.request("POST", endpoint, payload)

    def request(
        self,
        method: str,
        endpoint: str,
        payload: Mapping[str, Any] | None = None,
        *,
        idempotent: bool | None = None,
        stream: bool = False,
    ) -> requests.Response:
        """Send one request; send it again after a transient failure, at most ``max_retries`` times.

        Transient: refused, reset or cut connections, read timeouts, and 5xx answers. A call that is not
        idempotent (``idempotent`` None: whether ``endpoint`` is in ``IDEMPOTENT_ENDPOINTS``, e.g. the
        weight-update session calls are not) is sent again only when it never left (refused or timed-out
        connect). Each retry is logged at WARNING with the endpoint and attempt and counted in
        :attr:`http_retries`. With ``stream`` the answer is returned once its headers are in (its body is read
        by the caller, and only the headers are retried).

        Returns:
            The answer: any status below 500, or a 5xx once the retries are spent (or for a call not retried).

        Raises:
            EngineUnavailableError: No answer after every attempt (one line: endpoint, attempts, last failure).
            RolloutError: A request that could not be sent at all (e.g. a malformed URL).
        """
        url = f"{self.url}{endpoint}"
        safe = endpoint.split("?", 1)[0] in IDEMPOTENT_ENDPOINTS if idempotent is None else idempotent
        timeout = (min(_CONNECT_TIMEOUT_S, self.request_timeout_s), self.request_timeout_s)
        body = None if method == "GET" else dict(payload or {})
        attempt = 0
        while True:
            attempt += 1
            try:
                response = self._session.request(method, url, json=body, timeout=timeout, stream=stream)
            except requests.RequestException as e:
                if not is_transient(e):
                    raise RolloutError(f"{method} {url} failed: {e}") from e
                failure = describe_failure(e, self.request_timeout_s)
                if not (safe or never_sent(e)) or not self._retry(method, url, attempt, failure):
                    tries = f" after {attempt} attempts" if attempt > 1 else ""
                    raise EngineUnavailableError(
                        f"{method} {url} failed{tries}: {failure}; is the server running?"
                    ) from e
                continue
            if response.status_code < 500 or not safe:
                return response
            failure = f"HTTP {response.status_code}: {response.text[:200]!r}"
            if not self._retry(method, url, attempt, failure):
                return response

    def _retry(self, method: str, url: str, attempt: int, failure: str) -> bool:
        """Wait and count a retry of a failed attempt; False when retries are spent or pointless."""
        if attempt > self.max_retries or not self.may_retry():
            return False
        delay = backoff_s(attempt, self.retry_backoff_s)
        logger.warning("%s %s: %s; retry %d/%d in %.1f s", method, url, failure, attempt, self.max_retries, delay)
        with self._retries_lock:
            self._retries += 1
        time.sleep(delay)
        return True

    def generate(self, input_ids: Sequence[Sequence[int]], sampling_params: Mapping[str, Any]) -> list[dict[str, Any]]:
        """Sample continuations of token-id prompts in ONE batched ``/generate`` call.

        Args:
            input_ids: One token-id list per prompt.
            sampling_params: SGLang sampling parameters (``max_new_tokens``, ``temperature``, ``top_p``,
                ``top_k``, ``stop_token_ids``, ...). ``n`` (default 1) samples per prompt are made by
                repeating each prompt ``n`` times.

        Returns:
            ``len(input_ids) * n`` dicts, prompt-major (all samples of prompt 0 first), each with
            ``output_ids`` (the sampled tokens, a matched stop token included), ``output_log_probs``
            (log-prob of each of those tokens under the sampling distribution's model), ``finish_reason``
            ("stop", "length" or "abort") and ``weight_version``; with ``sampling_params["return_routed_experts"]``
            true also ``routed_experts``, with ``sampling_params["top_logprobs_num"]`` k also
            ``output_top_logprobs`` (see :func:`parse_output`).

        Raises:
            EngineUnavailableError: The server could not be reached, dropped the connection, timed out or
                answered 5xx, each time it was tried (see :meth:`request`).
            RolloutError: The server refused the request or its answer is inconsistent.
        """
        params = dict(sampling_params)
        n = int(params.pop("n", 1))
        routed = bool(params.pop(ROUTED_EXPERTS_PARAM, False))
        top = int(params.pop(TOP_LOGPROBS_PARAM, 0))
        if n < 1:
            raise ValueError(f"sampling_params['n'] must be >= 1, got {n}")
        if not input_ids:
            return []
        prompts = [list(map(int, ids)) for ids in input_ids for _ in range(n)]
        payload = {"input_ids": prompts, "sampling_params": params, "return_logprob": True}
        if routed:
            payload["return_routed_experts"] = True
        if top:
            payload[TOP_LOGPROBS_PARAM] = top
        if self.lora_name is not None:
            payload["lora_path"] = self.lora_name
        response = self._check_generate(self._post("/generate", payload))
        answers = response.json()
        if len(answers) != len(prompts):
            raise RolloutError(f"/generate at {self.url} returned {len(answers)} outputs for {len(prompts)} prompts")
        return [parse_output(answer, routed_experts=routed) for answer in answers]

    def _check_generate(self, response: requests.Response) -> requests.Response:
        """``response`` when it is a 200; else the error of a ``/generate`` that failed (5xx) or was refused."""
        if response.status_code >= 500:  # still failing after the retries: up to the caller (restart or give up)
            raise EngineUnavailableError(
                f"/generate at {self.url} answered {response.status_code} (retried up to {self.max_retries} times): "
                f"{response.text[:500]!r}"
            )
        if response.status_code != 200:
            raise RolloutError(f"/generate at {self.url} answered {response.status_code}: {response.text[:2000]}")
        return response

    def generate_stream(self, input_ids: Sequence[int], sampling_params: Mapping[str, Any]) -> Iterator[dict[str, Any]]:
        """Sample one continuation of one token-id prompt, streamed as SGLang samples it (``/generate`` with stream).

        Yields ``{"output_ids": <every token so far>, "finish_reason": None}`` per chunk SGLang sends, then, last,
        the whole answer as :meth:`generate` returns it (log-probs, finish reason, weight version). Closing the
        iterator early closes the connection (SGLang then aborts the request).

        Raises:
            ValueError: ``n`` other than 1, or routed experts asked for (not streamed).
            EngineUnavailableError: As :meth:`generate`, or the stream broke or ended without an answer.
            RolloutError: The server refused the request or its chunks are inconsistent.
        """
        params = dict(sampling_params)
        if int(params.pop("n", 1)) != 1 or params.pop(ROUTED_EXPERTS_PARAM, False):
            raise ValueError("generate_stream samples one answer without routed experts: use generate for n > 1")
        payload: dict[str, Any] = {
            "input_ids": [int(t) for t in input_ids],
            "sampling_params": params,
            "return_logprob": True,
            "stream": True,
        }
        if top := int(params.pop(TOP_LOGPROBS_PARAM, 0)):
            payload[TOP_LOGPROBS_PARAM] = top
        if self.lora_name is not None:
            payload["lora_path"] = self.lora_name
        with contextlib.closing(self.request("POST", "/generate", payload, stream=True)) as response:
            self._check_generate(response)
            streamed = StreamedAnswer(self.url)
            for chunk in read_chunks(response, self.url):
                if streamed.add(chunk):
                    yield parse_output(streamed.answer())
                    return
                yield {"output_ids": list(streamed.output_ids), "finish_reason": None}
        raise EngineUnavailableError(f"/generate at {self.url}: the stream ended before the answer did")

    def call(self, endpoint: str, payload: Mapping[str, Any] | None = None, *, what: str = "") -> dict[str, Any]:
        """POST JSON to an SGLang control endpoint and check that it succeeded.

        Args:
            endpoint: Path such as ``/update_weights_from_disk``.
            payload: JSON body (``{}`` when None).
            what: Description of the operation for the error message (default: the endpoint).

        Returns:
            The decoded JSON answer (``{}`` when it is not JSON).

        Raises:
            RolloutError: HTTP status other than 200 or ``"success": false``; the message is the server's.
        """
        response = self._post(endpoint, payload)
        try:
            body = response.json()
        except ValueError:
            body = {"message": response.text[:2000]}
        if not isinstance(body, dict):
            body = {"result": body}
        if response.status_code != 200 or body.get("success") is False:
            raise RolloutError(
                f"{self.describe()} refused {what or endpoint} "
                f"(HTTP {response.status_code}): {body.get('message', body)}"
            )
        return body

    def update_weights_from_disk(self, path: str | os.PathLike[str], *, weight_version: str | None = None) -> None:
        """Load new weights from an HF checkpoint directory (as the server sees its file system) into the server.

        The prefix cache the old weights filled is flushed afterwards, once the server is idle (:meth:`flush_cache`):
        SGLang's own flush inside the update fails the whole call while requests just aborted by a weight update
        (``--max-staleness``) are still being retired, with the new weights already loaded.

        Raises:
            RolloutError: The server refused the update (the message is the server's), or stayed busy past the
                flush's wait.
        """
        payload: dict[str, Any] = {"model_path": str(path), "flush_cache": False}
        if weight_version is not None:
            payload["weight_version"] = weight_version
        self.call("/update_weights_from_disk", payload, what=f"update_weights_from_disk({path})")
        self.flush_cache()

    def abort(self, rid: str | None = None) -> None:
        """Abort in-flight requests (all of them, or the one with ``rid``) via ``/abort_request``.

        An aborted request's ``/generate`` call still answers, with the tokens sampled so far and
        ``finish_reason`` "abort" (a partial rollout resumes them).

        Raises:
            RolloutError: The server refused.
        """
        payload: dict[str, Any] = {"abort_all": True} if rid is None else {"rid": rid}
        response = self._post("/abort_request", payload)
        if response.status_code != 200:
            raise RolloutError(f"/abort_request at {self.url} answered {response.status_code}: {response.text[:500]}")

    def flush_cache(self, *, idle_timeout_s: float = _FLUSH_IDLE_TIMEOUT_S) -> None:
        """Empty the radix (prefix) cache (a router fans this out to every engine).

        SGLang refuses a flush (400) until its scheduler is fully idle, which can lag the last answer by a batch
        step: the server is asked to wait for idle itself (``?timeout=``), and a refusal (a router that does not
        pass the wait on) is asked again, every 0.1 s doubling to 1 s, for up to ``idle_timeout_s`` in all.

        Raises:
            RolloutError: The server still refused after ``idle_timeout_s`` (requests are still running).
        """
        deadline = time.monotonic() + idle_timeout_s
        wait = 0.1
        while True:
            left = max(deadline - time.monotonic(), 0.0)
            response = self._post(f"/flush_cache?timeout={left:.1f}")
            if response.status_code == 200:
                return
            if response.status_code != 400 or time.monotonic() + wait > deadline:
                raise RolloutError(
                    f"/flush_cache at {self.url} answered {response.status_code}: {response.text[:500]} "
                    f"(for {idle_timeout_s:.0f} s: requests still running there?)"
                )
            logger.info("%s is not idle yet (flush refused); asking again in %.1f s", self.url, wait)
            time.sleep(wait)
            wait = min(2 * wait, 1.0)

    def get_model_info(self) -> dict[str, Any]:
        """The server's ``/get_model_info``: ``model_path``, ``weight_version``, ``is_generation``, ..."""
        response = self.request("GET", "/get_model_info")
        if response.status_code != 200:
            raise RolloutError(f"/get_model_info at {self.url} answered {response.status_code}: {response.text[:500]}")
        return response.json()
