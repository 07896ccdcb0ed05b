"""The Ray actor that hosts one SGLang engine (tidal.rollout) on its placement bundle.

It only holds the engine and forwards calls (generation, weight updates, memory release); under
--use-fault-tolerance it restarts a dead server and holds that server's requests until the driver gave it the
actor's current weights. The process sets its own log format (``[tidal engine PORT] ...``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

import ray
from tidal.train.logs import LogPlan, setup_logging

logger = logging.getLogger(__name__)


@ray.remote(max_concurrency=4)
class EngineWorker:
    """One SGLang server (tidal.rollout) started from its bundle, so it sees the bundle's GPUs.

    Threaded (``max_concurrency``): ``shutdown`` must reach the server while ``start`` still waits for it to
    become healthy (Ctrl-C during start-up), or the server would outlive its killed worker.
    """

    def __init__(
        self,
        rollout_cfg,
        model_path: str,
        *,
        port: int = 0,
        nccl_port: int | None = None,
        listen_host: str | None = None,
        log_dir: str,
        env: dict[str, str] | None = None,
        fault_tolerant: bool = False,
        resync_timeout_s: float | None = None,
        external_url: str | None = None,
        tp_size: int = 1,
        interruptible: bool = False,
        flush_after_update: bool = True,
        verbose: bool = False,
    ) -> None:
        setup_logging(f"engine {external_url or port}", LogPlan(log_dir=log_dir, verbose=verbose))
        from tidal.rollout import InterruptibleUpdates, SGLangClient, SGLangEngine

        self.fault_tolerant = fault_tolerant  # --use-fault-tolerance: restart a dead engine, resend its requests
        self.max_concurrency = rollout_cfg.generate_max_concurrency
        self.generate_fn = None
        if rollout_cfg.custom_generate_function_path:  # multi-turn / tool use: one call per sample
            from tidal.rollout import load_generate_fn

            self.generate_fn = load_generate_fn(rollout_cfg.custom_generate_function_path)
        env = dict(env or {})
        if os.environ.get("CUDA_VISIBLE_DEVICES"):
            env.setdefault("CUDA_VISIBLE_DEVICES", os.environ["CUDA_VISIBLE_DEVICES"])
        self.startup_timeout_s = rollout_cfg.sglang_startup_timeout_s
        self.tp_size = tp_size
        # --rollout-external-engine-addrs: a server someone else runs; tidal only talks to it (never starts,
        # restarts or stops it).
        self.external = external_url is not None
        self.engine = (
            SGLangClient.from_config(rollout_cfg, external_url)
            if self.external
            else SGLangEngine.from_config(
                rollout_cfg,
                model_path,
                port=port,
                nccl_port=nccl_port,
                log_dir=Path(log_dir),
                env=env,
                listen_host=listen_host,
            )
        )
        self.rollout_cfg = rollout_cfg  # its --rollout-health-check-* build the heartbeat once the server is up
        # --max-staleness >= 1: a weight update aborts the requests in flight; they resume under the new weights
        self.interrupt = InterruptibleUpdates(self.engine) if interruptible else None
        # SGLang flushes its cache in the update itself; the second flush waits for an idle server, which under
        # --max-staleness (requests of the next rollouts already running) it may not be.
        self.flush_after_update = flush_after_update
        self.heartbeat = None
        from tidal.rollout import ServedAdapters

        self.adapters = ServedAdapters(self.engine)  # --lora-rank: the adapters the server holds
        self.released: set[str] = set()
        """Memory tags the running server released (a restarted server released none: resuming one crashes it)."""
        # --use-fault-tolerance with an actor: a restarted server serves the weights it loads from disk, not the
        # actor's; it holds its requests until the driver synced the current ones (at most resync_timeout_s).
        self.resync_timeout_s = resync_timeout_s
        self._needs_weights = False
        self._weights_back = threading.Event()
        self._thread = threading.local()  # .generating: this thread runs generate_samples (threaded actor)
        if fault_tolerant and resync_timeout_s is not None and not self.external:
            self.engine.on_restart = self._await_weights
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_path)

    def start(self) -> str:
        """Launch the server (an external one: nothing to launch) and wait until it is healthy; returns its URL.

        Under --use-fault-tolerance a heartbeat then checks the server every --rollout-health-check-interval
        seconds and kills it when it misses one (a hung server): the next request restarts it.
        """
        if self.external:
            self.engine.wait_healthy(self.startup_timeout_s)
            logger.info(
                "external SGLang server %s serves %s", self.engine.url, self.engine.get_model_info().get("model_path")
            )
            return self.engine.url
        self.engine.start(wait=True)
        if self.fault_tolerant:
            from tidal.rollout import Heartbeat

            self.heartbeat = Heartbeat.from_config(
                self.rollout_cfg, self.engine, on_failure=lambda _: self.engine.kill()
            )
            if self.heartbeat is not None:
                self.heartbeat.start()
        return self.engine.url

    def ensure_alive(self) -> bool:
        """Under --use-fault-tolerance, restart the server if its process is gone; True when it restarted."""
        if self.external or not self.fault_tolerant or self.engine.is_running():
            return False
        logger.warning("%s is not running; restarting it (--use-fault-tolerance)", self.engine.describe())
        self.released.clear()
        self.engine.restart()
        if self.heartbeat is not None:
            self.heartbeat.resume()
        return True

    def _await_weights(self) -> None:
        """The restarted server's hook: it needs the actor's weights; while it generates, hold its requests.

        They go out again once the driver gave it the current weights (:meth:`weights_restored`).

        Raises:
            RolloutError: No weights came within --update-weight-timeout.
        """
        from tidal.rollout import RolloutError

        self.adapters.forget()  # a restarted server holds no adapter
        self.released.clear()  # nor released memory
        self._weights_back.clear()
        self._needs_weights = True
        if not getattr(self._thread, "generating", False):  # restarted by the driver, or by a disk sync: no hold
            return
        assert self.resync_timeout_s is not None
        tick = time.monotonic()
        while not self._weights_back.wait(timeout=min(30.0, self.resync_timeout_s)):
            waited = time.monotonic() - tick
            if waited >= self.resync_timeout_s:
                raise RolloutError(
                    f"{self.engine.describe()} restarted but got no weights from the actor within "
                    f"--update-weight-timeout {self.resync_timeout_s:.0f} s"
                )
            logger.info("%s restarted: its requests wait for the current weights (%.0f s)", self.engine.url, waited)

    def needs_weights(self) -> bool:
        """Whether the server restarted since it last got the actor's weights."""
        return self._needs_weights

    def weights_restored(self) -> None:
        """The server serves the current weights again: release the requests held since its restart."""
        self._needs_weights = False
        self._weights_back.set()

    def pid(self) -> int | None:
        """Process id of the server (its process group leader); None for an external server."""
        return None if self.external else self.engine.pid

    def generate_samples(
        self, prompts: list[list[int]], sampling_params: dict[str, Any], labels: list
    ) -> tuple[list, float]:
        """One batched generation wrapped as unscored Samples (tidal.rollout.generate_samples); and its seconds."""
        tick = time.monotonic()
        self._thread.generating = True  # a restart in this thread holds the requests until the weights are back
        try:
            return self._generate_samples(prompts, sampling_params, labels), time.monotonic() - tick
        finally:
            self._thread.generating = False

    def _generate_samples(self, prompts: list[list[int]], sampling_params: dict[str, Any], labels: list) -> list:
        from tidal.rollout import generate_samples

        self.ensure_alive()

        def generate() -> list:
            return generate_samples(
                self.engine,
                prompts,
                sampling_params,
                labels=labels,
                decode=self._decode,
                generate_fn=self.generate_fn,
                max_concurrency=self.max_concurrency,
                max_restarts=1 if self.fault_tolerant else 0,
            )

        if self.interrupt is None:
            samples = generate()
        else:
            samples = self.interrupt.generate(generate, sampling_params, decode=self._decode)
        if self.heartbeat is not None:  # a restart during generation ends a paused heartbeat's pause
            self.heartbeat.resume()
        return samples

    def http_retries(self) -> int:
        """Requests to this engine sent again after a transient failure, since it started (only grows)."""
        return self.engine.http_retries

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def begin_update(self) -> None:
        """--max-staleness >= 1: a weight update starts (any transport): abort the requests in flight.

        They resume under the new weights after :meth:`end_update` (this worker's own generation), or are sent
        again at once by the driver (its partial-rollout and router paths), which SGLang serves after the update.
        """
        if self.interrupt is not None:
            self.interrupt.begin()

    def end_update(self) -> None:
        """The update :meth:`begin_update` announced is in: the requests it cut resume."""
        if self.interrupt is not None:
            self.interrupt.end()

    def update_weights_from_disk(self, path: str, weight_version: str) -> None:
        """Reload weights from an HF checkpoint directory and flush the prefix cache.

        A server that died (or stopped answering through every retry) is restarted and loaded under
        --use-fault-tolerance; otherwise the error is one line naming the server and its log.
        """
        if self.interrupt is not None:  # abort the requests in flight first (they resume after the update)
            self.interrupt.update(lambda: self._update_weights_from_disk(path, weight_version))
        else:
            self._update_weights_from_disk(path, weight_version)

    def _update_weights_from_disk(self, path: str, weight_version: str) -> None:
        from tidal.rollout import EngineUnavailableError

        self.ensure_alive()
        try:
            self.engine.update_weights_from_disk(path, weight_version=weight_version)
        except EngineUnavailableError as e:
            if self.external:
                raise
            if not self.fault_tolerant:
                raise self.engine.dead_error(
                    f"failed while loading weights {path} ({e}) (--use-fault-tolerance restarts it)"
                ) from e
            logger.warning("%s failed while loading weights (%s); restarting it", self.engine.describe(), e)
            self.released.clear()
            self.engine.restart()
            self.engine.update_weights_from_disk(path, weight_version=weight_version)
        self.weights_restored()  # it serves the sync's weights, restarted or not
        if self.flush_after_update:
            self.engine.flush_cache()

    def serve_adapter(self, name: str, version: str, path: str | None = None) -> None:
        """--lora-rank: serve LoRA adapter ``name`` as ``version`` (``path``: load it from that PEFT folder first).

        Every later ``/generate`` of this engine names it; the adapters before the previous one are unloaded.
        """
        if path is not None:  # a tensor-loaded adapter would be gone from a server restarted here
            self.ensure_alive()
        self.adapters.serve(name, version, path=path)
        self.weights_restored()  # it serves the sync's adapter, restarted or not
        if self.flush_after_update:
            self.engine.flush_cache()

    def weight_target(self, timeout_s: float) -> dict[str, Any]:
        """How the actor reaches this engine for weight updates: URL, API key, TP size, the sync's bound."""
        api_key = getattr(self.engine, "_api_key", None)
        return {"url": self.engine.url, "api_key": api_key, "tp_size": self.tp_size, "timeout_s": timeout_s}

    def weight_version(self) -> str | None:
        """The weight version the server reports now."""
        return self.engine.get_model_info().get("weight_version")

    def release_memory(self, tags: list[str]) -> None:
        """Wait until the server is idle (an aborted request may still be finishing), then release ``tags``."""
        self.engine.flush_cache()
        self.engine.release_memory_occupation(tags)
        self.released |= set(tags)

    def resume_memory(self, tags: list[str]) -> None:
        """Re-allocate what :meth:`release_memory` freed.

        A tag this server never released (it restarted since) is skipped: SGLang's scheduler dies on resuming memory
        it did not release.
        """
        tags = [t for t in tags if t in self.released]
        if tags:
            self.engine.resume_memory_occupation(tags)
            self.released -= set(tags)

    def probe(self, prompts: list[list[int]], sampling_params: dict[str, Any]) -> list[tuple[list[int], list[float]]]:
        """``(prompt + response tokens, response log-probs)`` of one sample per prompt (the parity probe)."""
        outs = self.engine.generate(prompts, {**sampling_params, "n": 1})
        return [(list(p) + o["output_ids"], o["output_log_probs"]) for p, o in zip(prompts, outs, strict=True)]

    def shutdown(self) -> None:
        """Stop the heartbeat, then the server and every process it started (an external server is left running)."""
        if self.heartbeat is not None:
            self.heartbeat.stop()
        if not self.external:
            self.engine.shutdown()
