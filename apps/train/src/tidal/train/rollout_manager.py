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
import os
import secrets
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ray
from tidal.train.driver_rollouts import DriverRollouts
from tidal.train.engine_worker import EngineWorker

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from tidal.placement import PlacementConfig
    from tidal.rollout import RolloutConfig
    from tidal.train.async_plan import AsyncPlan
    from tidal.train.config import EvalConfig
    from tidal.train.data import Prompt, PromptDataset
    from tidal.train.handoff import HandOffLog
    from tidal.train.weight_sync import SyncPlan

PROBE_PROMPTS = 4
"""Training prompts (the first ones, a fixed set) --check-weight-update-equal samples after each sync."""
RESYNC_POLL_S = 2.0
"""While engines generate under --use-fault-tolerance, how often the driver asks whether one restarted."""

logger = logging.getLogger(__name__)

LOOPBACK = ("127.0.0.1", "localhost", "::1")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class RolloutRun:
    """What the rollout side needs of the run around it (from the train, logging and sync sections)."""

    run_dir: Path
    """The run folder (the engines' API key is kept there)."""
    log_dir: Path
    """Where the engines' log files go."""
    verbose: bool = False
    """The engines' INFO lines also reach the terminal (--verbose)."""
    fault_tolerant: bool = False
    """Restart a dead engine and resend its requests (--use-fault-tolerance)."""
    resync_timeout: float | None = None
    """How long a restarted engine waits for the actor's weights (--update-weight-timeout); None: no actor."""


def _new_api_key(run_dir: Path) -> str:
    """A key for this run's servers, router and clients, kept only in ``run_dir/sglang_api_key`` (mode 0600)."""
    key = secrets.token_hex(32)  # not token_urlsafe: a key starting with "-" reads as a flag to SGLang's parser
    run_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(run_dir / "sglang_api_key", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)  # also when the file was there already
    with os.fdopen(fd, "w") as f:
        f.write(key + "\n")
    logger.info("SGLang servers listen on node addresses: API key generated, in %s", run_dir / "sglang_api_key")
    return key


def eval_sampling_params(rollout, evaluation) -> dict[str, Any]:
    """The rollout's sampling parameters with evaluation's n, temperature, top-p and length (``--eval-*``)."""
    params = {**rollout.sampling_params(), "n": evaluation.n_samples_per_eval_prompt}
    params.pop("return_routed_experts", None)  # evaluation trains on nothing
    params |= {"temperature": evaluation.eval_temperature, "top_p": evaluation.eval_top_p}
    if evaluation.eval_max_response_len is not None:
        params["max_new_tokens"] = evaluation.eval_max_response_len
    return params


class RolloutManager:
    """Engines (launched or external), the router and the generation path of a job.

    Built by :meth:`start` and :meth:`wait_ready`; :meth:`shutdown` stops what it started.
    """

    def __init__(
        self,
        rollout: RolloutConfig,
        placement: PlacementConfig,
        evaluation: EvalConfig,
        train_data: PromptDataset,
        *,
        model: str,
        rollout_batch_size: int,
        run: RolloutRun,
        async_plan: AsyncPlan,
        plan: SyncPlan | None = None,
        handoff: HandOffLog | None = None,
    ) -> None:
        """Describe the rollout side of the engines serving ``model``; nothing starts until :meth:`start`.

        ``plan`` says whether the engines release their memory while the actor trains (--offload-rollout);
        ``async_plan`` whether a weight update interrupts generation; ``handoff`` records those calls.
        """
        from tidal.rollout import UpdateGate, resolve_reward_fn
        from tidal.train.handoff import HandOffLog

        self.cfg, self.placement_cfg, self.eval_cfg, self.data = rollout, placement, evaluation, train_data
        self.model, self.rollout_batch_size, self.run = model, rollout_batch_size, run
        self.log_dir = run.log_dir
        self.offload = plan is not None and plan.offload_rollout
        self.adapter = plan.adapter if plan is not None else None  # --lora-rank: the engines serve LoRA adapters
        self.lora_name: str | None = None
        """The LoRA adapter every engine serves now (None: the base model)."""
        self.async_plan = async_plan
        self.update_gate = UpdateGate()
        """Open while no interruptible update runs: the driver's requests an update cut wait here (the gateway)."""
        self.handoff = handoff or HandOffLog(None)
        self._released: list[str] = []  # memory tags the engines have released now
        self.reward_fn = resolve_reward_fn(self.cfg.custom_rm_path or self.cfg.rm_type, self.cfg)
        self.engines: list = []
        self.engine_urls: list[str] = []
        self.engine_pids: list[int] = []
        self.router = None
        self.driver_client = None
        """The driver's own client of the one engine (partial rollout, DAPO without a router); made on first use."""
        self._clients: list = []  # every client engine_client made: serve_adapter names the adapter on each
        self._starting: list = []
        self.weight_source: Callable[[RestartedEngines], Any] | None = None
        """Gives restarted engines the current weights (the actor group's ``resync``); None: no actor."""
        self.driver = DriverRollouts(
            rollout,
            self,
            train_data,
            self.reward_fn,
            rollout_batch_size=rollout_batch_size,
            fault_tolerant=run.fault_tolerant,
            tokenizer=train_data.tokenizer,
        )

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
        from tidal.rollout import WILDCARD_HOSTS, with_engine_tp

        model, logs, cfg = self.model, str(self.log_dir), self.cfg
        for url in cfg.external_engine_urls():  # run elsewhere: no bundle needed
            flush = self.async_plan.flush_after_update
            worker = EngineWorker.options(num_cpus=0).remote(
                cfg, model, log_dir=logs, external_url=url, flush_after_update=flush, verbose=self.run.verbose
            )
            self._launch(worker)
        hosts = [self._engine_host(placement, e) for e in range(self.placement_cfg.num_engines)]
        if cfg.sglang_api_key is None and any(h not in LOOPBACK for h in hosts):
            self.cfg = cfg = dataclasses.replace(cfg, sglang_api_key=_new_api_key(self.run.run_dir))
        if self.adapter is not None:  # the engines start on the base and take each adapter at run time
            cfg = dataclasses.replace(cfg, sglang_server_args=cfg.sglang_server_args + self.adapter.server_args(
                cfg.sglang_server_args))  # fmt: skip
        # each engine's tensor parallelism spans its GPUs
        tp_args = with_engine_tp(cfg.sglang_server_args, self.placement_cfg.rollout_num_gpus_per_engine)
        cfg = dataclasses.replace(cfg, sglang_server_args=tp_args)
        for e, host in enumerate(hosts):  # none with external engines
            ports = PortAllocator(placement.engine_node_ip(e)).engine_ports()
            worker = EngineWorker.options(**placement.engine_options(e)).remote(
                dataclasses.replace(cfg, sglang_host=host),
                model,
                listen_host=cfg.sglang_host if cfg.sglang_host in WILDCARD_HOSTS else None,
                port=ports.http_port,
                nccl_port=ports.nccl_port,
                log_dir=logs,
                env=dict(self.placement_cfg.ray_env),
                fault_tolerant=self.run.fault_tolerant,
                resync_timeout_s=self._resync_timeout(),
                tp_size=self.placement_cfg.rollout_num_gpus_per_engine,
                interruptible=self.async_plan.interruptible_updates,
                flush_after_update=self.async_plan.flush_after_update,
                verbose=self.run.verbose,
            )
            self._launch(worker)

    def _engine_host(self, placement, engine: int) -> str:
        """Where the engine is reached: ``--sglang-host``, else loopback on a one-node job, else its node address.

        A wildcard ``--sglang-host`` (0.0.0.0, ::) is where the server listens, not an address another node can
        send to: the engine is then reached at its node's address.
        """
        from tidal.rollout import WILDCARD_HOSTS

        if self.cfg.sglang_host in WILDCARD_HOSTS:
            return placement.engine_node_ip(engine)
        if self.cfg.sglang_host:
            return self.cfg.sglang_host
        nodes = {b.node_ip for b in placement.bundles} | {ray.util.get_node_ip_address()}  # the driver's too
        return placement.engine_node_ip(engine) if len(nodes) > 1 else "127.0.0.1"

    def _resync_timeout(self) -> float | None:
        """How long a restarted engine waits for its weights from the actor (None: there is no actor)."""
        return self.run.resync_timeout

    def begin_update(self) -> None:
        """A weight sync starts: interruptible engines abort their requests in flight (``AsyncPlan``)."""
        if self.engines and self.async_plan.interruptible_updates:
            self.update_gate.begin()  # before the abort: what it cuts waits for the update
            try:
                ray.get([e.begin_update.remote() for e in self.engines])
            except BaseException:
                self.update_gate.end()
                raise

    def end_update(self) -> None:
        """The sync :meth:`begin_update` announced is done: the requests it cut resume under the new weights."""
        if self.engines and self.async_plan.interruptible_updates:
            try:
                ray.get([e.end_update.remote() for e in self.engines])
            finally:
                self.update_gate.end()

    def _launch(self, worker) -> None:
        self.engines.append(worker)
        self._starting.append(worker.start.remote())

    def wait_ready(self) -> None:
        """Wait until every engine is healthy; then start the router when the config wants one."""
        from tidal.placement import PortAllocator
        from tidal.rollout import RolloutRouter

        if self.engines:  # none for replayed rollouts or external servers: then no Ray call (none may be running)
            self.engine_urls = ray.get(self._starting)
            self.engine_pids = [pid for pid in ray.get([e.pid.remote() for e in self.engines]) if pid is not None]
        if self.engines and self.cfg.router_wanted(len(self.engines)):
            port = PortAllocator().engine_ports().http_port  # the router runs here, in the driver
            router = RolloutRouter.from_config(self.cfg, self.engine_urls, port=port, log_dir=self.log_dir)
            self.router = router  # before start(): a start-up that fails or is interrupted still stops it
            router.start()

    def generate(self, rollout_id: int) -> tuple[list, dict[str, float]]:
        """Rollout ``rollout_id``'s scored samples (prompt-major order) and its ``time/*`` metrics.

        Saves the samples under --save-debug-rollout-data.
        """
        from tidal.rollout import load_rollout_data, save_rollout_data

        tick = time.monotonic()
        self.handoff.rollout = rollout_id
        self.resume_memory(["weights", "kv_cache"])  # released and no sync since (--update-weights-interval > 1)
        extra: dict[str, float] = {}
        if self.cfg.load_debug_rollout_data:
            samples, engine_s = load_rollout_data(self.cfg.load_debug_rollout_data, rollout_id), None
        elif self.driver.driver_side:
            (samples, extra), engine_s = self.driver.generate(rollout_id), None
        else:
            prompts = self.data.batch(rollout_id, self.rollout_batch_size)
            samples, engine_s = self._generate_on_engines(prompts, self.cfg.sampling_params())
        times = {"time/generate": time.monotonic() - tick}
        if not self.cfg.load_debug_rollout_data:  # the driver-side path waits on the engines all along
            times["time/generate_engine"] = times["time/generate"] if engine_s is None else engine_s
        times.update(extra)
        self.handoff.add("engines.generate")
        if self.offload and self.has_engines:  # the actor trains next: hand it the memory
            self.release_memory()
        if self.cfg.save_debug_rollout_data:
            save_rollout_data(self.cfg.save_debug_rollout_data, rollout_id, samples)
        return samples, times

    def release_memory(self) -> None:
        """Every engine releases its weights and KV cache (--offload-rollout), once idle."""
        tags = ["weights", "kv_cache"]
        self.driver.hold_agent_calls()  # carried agent groups run on: their calls wait until the engines are back
        ray.get([e.release_memory.remote(tags) for e in self.engines])
        self._released = tags
        self.handoff.add("engines.release")

    def resume_memory(self, tags: list[str]) -> None:
        """Every engine re-allocates those of ``tags`` it released (weights before the sync, KV cache after)."""
        tags = [t for t in tags if t in self._released]
        if not tags:
            return
        ray.get([e.resume_memory.remote(tags) for e in self.engines])
        self._released = [t for t in self._released if t not in tags]
        if not self._released:
            self.driver.release_agent_calls()
        self.handoff.add("engines.resume." + "+".join(tags))

    def weight_targets(self, timeout_s: float, *, only: Sequence[int] | None = None) -> list[dict[str, Any]]:
        """Per engine (of ``only``): URL, API key, TP size and ``timeout_s`` (the actor's rank 0 sends there)."""
        return ray.get([e.weight_target.remote(timeout_s) for e in self._some(only)])

    def check_weight_version(self, version: int, *, only: Sequence[int] | None = None) -> None:
        """Raise unless every engine (of ``only``) reports weight version ``version`` (a sync that did not apply).

        Raises:
            RolloutError: naming each engine and the version it reports.
        """
        from tidal.rollout import RolloutError

        seen = ray.get([e.weight_version.remote() for e in self._some(only)])
        urls = self.engine_urls if only is None else [self.engine_urls[i] for i in only]
        wrong = [f"{url}: {v!r}" for url, v in zip(urls, seen, strict=True) if v != str(version)]
        if wrong:
            raise RolloutError(f"after the weight sync of version {version} engines report {', '.join(wrong)}")

    def probe(self, *, only: Sequence[int] | None = None) -> list[list[tuple[list[int], list[float]]]]:
        """Per engine (of ``only``), one sample of each of the first training prompts: ``(tokens, log-probs)``."""
        prompts = [list(p.ids) for p in self.data.head(PROBE_PROMPTS)]
        params = {**self.cfg.sampling_params(), "max_new_tokens": 8}
        return ray.get([e.probe.remote(prompts, params) for e in self._some(only)])

    def _some(self, only: Sequence[int] | None) -> list:
        return self.engines if only is None else [self.engines[i] for i in only]

    def evaluate(self, held_out: dict[str, list[Prompt]]) -> dict[str, float]:
        """mean@k and pass@k of each held-out set (``eval/<name>/...``); the first set's mean@k as ``eval/accuracy``.

        Sampling: ``--n-samples-per-eval-prompt`` responses per prompt at ``--eval-temperature`` (0: greedy),
        ``--eval-top-p``, at most ``--eval-max-response-len`` tokens. With ``--agent-function-path`` each response
        is an agent episode (every call sampled so) and its reward the episode's; failed ones count as 0
        (``eval/<name>/agent_failed``).
        """
        from tidal.train.metrics import eval_metrics

        n = self.eval_cfg.n_samples_per_eval_prompt
        params = eval_sampling_params(self.cfg, self.eval_cfg)
        self.resume_memory(["weights", "kv_cache"])
        out: dict[str, float] = {}
        for index, (name, prompts) in enumerate(held_out.items()):
            if self.driver.agent_fn is not None:  # the agent's episodes, each scored by its own reward
                rewards, failed = self.driver.evaluate_agents(prompts, n, params)
                out[f"eval/{name}/agent_failed"] = float(failed)
            else:
                samples, _ = self._generate_on_engines(prompts, params)
                rewards = [[float(s.reward) for s in samples[i : i + n]] for i in range(0, len(samples), n)]
            metrics = eval_metrics(name, rewards)
            if index == 0:
                out["eval/accuracy"] = metrics[f"eval/{name}/mean@{n}"]
            out |= metrics
        return out

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
        results = self._wait_resyncing(futures)
        samples = [
            dataclasses.replace(s, group_index=share[s.group_index], metadata=prompts[share[s.group_index]].metadata)
            for share, (part, _) in zip(shares, results, strict=True)
            for s in part
        ]
        samples.sort(key=lambda s: s.group_index)  # stable: samples of a group stay together, in order
        return score_samples(samples, self.reward_fn), max(seconds for _, seconds in results)

    def _wait_resyncing(self, futures: list) -> list:
        """``ray.get(futures)``; meanwhile (--use-fault-tolerance) give engines that restarted the current weights.

        A restarted engine holds its requests until :meth:`resync_restarted` gave it the weights.
        """
        if self.weight_source is None or not self.run.fault_tolerant:
            return ray.get(futures)
        while ray.wait(futures, num_returns=len(futures), timeout=RESYNC_POLL_S)[1]:
            self.resync_restarted()
        return ray.get(futures)

    def resync_restarted(self) -> list[int]:
        """Give every engine that restarted since its last weights the actor's current ones; their indices.

        Each such engine has waited (its requests held) since its restart; it serves again once this returns.
        """
        if self.weight_source is None:
            return []
        stale = [i for i, s in enumerate(ray.get([e.needs_weights.remote() for e in self.engines])) if s]
        if stale:
            logger.warning(
                "engine(s) %s restarted: syncing the current weights into them", [self.engine_urls[i] for i in stale]
            )
            self.weight_source(RestartedEngines(self, stale))
            ray.get([self.engines[i].weights_restored.remote() for i in stale])
        return stale

    def load_weights(self, path: str | Path, version: int, *, only: Sequence[int] | None = None) -> None:
        """Every engine (of ``only``) reloads the HF checkpoint at ``path`` and serves it as ``version``."""
        ray.get([e.update_weights_from_disk.remote(str(path), str(version)) for e in self._some(only)])

    def serve_adapter(self, name: str, version: int, path: str | None = None, *, only: Sequence[int] | None = None):
        """Every engine (of ``only``) serves LoRA adapter ``name`` as ``version`` (``path``: its PEFT folder first).

        Every later ``/generate`` names it: the engines' own, the router's, the driver's and the agent gateways'.
        """
        engines = self._some(only)
        if engines:
            ray.get([e.serve_adapter.remote(name, str(version), path) for e in engines])
        self.lora_name = name
        for client in self._driver_clients():
            client.lora_name = name

    def engine_client(self, url: str):
        """An SGLang client of the engine at ``url`` for the driver (the driver's own, the agent gateways').

        The one place the driver makes such a client: the run's API key, request timeout and retries, and the LoRA
        adapter the engines serve now; :meth:`serve_adapter` names each later adapter on every client made here.
        """
        from tidal.rollout import SGLangClient

        client = SGLangClient.from_config(self.cfg, url)
        client.lora_name = self.lora_name
        self._clients.append(client)
        return client

    def _driver_clients(self) -> list:
        """The router's client, if any, and every client :meth:`engine_client` made."""
        return ([self.router] if self.router is not None else []) + self._clients

    def http_retries(self) -> int:
        """Requests sent again after a transient failure so far, by every client (engines, router, driver, agents)."""
        total = sum(ray.get([e.http_retries.remote() for e in self.engines])) if self.engines else 0
        return total + sum(c.http_retries for c in self._driver_clients())

    def carry_state(self) -> list | None:
        """Partial rollout's carried groups as plain data for the checkpoint (None when nothing is carried)."""
        return self.driver.carry_state()

    def restore_carry(self, state: list | None) -> None:
        """Continue the unfinished groups a checkpoint carried (see ``DriverRollouts.restore_carry``)."""
        self.driver.restore_carry(state)

    def driver_target(self):
        """Where the driver sends requests itself: the router, or the one engine's URL (partial rollout, DAPO)."""
        if self.router is not None:
            return self.router
        if len(self.engine_urls) > 1:
            raise ValueError(
                f"--partial-rollout / --dynamic-sampling-filter-path with {len(self.engine_urls)} engines send every "
                "request through the router: drop --no-use-router"
            )
        if self.driver_client is None:  # one client for the run: its pooled connections and retry count persist
            self.driver_client = self.engine_client(self.engine_urls[0])
        return self.driver_client

    def restart_dead_engines(self) -> int:
        """Under --use-fault-tolerance: restart the engines whose server died, sync them, then the router; how many.

        The engines' URLs stay the same: the driver's clients and the agent gateways' reach the restarted servers.
        """
        restarted = sum(ray.get([engine.ensure_alive.remote() for engine in self.engines]))
        self.resync_restarted()
        if self.router is not None:
            self.router.restart()
        logger.info("restarted %d engine(s)%s", restarted, " and the router" if self.router else "")
        return restarted

    def restart_dead(self) -> list[int]:
        """Under --use-fault-tolerance, restart the engines whose server died (and then the router); their indices.

        They serve the initial weights until the caller syncs the current ones and calls :meth:`weights_restored`.
        """
        if not self.run.fault_tolerant or not self.engines:
            return []
        restarted = [i for i, r in enumerate(ray.get([e.ensure_alive.remote() for e in self.engines])) if r]
        if restarted and self.router is not None:
            self.router.restart()
        return restarted

    def weights_restored(self, indices: list[int]) -> None:
        """The engines ``indices`` serve the actor's weights again (requests held since their restart go out)."""
        ray.get([self.engines[i].weights_restored.remote() for i in indices])

    def shutdown(self) -> None:
        """Stop the agent gateway, the router, then each engine's server (its process group), then their workers."""
        self.driver.shutdown()
        if self.router is not None:
            self.router.shutdown()
        for engine in self.engines:
            try:
                ray.get(engine.shutdown.remote(), timeout=60)
            except Exception as e:  # keep stopping the rest
                logger.warning("engine shutdown failed: %s", e)
        for engine in self.engines:
            ray.kill(engine, no_restart=True)


class RestartedEngines:
    """Some of a manager's engines (those restarted), as ``WeightSync.resync`` takes them (``EngineWeights``)."""

    def __init__(self, manager: RolloutManager, indices: list[int]) -> None:
        """The engines ``indices`` of ``manager``."""
        self.manager, self.indices = manager, indices

    def load_weights(self, path: str | Path, version: int) -> None:
        """Serve the HF checkpoint at ``path`` as ``version``."""
        self.manager.load_weights(path, version, only=self.indices)

    def weight_targets(self, timeout_s: float) -> list[dict[str, Any]]:
        """Where the actor's rank 0 sends these engines' weights."""
        return self.manager.weight_targets(timeout_s, only=self.indices)

    def check_weight_version(self, version: int) -> None:
        """Raise unless each of these engines reports ``version``."""
        self.manager.check_weight_version(version, only=self.indices)

    def probe(self) -> list[list[tuple[list[int], list[float]]]]:
        """The probe of these engines (--check-weight-update-equal)."""
        return self.manager.probe(only=self.indices)

    def serve_adapter(self, name: str, version: int, path: str | None = None) -> None:
        """These engines serve LoRA adapter ``name`` as ``version`` (--lora-rank)."""
        self.manager.serve_adapter(name, version, path, only=self.indices)
