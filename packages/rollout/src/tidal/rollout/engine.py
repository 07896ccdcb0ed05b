"""One SGLang server as a child process: launch, health, batched generation, weight updates, shutdown."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import requests
from tidal.rollout.errors import RolloutError
from tidal.rollout.server_process import kill_process_group, log_tail, process_group_alive

logger = logging.getLogger(__name__)

# Directory holding the sitecustomize.py that stands in for sgl_kernel on machines without CUDA.
CPU_STUB_DIR = Path(__file__).parent / "cpu_stub"

# Flags SGLang needs to serve on CPU (DESIGN.md). --max-total-tokens bounds the KV pool: without it the
# pool took 15 GB of RAM. Each is skipped when the caller passes the same flag in extra_server_args.
CPU_SERVER_ARGS: tuple[tuple[str, ...], ...] = (
    ("--device", "cpu"),
    ("--attention-backend", "torch_native"),
    ("--disable-cuda-graph",),
    ("--max-total-tokens", "4096"),
)

_LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
_HEALTH_POLL_S = 0.5
_PROGRESS_EVERY_S = 30.0
_SHUTDOWN_GRACE_S = 15.0


def _cuda_available() -> bool:
    import torch  # deferred: importing torch takes seconds and only the launch needs it

    return torch.cuda.is_available()


def _flag_names(args: Sequence[str]) -> set[str]:
    return {arg.split("=", 1)[0] for arg in args if arg.startswith("--")}


class SGLangEngine:
    """An SGLang HTTP server in its own process group, and a client for the endpoints RL needs.

    The server is started with ``sys.executable -m sglang.launch_server`` on the given host and ports.
    Without CUDA it gets the CPU flags of ``CPU_SERVER_ARGS``, ``SGLANG_USE_CPU_ENGINE=1`` and the
    ``sgl_kernel`` stand-in on its ``PYTHONPATH``. Its stdout and stderr go to a log file in ``log_dir``
    whose tail is quoted in every start-up error.
    """

    def __init__(
        self,
        model_path: str | os.PathLike[str],
        *,
        host: str = "127.0.0.1",
        port: int,
        nccl_port: int | None = None,
        log_dir: str | os.PathLike[str],
        extra_server_args: Sequence[str] = (),
        startup_timeout_s: float = 300.0,
        request_timeout_s: float = 600.0,
        env: Mapping[str, str] | None = None,
        cpu: bool | None = None,
        api_key: str | None = None,
    ) -> None:
        """Describe an engine; nothing starts until :meth:`start`.

        Args:
            model_path: HF checkpoint directory (config, tokenizer, safetensors) to serve.
            host: Address to listen on; 127.0.0.1 keeps the server off the network.
            port: HTTP port of the server.
            nccl_port: Port for SGLang's internal process group (``--nccl-port``); None lets SGLang pick.
            log_dir: Directory for the server log (created if missing).
            extra_server_args: More ``sglang.launch_server`` arguments, passed through verbatim.
            startup_timeout_s: Longest wait for a healthy ``/health`` in :meth:`wait_healthy`.
            request_timeout_s: Timeout of one HTTP request (a whole batched generation included).
            env: Environment variables added to (and overriding) this process's for the server.
            cpu: Serve on CPU; None decides by ``torch.cuda.is_available()``.
            api_key: Key the server demands (SGLang ``--api-key``) and every request carries; required
                when ``host`` is not a loopback address.

        Raises:
            ValueError: A bad port or timeout, or a non-loopback host without an API key.
        """
        if port <= 0 or port > 65535:
            raise ValueError(f"port must be in 1..65535, got {port}")
        if startup_timeout_s <= 0:
            raise ValueError(f"startup_timeout_s must be > 0, got {startup_timeout_s}")
        if host not in _LOOPBACK_HOSTS and not api_key:
            raise ValueError(
                f"SGLang host {host!r} is reachable from other machines and the server would accept any request; "
                "set --sglang-api-key (or keep the default host 127.0.0.1)"
            )
        self.model_path = str(model_path)
        self.host = host
        self.port = port
        self.nccl_port = nccl_port
        self.log_dir = Path(log_dir)
        self.extra_server_args = tuple(extra_server_args)
        self.startup_timeout_s = startup_timeout_s
        self.request_timeout_s = request_timeout_s
        self.env = dict(env or {})
        self.cpu = cpu
        self.log_path = self.log_dir / f"sglang_{host}_{port}.log"
        self._process: subprocess.Popen[bytes] | None = None
        self._finalizer: weakref.finalize | None = None
        self._api_key = api_key
        self._session = requests.Session()
        if api_key:
            self._session.headers["Authorization"] = f"Bearer {api_key}"

    @property
    def url(self) -> str:
        """Base URL of the server, e.g. ``http://127.0.0.1:30000``."""
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        """Process id of the server's launcher (also its process group id), None when not started."""
        return None if self._process is None else self._process.pid

    def is_running(self) -> bool:
        """Whether the launched server process is still alive."""
        return self._process is not None and self._process.poll() is None

    def command(self) -> list[str]:
        """The server command line this engine runs (CPU flags resolved)."""
        cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", self.model_path]
        cmd += ["--host", self.host, "--port", str(self.port)]
        if self.nccl_port is not None:
            cmd += ["--nccl-port", str(self.nccl_port)]
        if self._api_key:
            cmd += ["--api-key", self._api_key]
        if self._use_cpu():
            given = _flag_names(self.extra_server_args)
            for flag in CPU_SERVER_ARGS:
                if flag[0] not in given:
                    cmd += flag
        return cmd + list(self.extra_server_args)

    def _use_cpu(self) -> bool:
        if self.cpu is None:
            self.cpu = not _cuda_available()
        return self.cpu

    def _server_env(self) -> dict[str, str]:
        env = dict(os.environ)
        if self._use_cpu():
            env["SGLANG_USE_CPU_ENGINE"] = "1"
            parts = [str(CPU_STUB_DIR), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
            env["PYTHONPATH"] = os.pathsep.join(parts)
        env.update(self.env)
        return env

    def start(self, *, wait: bool = True) -> None:
        """Launch the server; with ``wait`` also block until it is healthy (see :meth:`wait_healthy`).

        Raises:
            RolloutError: The server is already running, died during start-up or timed out.
        """
        if self.is_running():
            raise RolloutError(f"SGLang server at {self.url} is already running (pid {self.pid})")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        cmd = self.command()
        shown = " ".join("***" if prev == "--api-key" else arg for prev, arg in zip(["", *cmd[:-1]], cmd, strict=True))
        logger.info("starting SGLang server at %s: %s (log: %s)", self.url, shown, self.log_path)
        with self.log_path.open("ab") as log:
            self._process = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self._server_env(),
                start_new_session=True,  # own process group: shutdown() reaches every helper process
            )
        # Kill the group even if the owner forgets shutdown() or the interpreter exits first.
        self._finalizer = weakref.finalize(self, kill_process_group, self._process.pid, signal.SIGKILL)
        if wait:
            self.wait_healthy()

    def wait_healthy(self, timeout_s: float | None = None) -> None:
        """Poll ``/health`` until it answers 200, the process dies, or the timeout passes.

        Args:
            timeout_s: Longest wait; defaults to ``startup_timeout_s``.

        Raises:
            RolloutError: The process exited or the timeout passed; the message quotes the server log.
        """
        if self._process is None:
            raise RolloutError(f"SGLang server at {self.url} was never started; call start() first")
        timeout_s = self.startup_timeout_s if timeout_s is None else timeout_s
        start = time.monotonic()
        next_report = start + _PROGRESS_EVERY_S
        while True:
            if self._health_ok():
                logger.info("SGLang server at %s healthy after %.1f s", self.url, time.monotonic() - start)
                return
            now = time.monotonic()
            if now - start > timeout_s:
                self.shutdown()
                raise RolloutError(
                    f"SGLang server at {self.url} not healthy after {timeout_s:.0f} s (startup_timeout_s); "
                    f"raise it on a slow machine or read the log.\n{log_tail(self.log_path)}"
                )
            if now >= next_report:
                logger.info("waiting for SGLang server at %s: %.0f s / %.0f s", self.url, now - start, timeout_s)
                next_report = now + _PROGRESS_EVERY_S
            try:  # the poll interval doubles as a wait on the process: a crash is seen at once
                code = self._process.wait(timeout=_HEALTH_POLL_S)
            except subprocess.TimeoutExpired:
                continue
            self.shutdown()
            raise RolloutError(
                f"SGLang server at {self.url} exited with code {code} during start-up "
                f"(model {self.model_path}).\n{log_tail(self.log_path)}"
            )

    def _health_ok(self) -> bool:
        try:
            return self._session.get(f"{self.url}/health", timeout=5.0).status_code == 200
        except requests.RequestException:
            return False

    def shutdown(self, timeout_s: float = _SHUTDOWN_GRACE_S) -> None:
        """Stop the server and every process in its group; SIGKILL what outlives ``timeout_s``. Idempotent."""
        process = self._process
        if process is None:
            return
        pgid = process.pid
        kill_process_group(pgid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            logger.warning("SGLang server pid %d ignored SIGTERM for %.0f s; killing it", pgid, timeout_s)
        while process_group_alive(pgid) and time.monotonic() < deadline:
            time.sleep(0.1)  # children leave the group a moment after the launcher
        kill_process_group(pgid, signal.SIGKILL)
        process.wait(timeout=timeout_s)
        if self._finalizer is not None:
            self._finalizer.detach()
        self._process = None
        logger.info("SGLang server at %s stopped", self.url)

    def restart(self) -> None:
        """Stop the server if anything is left of it, then start it again and wait until it is healthy."""
        logger.warning("restarting SGLang server at %s", self.url)
        self.shutdown()
        self.start()

    def __enter__(self) -> SGLangEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ---- HTTP endpoints ------------------------------------------------------------------------------

    def _post(self, endpoint: str, payload: Mapping[str, Any] | None = None) -> requests.Response:
        try:
            return self._session.post(f"{self.url}{endpoint}", json=payload or {}, timeout=self.request_timeout_s)
        except requests.RequestException as e:
            raise RolloutError(f"POST {self.url}{endpoint} failed: {e}; is the server running?") from e

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
            RolloutError: The request failed or the answer is inconsistent.
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
        return [_parse_output(answer) for answer in answers]

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
                f"SGLang server at {self.url} refused {what or endpoint} "
                f"(HTTP {response.status_code}): {body.get('message', body)}"
            )
        return body

    def update_weights_from_disk(self, path: str | os.PathLike[str], *, weight_version: str | None = None) -> None:
        """Load new weights from an HF checkpoint directory into the running server (cache flushed).

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
        ``finish_reason`` "abort" (a partial rollout resumes them with :func:`resume_samples`).

        Raises:
            RolloutError: The server refused.
        """
        payload: dict[str, Any] = {"abort_all": True} if rid is None else {"rid": rid}
        response = self._post("/abort_request", payload)
        if response.status_code != 200:
            raise RolloutError(f"/abort_request at {self.url} answered {response.status_code}: {response.text[:500]}")

    def flush_cache(self) -> None:
        """Empty the server's radix (prefix) cache.

        Raises:
            RolloutError: The server could not flush (e.g. requests are still running).
        """
        response = self._post("/flush_cache")
        if response.status_code != 200:
            raise RolloutError(f"/flush_cache at {self.url} answered {response.status_code}: {response.text[:500]}")

    def get_model_info(self) -> dict[str, Any]:
        """The server's ``/model_info``: ``model_path``, ``weight_version``, ``is_generation``, ..."""
        try:
            response = self._session.get(f"{self.url}/model_info", timeout=self.request_timeout_s)
        except requests.RequestException as e:
            raise RolloutError(f"GET {self.url}/model_info failed: {e}; is the server running?") from e
        if response.status_code != 200:
            raise RolloutError(f"/model_info at {self.url} answered {response.status_code}: {response.text[:500]}")
        return response.json()


def _parse_output(answer: Mapping[str, Any]) -> dict[str, Any]:
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
