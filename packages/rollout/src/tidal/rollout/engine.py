"""One SGLang server as a child process: launch flags, weight updates from disk, memory release, restart."""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tidal.rollout.bytecode import compile_site_packages
from tidal.rollout.netif import LOOPBACK_HOSTS, pin_gloo_interface
from tidal.rollout.server_process import ManagedServer
from tidal.rollout.transport import DEFAULT_RETRIES

if TYPE_CHECKING:
    from tidal.rollout.config import RolloutConfig

logger = logging.getLogger(__name__)

# Directory holding the sitecustomize.py that stands in for sgl_kernel on machines without CUDA.
CPU_STUB_DIR = Path(__file__).parent / "cpu_stub"

# Flags SGLang needs to serve on CPU (the package README's "CPU path in one place"). --max-total-tokens bounds the KV
# pool, which otherwise sizes itself from the host's whole RAM. Each is skipped when the caller passes the same flag in
# extra_server_args.
CPU_SERVER_ARGS: tuple[tuple[str, ...], ...] = (
    ("--device", "cpu"),
    ("--attention-backend", "torch_native"),
    ("--disable-cuda-graph",),
    ("--max-total-tokens", "4096"),
    # An idle scheduler otherwise polls its sockets in a busy loop: ~65% of a core per server for nothing, taken
    # from the actor on a small CPU machine. With it the scheduler blocks in zmq's poll and wakes on a request.
    ("--sleep-on-idle",),
)

# With --enable-lora on CPU: the LoRA backend that runs there (torch ops; the default one is CUDA kernels).
CPU_LORA_BACKEND = ("--lora-backend", "torch_native")

# SGLang's names for what release_memory_occupation can free (sglang.srt.constants).
MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")

_LOOPBACK_HOSTS = LOOPBACK_HOSTS

# Keep-alive of the servers tidal launches (SGLANG_TIMEOUT_KEEP_ALIVE, uvicorn's timeout_keep_alive; SGLang's
# default is 5 s): long enough that pooled connections survive from one rollout to the next. The engine's own
# client drops its connections at half of it, so it never writes into one the server is closing.
SERVER_KEEP_ALIVE_S = 60
KEEP_ALIVE_ENV = "SGLANG_TIMEOUT_KEEP_ALIVE"

# SGLang (sglang.srt.environ) turns both on by default: when any of its processes exits, which is also what a
# shutdown looks like, the launcher sleeps 5 s "to let GPU activity settle" and then runs py-spy and a CUDA core
# dump on the schedulers, so every stop and restart of a server waited those 5 s. The servers tidal launches set
# them to 0 unless the environment sets them.
CRASH_DIAGNOSTICS_ENV = ("SGLANG_PYSPY_DUMP_BEFORE_CRASH", "SGLANG_CUDA_COREDUMP_BEFORE_CRASH")


def missing_bytecode_note(env: Mapping[str, str], package: str = "sglang") -> str | None:
    """Why a server started with ``env`` would compile ``package`` from source on every start, or None.

    SGLang's ~4,700 modules are imported by the launcher and again by each process it spawns (scheduler,
    detokenizer). uv installs no ``.pyc`` files unless asked, and with ``PYTHONDONTWRITEBYTECODE`` set Python never
    writes them, so each of those processes compiles every module it imports, a large share of a server's start-up
    CPU time (bench/RESULTS.md measures it). ``uv sync --compile-bytecode`` compiles once at install.
    """
    if not env.get("PYTHONDONTWRITEBYTECODE"):
        return None  # the first start writes the bytecode; later starts read it
    spec = importlib.util.find_spec(package)  # finds without importing
    if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
        return None
    prefix = env.get("PYTHONPYCACHEPREFIX")
    compiled = Path(spec.origin).parent / "__pycache__" / f"__init__.{sys.implementation.cache_tag}.pyc"
    if prefix:
        compiled = Path(prefix) / Path(spec.origin).parent.relative_to("/") / compiled.name
    if compiled.exists():
        return None
    return (
        f"{package} is installed without bytecode and PYTHONDONTWRITEBYTECODE is set, so every SGLang server start "
        f"compiles its modules from source in each of its processes (tens of seconds on a small machine); run "
        f"`uv sync --compile-bytecode` once to compile them at install"
    )


def _cuda_available() -> bool:
    import torch  # deferred: importing torch takes seconds and only the launch needs it

    return torch.cuda.is_available()


# The custom weight loader every server is started with (it only registers the name): delta weight updates name it.
DELTA_LOADER = "tidal.rollout.engine_delta.load_delta"


def _flag_names(args: Sequence[str]) -> set[str]:
    return {arg.split("=", 1)[0] for arg in args if arg.startswith("--")}


def _with_routed_experts(args: Sequence[str], wanted: bool) -> tuple[str, ...]:
    """``args`` plus ``--enable-return-routed-experts`` when routed experts are wanted and it is not there yet."""
    flag = "--enable-return-routed-experts"
    return (*args, flag) if wanted and flag not in _flag_names(args) else tuple(args)


class SGLangEngine(ManagedServer):
    """An SGLang HTTP server in its own process group, and a client for the endpoints RL needs.

    The server is started with ``sys.executable -m sglang.launch_server`` on the given host and ports.
    Without CUDA it gets the CPU flags of ``CPU_SERVER_ARGS``, ``SGLANG_USE_CPU_ENGINE=1`` and the
    ``sgl_kernel`` stand-in on its ``PYTHONPATH``. Its stdout and stderr go to a log file in ``log_dir``
    whose tail is quoted in every start-up error. It streams incrementally (``--incremental-streaming-output``:
    each chunk of a streamed ``/generate`` holds only its new tokens).
    """

    kind = "SGLang server"

    def __init__(
        self,
        model_path: str | os.PathLike[str],
        *,
        host: str = "127.0.0.1",
        port: int,
        nccl_port: int | None = None,
        log_dir: str | os.PathLike[str],
        listen_host: str | None = None,
        extra_server_args: Sequence[str] = (),
        startup_timeout_s: float = 300.0,
        request_timeout_s: float = 600.0,
        env: Mapping[str, str] | None = None,
        cpu: bool | None = None,
        api_key: str | None = None,
        max_retries: int = DEFAULT_RETRIES,
        keep_alive_s: int = SERVER_KEEP_ALIVE_S,
    ) -> None:
        """Describe an engine; nothing starts until :meth:`start`.

        Args:
            model_path: HF checkpoint directory (config, tokenizer, safetensors) to serve.
            host: Address to listen on and to reach the server at (its URL); 127.0.0.1 keeps it off the network.
            listen_host: Address to listen on instead of ``host`` (e.g. 0.0.0.0: every interface), while clients
                still reach the server at ``host``.
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
            max_retries: Times a request is sent again after a transient failure while the process lives.
            keep_alive_s: Seconds the server keeps an idle connection open (``SGLANG_TIMEOUT_KEEP_ALIVE``;
                ``env`` may set it instead); this client closes its idle connections at half of it.

        Raises:
            ValueError: A bad port or timeout, or a non-loopback host without an API key.
        """
        if port <= 0 or port > 65535:
            raise ValueError(f"port must be in 1..65535, got {port}")
        exposed = [h for h in (listen_host or host, host) if h not in _LOOPBACK_HOSTS]
        if exposed and not api_key:
            raise ValueError(
                f"SGLang host {exposed[0]!r} is reachable from other machines and the server would accept any "
                "request; set --sglang-api-key (or keep the default host 127.0.0.1)"
            )
        env = dict(env or {})
        keep_alive_s = int(env.setdefault(KEEP_ALIVE_ENV, str(keep_alive_s)))
        if keep_alive_s < 1:
            raise ValueError(f"keep_alive_s ({KEEP_ALIVE_ENV}) must be >= 1 s, got {keep_alive_s}")
        log_dir = Path(log_dir)
        super().__init__(
            f"http://{host}:{port}",
            log_path=log_dir / f"sglang_{host}_{port}.log",
            startup_timeout_s=startup_timeout_s,
            request_timeout_s=request_timeout_s,
            api_key=api_key,
            max_retries=max_retries,
            max_idle_s=keep_alive_s / 2,
        )
        self.keep_alive_s = keep_alive_s
        self.model_path = str(model_path)
        self.host = host
        self.listen_host = listen_host or host
        self.port = port
        self.nccl_port = nccl_port
        self.log_dir = log_dir
        self.extra_server_args = tuple(extra_server_args)
        self.env = env
        self.cpu = cpu
        # The last weights loaded from disk, re-applied by restart() so that a restarted engine serves them.
        self._disk_weights: dict[str, Any] | None = None
        self._warned_memory_saver = False
        self.on_restart: Callable[[], None] | None = None
        """Called by :meth:`restart` once the restarted server is healthy, before :meth:`restart` returns (so before
        any request is sent to it again): the owner puts the current weights back (they may have come as tensors
        or by broadcast, which the server cannot reload itself). An exception from it fails the restart."""

    @classmethod
    def from_config(
        cls,
        cfg: RolloutConfig,
        model_path: str | os.PathLike[str],
        *,
        port: int,
        nccl_port: int | None = None,
        log_dir: str | os.PathLike[str],
        env: Mapping[str, str] | None = None,
        listen_host: str | None = None,
    ) -> SGLangEngine:
        """An engine as ``cfg`` describes it, on the ports and in the log folder the caller's placement chose.

        ``cfg`` gives the host (``--sglang-host``), the pass-through server flags (``--sglang-*``), the start-up
        timeout, and the request timeout and retries; nothing starts until :meth:`start`. ``listen_host``: the
        address to bind when it is not the host (a wildcard such as 0.0.0.0 while the host is the node's address).
        """
        return cls(
            model_path,
            host=cfg.sglang_host or "127.0.0.1",
            listen_host=listen_host,
            api_key=cfg.sglang_api_key,
            port=port,
            nccl_port=nccl_port,
            log_dir=log_dir,
            extra_server_args=_with_routed_experts(cfg.sglang_server_args, cfg.return_routed_experts),
            startup_timeout_s=cfg.sglang_startup_timeout_s,
            request_timeout_s=cfg.rollout_request_timeout_s,
            max_retries=cfg.rollout_request_retries,
            env=env,
        )

    def command(self) -> list[str]:
        """The server command line this engine runs (CPU flags resolved)."""
        cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", self.model_path]
        cmd += ["--host", self.listen_host, "--port", str(self.port)]
        if self.nccl_port is not None:
            cmd += ["--nccl-port", str(self.nccl_port)]
        if self._api_key:
            cmd += ["--api-key", self._api_key]
        if "--custom-weight-loader" not in _flag_names(self.extra_server_args):
            cmd += ["--custom-weight-loader", DELTA_LOADER]  # only registers the name: deltas apply through it
        if "--incremental-streaming-output" not in _flag_names(self.extra_server_args):
            cmd += ["--incremental-streaming-output"]  # a streamed answer's chunks hold only their new tokens
        if self._use_cpu():
            given = _flag_names(self.extra_server_args)
            for flag in CPU_SERVER_ARGS:
                if flag[0] not in given:
                    cmd += flag
            if "--enable-lora" in given and "--lora-backend" not in given:
                cmd += CPU_LORA_BACKEND  # the default backend's kernels need CUDA
        return cmd + list(self.extra_server_args)

    def _use_cpu(self) -> bool:
        if self.cpu is None:
            self.cpu = not _cuda_available()
        return self.cpu

    def server_env(self) -> dict[str, str]:
        """This process's environment plus the CPU stand-in (without CUDA) and ``env``."""
        env = dict(os.environ)
        for name in CRASH_DIAGNOSTICS_ENV:  # unless the user asked for them (see the constant)
            env.setdefault(name, "0")
        if self._use_cpu():
            env["SGLANG_USE_CPU_ENGINE"] = "1"
            parts = [str(CPU_STUB_DIR), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
            env["PYTHONPATH"] = os.pathsep.join(parts)
        env.update(self.env)
        pin_gloo_interface(env, self.host)  # across nodes, gloo (weight broadcast on CPU) must not take loopback
        return env

    def start(self, *, wait: bool = True) -> None:
        """Launch the server (see :meth:`ManagedServer.start`).

        When its imports would compile from source in each of its processes (no bytecode, PYTHONDONTWRITEBYTECODE
        set), the environment's bytecode is compiled first, once (:func:`tidal.rollout.bytecode.compile_site_packages`).
        """
        env = self.server_env()
        if missing_bytecode_note(env) and compile_site_packages(env, package="sglang") is None:
            logger.warning(missing_bytecode_note(env))
        super().start(wait=wait)

    def restart(self) -> None:
        """Stop what is left of the server, start it again, reload the last disk weights, call :attr:`on_restart`.

        Weights pushed as tensors or by broadcast cannot be re-applied here: without :attr:`on_restart` the restarted
        server serves ``model_path`` (or the last ``update_weights_from_disk`` checkpoint) and reports that version.

        Raises:
            RolloutError: The server does not come back, or refuses the weights it served before.
        """
        super().restart()
        if self._disk_weights is not None:
            self.call("/update_weights_from_disk", self._disk_weights, what="reloading weights after a restart")
            logger.info("reloaded %s into the restarted server", self._disk_weights["model_path"])
        if self.on_restart is not None:
            self.on_restart()

    def update_weights_from_disk(self, path: str | os.PathLike[str], *, weight_version: str | None = None) -> None:
        """Load new weights from an HF checkpoint directory into the running server (cache flushed).

        Raises:
            RolloutError: The server refused the update; the message is the server's.
        """
        super().update_weights_from_disk(path, weight_version=weight_version)
        self._disk_weights = {"model_path": str(path)}
        if weight_version is not None:
            self._disk_weights["weight_version"] = weight_version

    def release_memory_occupation(self, tags: Sequence[str] | None = None) -> None:
        """Free the engine's weights and KV cache (co-located mode: the trainer needs the GPU memory).

        SGLang frees device memory only when `train` passes ``--sglang-enable-memory-saver`` (SGLang's memory
        saver: torch_memory_saver, CUDA only); without it the call runs the same protocol (the KV cache
        is flushed, the weights' buffers are stashed) and frees nothing, which is logged once (a warning on a GPU,
        an INFO line on CPU, where no memory saver exists). The server must
        be idle: abort or finish requests first. On CPU it runs for real: the sgl_kernel stand-in's
        ``CpuMemoryReleaseFinder`` keeps SGLang's trailing ``torch.cuda.synchronize()`` from killing the server.

        Args:
            tags: Subset of ``MEMORY_TAGS``; None frees all.

        Raises:
            ValueError: An unknown tag.
            RolloutError: The server refused.
        """
        payload = self._memory_payload(tags)
        self.call("/release_memory_occupation", payload, what="release_memory_occupation")
        if not self._warned_memory_saver and "--enable-memory-saver" not in _flag_names(self.extra_server_args):
            self._warned_memory_saver = True
            if self._use_cpu():  # the memory saver is CUDA-only: nothing to ask for, and nothing to free
                logger.info("%s: on CPU, release_memory_occupation frees no memory (as expected)", self.url)
            else:
                logger.warning(
                    "%s: release_memory_occupation frees no memory without --sglang-enable-memory-saver; "
                    "weights and KV cache stay allocated",
                    self.url,
                )

    def resume_memory_occupation(self, tags: Sequence[str] | None = None) -> None:
        """Re-allocate what :meth:`release_memory_occupation` freed (weights come back as they were).

        Raises:
            ValueError: An unknown tag.
            RolloutError: The server refused.
        """
        self.call("/resume_memory_occupation", self._memory_payload(tags), what="resume_memory_occupation")

    @staticmethod
    def _memory_payload(tags: Sequence[str] | None) -> dict[str, Any]:
        if tags is None:
            return {}
        unknown = sorted(set(tags) - set(MEMORY_TAGS))
        if unknown:
            raise ValueError(f"unknown memory tags {unknown}; SGLang knows {list(MEMORY_TAGS)}")
        return {"tags": list(tags)}

    def check_alive(self) -> None:
        """Raise unless the server process runs and answers ``/health``.

        Raises:
            RolloutError: Naming the engine, its port and the tail of its log.
        """
        if not self.is_running() or not self.health_ok():
            raise self.dead_error("is not running or not healthy")

    def describe(self) -> str:
        """How errors name this engine: URL, port, pid and model."""
        return f"{self.kind} at {self.url} (port {self.port}, pid {self.pid}, model {self.model_path})"
