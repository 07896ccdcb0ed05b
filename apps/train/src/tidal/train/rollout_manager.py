"""The rollout side behind one handle: generate a rollout, evaluate, load weights into the engines, count retries.

The engines are ``EngineWorker`` Ray actors on their placement bundles (or clients of servers run elsewhere),
optionally behind an sglang-router. A rollout comes from one of three paths, chosen here from the config:

- replay: ``--load-debug-rollout-data`` reads saved samples (no engine runs);
- driver-side (``DriverRollouts``): partial rollout, dynamic sampling, or a router in front: the driver sends the
  requests itself and sees every group as it finishes;
- plain: the prompts are split across the engines, each generates its share in one batched request inside its
  Ray actor, and the driver scores them.

It lives in the app, not in tidal-rollout, because it joins that package to Ray and the placement; tidal-rollout
stays usable without either.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ray
from tidal.train.driver_rollouts import DriverRollouts
from tidal.train.workers import EngineWorker

if TYPE_CHECKING:
    from tidal.train.config import JobConfig
    from tidal.train.data import Prompt, PromptDataset

logger = logging.getLogger(__name__)


class RolloutManager:
    """Engines (launched or external), the router and the generation path of a job.

    Built by :meth:`start` and :meth:`wait_ready`; :meth:`shutdown` stops what it started.
    """

    def __init__(self, job: JobConfig, train_data: PromptDataset, *, log_dir: Path) -> None:
        """Describe the rollout side; nothing starts until :meth:`start`."""
        from tidal.rollout import resolve_reward_fn

        self.job, self.cfg, self.data, self.log_dir = job, job.rollout, train_data, log_dir
        self.reward_fn = resolve_reward_fn(self.cfg.custom_rm_path or self.cfg.rm_type)
        self.engines: list = []
        self.engine_urls: list[str] = []
        self.engine_pids: list[int] = []
        self.router = None
        self.driver_client = None
        """The driver's own client of the one engine (partial rollout, DAPO without a router); made on first use."""
        self._starting: list = []
        self._placement = None
        self.driver = DriverRollouts(job, self, train_data, self.reward_fn, tokenizer=train_data.tokenizer)

    @property
    def has_engines(self) -> bool:
        """Whether engines serve this job (not under --debug-train-only or --load-debug-rollout-data)."""
        return bool(self.engines)

    @property
    def external(self) -> bool:
        """Whether the engines are servers run elsewhere (--rollout-external-engine-addrs)."""
        return self.has_engines and bool(self.cfg.rollout_external_engine_addrs)

    def start(self, placement) -> None:
        """Create the engines' workers and begin their start-up (external ones: wait for health); returns at once."""
        from tidal.placement import PortAllocator

        self._placement = placement
        model, logs, cfg = self.job.actor.hf_checkpoint, str(self.log_dir), self.cfg
        for url in cfg.external_engine_urls():  # run elsewhere: no bundle needed
            flush = self.job.train.max_staleness == 0
            worker = EngineWorker.options(num_cpus=0).remote(
                cfg, model, log_dir=logs, external_url=url, flush_after_update=flush
            )
            self._launch(worker)
        for e in range(0 if cfg.rollout_external_engine_addrs else self.job.placement.num_engines):
            ports = PortAllocator(placement.engine_node_ip(e)).engine_ports()
            worker = EngineWorker.options(**placement.engine_options(e)).remote(
                cfg,
                model,
                port=ports.http_port,
                nccl_port=ports.nccl_port,
                log_dir=logs,
                env=dict(self.job.placement.ray_env),
                fault_tolerant=self.job.train.use_fault_tolerance,
                interruptible=self._interruptible(),
                flush_after_update=self.job.train.max_staleness == 0,
            )
            self._launch(worker)

    def _interruptible(self) -> bool:
        """Whether a weight update aborts and resumes the requests in flight: --max-staleness >= 1 on the plain path.

        Not on the driver-side path (partial rollout carries aborted groups over itself), not for a custom generate
        function (a multi-turn sample cannot be resumed as one continuation), never for a server run elsewhere.
        """
        cfg, engines = self.cfg, self.job.placement.num_engines
        driver_side = cfg.partial_rollout or cfg.dynamic_sampling_filter_path is not None or cfg.router_wanted(engines)
        return self.job.train.max_staleness > 0 and not driver_side and not cfg.custom_generate_function_path

    def _launch(self, worker) -> None:
        self.engines.append(worker)
        self._starting.append(worker.start.remote())

    def wait_ready(self) -> None:
        """Wait until every engine is healthy; then start the router when the config wants one."""
        from tidal.placement import PortAllocator
        from tidal.rollout import RolloutRouter

        self.engine_urls = ray.get(self._starting)
        self.engine_pids = [pid for pid in ray.get([e.pid.remote() for e in self.engines]) if pid is not None]
        if self.engines and self.cfg.router_wanted(len(self.engines)):
            port = PortAllocator(self._placement.engine_node_ip(0)).engine_ports().http_port
            router = RolloutRouter.from_config(self.cfg, self.engine_urls, port=port, log_dir=self.log_dir)
            self.router = router  # before start(): a start-up that fails or is interrupted still stops it
            router.start()

    def generate(self, rollout_id: int) -> tuple[list, dict[str, float]]:
        """Rollout ``rollout_id``'s scored samples (prompt-major order) and its ``time/*`` metrics.

        Saves the samples under --save-debug-rollout-data.
        """
        from tidal.rollout import load_rollout_data, save_rollout_data

        tick = time.monotonic()
        extra: dict[str, float] = {}
        if self.cfg.load_debug_rollout_data:
            samples, engine_s = load_rollout_data(self.cfg.load_debug_rollout_data, rollout_id), None
        elif self.driver.driver_side:
            (samples, extra), engine_s = self.driver.generate(rollout_id), None
        else:
            prompts = self.data.batch(rollout_id, self.job.batching.rollout_batch_size)
            samples, engine_s = self._generate_on_engines(prompts, self.cfg.sampling_params())
        times = {"time/generate": time.monotonic() - tick}
        if not self.cfg.load_debug_rollout_data:  # the driver-side path waits on the engines all along
            times["time/generate_engine"] = times["time/generate"] if engine_s is None else engine_s
        times.update(extra)
        if self.cfg.save_debug_rollout_data:
            save_rollout_data(self.cfg.save_debug_rollout_data, rollout_id, samples)
        return samples, times

    def evaluate(self, prompts: list[Prompt]) -> float:
        """Greedy accuracy (mean reward) on the held-out ``prompts``."""
        params = {**self.cfg.sampling_params(), "n": 1, "temperature": 0.0}
        samples, _ = self._generate_on_engines(prompts, params)
        return sum(float(s.reward) for s in samples) / len(samples)

    def _generate_on_engines(self, prompts: list[Prompt], sampling_params: dict) -> tuple[list, float]:
        """Prompts split across engines; samples scored, in prompt-major order; also the slowest engine's own time."""
        from tidal.rollout import score_samples

        shares = [list(range(e, len(prompts), len(self.engines))) for e in range(len(self.engines))]
        futures = [
            engine.generate_samples.remote(
                [list(prompts[g].ids) for g in share], sampling_params, [prompts[g].label for g in share]
            )
            for engine, share in zip(self.engines, shares, strict=True)
        ]
        results = ray.get(futures)
        samples = [
            dataclasses.replace(s, group_index=share[s.group_index])
            for share, (part, _) in zip(shares, results, strict=True)
            for s in part
        ]
        samples.sort(key=lambda s: s.group_index)  # stable: samples of a group stay together, in order
        return score_samples(samples, self.reward_fn), max(seconds for _, seconds in results)

    def load_weights(self, path: str | Path, version: int) -> None:
        """Every engine reloads its weights from the HF checkpoint at ``path`` and serves them as ``version``."""
        ray.get([e.update_weights_from_disk.remote(str(path), str(version)) for e in self.engines])

    def http_retries(self) -> int:
        """Requests sent again after a transient failure so far, by every client (engines, router, driver)."""
        total = sum(ray.get([e.http_retries.remote() for e in self.engines])) if self.engines else 0
        return total + sum(c.http_retries for c in (self.router, self.driver_client) if c is not None)

    def carry_state(self) -> list[list[dict[str, Any]]] | None:
        """Partial rollout's unfinished groups as plain data for the checkpoint (None when nothing is carried)."""
        return self.driver.carry_state()

    def restore_carry(self, state: list[list[dict[str, Any]]] | None) -> None:
        """Continue the unfinished groups a checkpoint carried (see ``DriverRollouts.restore_carry``)."""
        self.driver.restore_carry(state)

    def driver_target(self):
        """Where the driver sends requests itself: the router, or the one engine's URL (partial rollout, DAPO)."""
        from tidal.rollout import SGLangClient

        if self.router is not None:
            return self.router
        if len(self.engine_urls) > 1:
            raise ValueError(
                f"--partial-rollout / --dynamic-sampling-filter-path with {len(self.engine_urls)} engines send every "
                "request through the router: drop --no-use-router"
            )
        if self.driver_client is None:  # one client for the run: its pooled connections and retry count persist
            self.driver_client = SGLangClient.from_config(self.cfg, self.engine_urls[0])
        return self.driver_client

    def restart_dead_engines(self) -> None:
        """Under --use-fault-tolerance: restart the engines whose server died, then the router."""
        restarted = ray.get([engine.ensure_alive.remote() for engine in self.engines])
        if self.router is not None:
            self.router.restart()
        logger.info("restarted %d engine(s)%s", sum(restarted), " and the router" if self.router else "")

    def shutdown(self) -> None:
        """Stop the router, then each engine's server (its process group), then the engines' workers."""
        if self.router is not None:
            self.router.shutdown()
        for engine in self.engines:
            try:
                ray.get(engine.shutdown.remote(), timeout=60)
            except Exception as e:  # keep stopping the rest
                logger.warning("engine shutdown failed: %s", e)
        for engine in self.engines:
            ray.kill(engine, no_restart=True)
