"""HTTP client of an SGLang server or of an sglang-router in front of several: /generate and control endpoints."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

import requests
from requests.adapters import HTTPAdapter
from tidal.rollout.errors import EngineUnavailableError, RolloutError

logger = logging.getLogger(__name__)

# Enough pooled connections for a rollout's concurrent requests (requests' default of 10 would reconnect).
_POOL_SIZE = 256
_HEALTH_POLL_S = 0.5
_PROGRESS_EVERY_S = 30.0


class SGLangClient:
    """Talks to one SGLang HTTP endpoint: an engine, or a router that forwards ``/generate`` to engines.

    ``SGLangClient("http://127.0.0.1:30000")`` is enough to generate through a router or server started
    elsewhere; :class:`~tidal.rollout.engine.SGLangEngine` and :class:`~tidal.rollout.router.RolloutRouter`
    add the process that serves it.
    """

    def __init__(self, url: str, *, api_key: str | None = None, request_timeout_s: float = 600.0) -> None:
        """Point at ``url`` (e.g. ``http://127.0.0.1:30000``); every request carries ``api_key`` when given."""
        self._url = url.rstrip("/")
        self.request_timeout_s = request_timeout_s
        self._api_key = api_key
        self._session = requests.Session()
        adapter = HTTPAdapter(pool_connections=4, pool_maxsize=_POOL_SIZE)
        self._session.mount("http://", adapter)
        self._session.mount("https://", adapter)
        if api_key:
            self._session.headers["Authorization"] = f"Bearer {api_key}"

    @property
    def url(self) -> str:
        """Base URL, e.g. ``http://127.0.0.1:30000``."""
        return self._url

    def describe(self) -> str:
        """How errors name this endpoint."""
        return f"SGLang endpoint {self.url}"

    def health_ok(self) -> bool:
        """Whether ``/health`` answers 200 right now."""
        try:
            return self._session.get(f"{self.url}/health", timeout=5.0).status_code == 200
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
        try:
            return self._session.post(f"{self.url}{endpoint}", json=payload or {}, timeout=self.request_timeout_s)
        except (requests.ConnectionError, requests.exceptions.ChunkedEncodingError) as e:
            # Refused, reset or cut mid-answer: the server is gone (or going); callers may restart it.
            raise EngineUnavailableError(f"POST {self.url}{endpoint} failed: {e}; is the server running?") from e
        except requests.RequestException as e:
            raise RolloutError(f"POST {self.url}{endpoint} failed: {e}") from e

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
            ("stop", "length" or "abort") and ``weight_version``.

        Raises:
            EngineUnavailableError: The server could not be reached or dropped the connection.
            RolloutError: The server refused the request or its answer is inconsistent.
        """
        params = dict(sampling_params)
        n = int(params.pop("n", 1))
        if n < 1:
            raise ValueError(f"sampling_params['n'] must be >= 1, got {n}")
        if not input_ids:
            return []
        prompts = [list(map(int, ids)) for ids in input_ids for _ in range(n)]
        payload = {"input_ids": prompts, "sampling_params": params, "return_logprob": True}
        response = self._post("/generate", payload)
        if response.status_code != 200:
            raise RolloutError(f"/generate at {self.url} answered {response.status_code}: {response.text[:2000]}")
        answers = response.json()
        if len(answers) != len(prompts):
            raise RolloutError(f"/generate at {self.url} returned {len(answers)} outputs for {len(prompts)} prompts")
        return [parse_output(answer) for answer in answers]

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

        Raises:
            RolloutError: The server refused the update; the message is the server's.
        """
        payload: dict[str, Any] = {"model_path": str(path)}
        if weight_version is not None:
            payload["weight_version"] = weight_version
        self.call("/update_weights_from_disk", payload, what=f"update_weights_from_disk({path})")

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

    def flush_cache(self) -> None:
        """Empty the radix (prefix) cache (a router fans this out to every engine).

        Raises:
            RolloutError: The server could not flush (e.g. requests are still running).
        """
        response = self._post("/flush_cache")
        if response.status_code != 200:
            raise RolloutError(f"/flush_cache at {self.url} answered {response.status_code}: {response.text[:500]}")

    def get_model_info(self) -> dict[str, Any]:
        """The server's ``/get_model_info``: ``model_path``, ``weight_version``, ``is_generation``, ..."""
        try:
            response = self._session.get(f"{self.url}/get_model_info", timeout=self.request_timeout_s)
        except requests.RequestException as e:
            raise RolloutError(f"GET {self.url}/get_model_info failed: {e}; is the server running?") from e
        if response.status_code != 200:
            raise RolloutError(f"/get_model_info at {self.url} answered {response.status_code}: {response.text[:500]}")
        return response.json()


def parse_output(answer: Mapping[str, Any]) -> dict[str, Any]:
    """One ``/generate`` answer -> the tokens, log-probs and finish reason exactly as sampled."""
    meta = answer["meta_info"]
    output_ids = [int(t) for t in answer["output_ids"]]
    # Each entry is (log-prob, token id, token text or None).
    token_logprobs = meta["output_token_logprobs"]
    log_probs = [float(entry[0]) for entry in token_logprobs]
    logprob_ids = [int(entry[1]) for entry in token_logprobs]
    if logprob_ids != output_ids:
        raise RolloutError(
            f"SGLang returned log-probs for tokens {logprob_ids[:16]}... but output_ids {output_ids[:16]}...; "
            "refusing to pair log-probs with the wrong tokens"
        )
    reason = meta.get("finish_reason") or {}
    kind = reason.get("type") if isinstance(reason, Mapping) else str(reason)
    if kind not in ("stop", "length", "abort"):
        raise RolloutError(f"unexpected finish_reason {reason!r} from SGLang")
    return {
        "output_ids": output_ids,
        "output_log_probs": log_probs,
        "finish_reason": kind,
        "weight_version": meta.get("weight_version"),
    }
