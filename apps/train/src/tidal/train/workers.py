"""Ray actors that host the packages' components on their placement bundles.

They only hold handles and forward calls: the trainer's work is tidal.actor's and tidal.batching's, the engine's
is tidal.rollout's. Each process sets its own log format (``[tidal actor r0] ...``).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
from tidal.train.logs import setup_logging

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class RolloutData:
    """What the trainer needs of one rollout, in plain Python types (crosses the Ray boundary)."""

    tokens: list[list[int]]
    """Prompt + response token ids of each sample."""
    loss_masks: list[list[int]]
    """0 on prompt tokens, 1 on response tokens."""
    rollout_log_probs: list[list[float]]
    """Per-token log-probs from the engine, in tidal's convention (0 on prompt tokens)."""
    rewards: list[float]
    """Scalar reward of each sample."""
    group_size: int
    """Samples per prompt (consecutive samples form one group)."""


@ray.remote
class ActorWorker:
    """One rank of the Megatron actor (tidal.actor) on its bundle, with its checkpoint IO (tidal.ckpt)."""

    def __init__(
        self,
        actor_cfg,
        batching_cfg,
        ckpt_cfg,
        *,
        rank: int,
        world_size: int,
        master_addr: str,
        master_port: int,
        seed: int,
        tensor_model_parallel_size: int = 1,
        context_parallel_size: int = 1,
        pipeline_model_parallel_size: int = 1,
    ) -> None:
        setup_logging(f"actor r{rank}")
        _limit_cpu_threads()
        from tidal.actor import Actor, init_distributed
        from tidal.ckpt import CheckpointIO

        init_distributed(
            rank=rank,
            world_size=world_size,
            master_addr=master_addr,
            master_port=master_port,
            seed=seed,
            tensor_model_parallel_size=tensor_model_parallel_size,
            context_parallel_size=context_parallel_size,
            pipeline_model_parallel_size=pipeline_model_parallel_size,
        )
        self.dp_size = world_size // (tensor_model_parallel_size * context_parallel_size * pipeline_model_parallel_size)
        self.rank = rank
        self.batching_cfg = batching_cfg
        self.hf_checkpoint = actor_cfg.hf_checkpoint
        self.checkpoints = CheckpointIO.from_config(ckpt_cfg)
        self.actor = Actor(actor_cfg)
        self.reference = None
        if actor_cfg.kl_loss_coef > 0 or actor_cfg.kl_coef > 0:  # frozen, offloaded to CPU between rollouts
            from tidal.actor import ReferenceModel

            self.reference = ReferenceModel(actor_cfg, load_dir=ckpt_cfg.ref_load)

    def ready(self) -> bool:
        """True once the model is built and loaded (the constructor finished)."""
        return True

    def train(self, rollout: RolloutData) -> dict[str, float]:
        """Old log-probs, advantages, then the rollout's optimizer steps; metrics of the rollout."""
        from tidal.actor import train_on_rollout

        return train_on_rollout(
            self.actor,
            self.batching_cfg,
            tokens=rollout.tokens,
            loss_masks=rollout.loss_masks,
            rewards=rollout.rewards,
            group_size=rollout.group_size,
            rollout_log_probs=rollout.rollout_log_probs,
            rank=_dp_rank(),
            dp_size=self.dp_size,
            reference=self.reference,
        )

    def save_hf(self, out_dir: str, max_shard_bytes: int | None = None) -> str:
        """Write the current weights as an HF checkpoint beside --hf-checkpoint's config and tokenizer.

        Rank 0 writes (shards of ``max_shard_bytes``, default --max-shard-bytes); every rank gathers TP shards.
        """
        tensors = self.actor.named_hf_tensors()
        if self.rank != 0:
            for _ in tensors:
                pass
            return out_dir
        return self.checkpoints.save_hf(
            out_dir, tensors, source_dir=self.hf_checkpoint, max_shard_bytes=max_shard_bytes
        )

    def offload(self) -> dict[str, float]:
        """Parameters, gradients and optimizer state to host memory (the engines generate meanwhile)."""
        return self.actor.offload()

    def onload(self) -> dict[str, float]:
        """Back onto the device, before training."""
        return self.actor.onload()

    def sync_tensor(self, targets: list[dict[str, Any]], version: str, bucket_bytes: int, tp_size: int) -> dict:
        """Every rank exports its buckets (TP gather, PP broadcast); rank 0 hands them to each engine as tensors.

        On GPU the payload is CUDA IPC handles of rank 0's buckets, on CPU shared-memory handles: no weight bytes
        cross HTTP. The last bucket sets ``version`` and flushes the engines' caches.
        """
        from tidal.rollout import update_weights_from_tensor

        named = self._exported(bucket_bytes)
        if self.rank != 0:
            for _ in named:
                pass
            return {}
        engines = [_client(t) for t in targets]
        return update_weights_from_tensor(engines, named, bucket_bytes=bucket_bytes, weight_version=version,
                                          tp_size=tp_size)  # fmt: skip

    def init_weight_group(self, targets: list[dict[str, Any]], group_name: str, timeout_s: float) -> None:
        """Rank 0: one process group with every engine rank (NCCL on GPU, gloo on CPU) for the broadcasts."""
        if self.rank != 0:
            return
        from tidal.placement import PortAllocator
        from tidal.rollout import init_weights_update_group

        address = ray.util.get_node_ip_address()
        port = PortAllocator(address).allocate(1)[0]
        engines = [_client(t) for t in targets]
        self.weight_group = init_weights_update_group(
            engines, master_address=address, master_port=port, group_name=group_name,
            engine_tp_sizes=[t["tp_size"] for t in targets], timeout_s=timeout_s,
        )  # fmt: skip

    def sync_broadcast(self, targets: list[dict[str, Any]], version: str, bucket_bytes: int, group_name: str,
                       timeout_s: float) -> dict:  # fmt: skip
        """Every rank exports its buckets; rank 0 broadcasts each into the weight group (bounded by ``timeout_s``)."""
        from tidal.rollout import update_weights_from_distributed

        named = self._exported(bucket_bytes)
        if self.rank != 0:
            for _ in named:
                pass
            return {}
        engines = [_client(t) for t in targets]
        return update_weights_from_distributed(
            engines, self.weight_group, named, group_name=group_name, bucket_bytes=bucket_bytes,
            weight_version=version, timeout_s=timeout_s,
        )  # fmt: skip

    def close_weight_group(self, targets: list[dict[str, Any]], group_name: str) -> None:
        """Rank 0: tear the weight group down on the engines and here."""
        if self.rank != 0 or getattr(self, "weight_group", None) is None:
            return
        from tidal.rollout import destroy_weights_update_group

        group, self.weight_group = self.weight_group, None
        destroy_weights_update_group([_client(t) for t in targets], group, group_name=group_name)

    def _exported(self, bucket_bytes: int):
        """``(hf_name, tensor)`` of every bucket, in the model's own dtype, on its device."""
        dtype = next(iter(self.actor.params)).dtype
        for bucket in self.actor.hf_tensor_buckets(dtype=dtype, bucket_bytes=bucket_bytes):
            yield from bucket

    def probe_log_probs(self, tokens: list[list[int]]) -> list[list[float]]:
        """The actor's log-probs of each token list (tidal's convention: position t scores token t)."""
        from tidal.batching import pack, unpack

        batch = pack(tokens, pad_to_multiple_of=self.batching_cfg.pad_to_multiple_of)
        return [lp.tolist() for lp in unpack(self.actor.compute_log_probs(batch), batch)]

    def save_checkpoint(self, iteration: int, common_state: dict[str, Any]) -> str:
        """Save model, optimizer and this rank's RNG states into --save (every rank takes part)."""
        return self.checkpoints.save(iteration, self.actor.sharded_state_dict(), common_state=common_state)

    def finalize_saves(self) -> list[str]:
        """Wait for a pending --async-save to be durable and published (every rank calls it)."""
        return self.checkpoints.finalize()

    def load_checkpoint(self) -> dict[str, Any]:
        """Load --load (model, optimizer unless --no-load-optim, RNG unless --no-load-rng); its common state."""
        state = self.actor.sharded_state_dict(with_optimizer=self.checkpoints.load_optimizer)
        loaded, common = self.checkpoints.load(state)
        self.actor.load_state_dict(loaded)
        return common


def _client(target: dict[str, Any]):
    """A client of one engine for the actor's rank 0 (weight updates go to each engine directly, never a router)."""
    from tidal.rollout import SGLangClient

    return SGLangClient(target["url"], api_key=target.get("api_key"), request_timeout_s=target["timeout_s"])


def _limit_cpu_threads() -> None:
    """Without CUDA, one torch thread per actor rank (or ``OMP_NUM_THREADS``).

    Ray leaves an actor without a CPU reservation free to start one thread per core, and on a small CPU machine
    those threads spin against the SGLang server's: the actor's step ran 10-30x slower than single-threaded.
    """
    import torch

    if not torch.cuda.is_available():
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))


def _dp_rank() -> int:
    from tidal.actor import data_parallel_rank_and_size

    return data_parallel_rank_and_size()[0]


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
        log_dir: str,
        env: dict[str, str] | None = None,
        fault_tolerant: bool = False,
        external_url: str | None = None,
        tp_size: int = 1,
        interruptible: bool = False,
        flush_after_update: bool = True,
    ) -> None:
        setup_logging(f"engine {external_url or port}")
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
                rollout_cfg, model_path, port=port, nccl_port=nccl_port, log_dir=Path(log_dir), env=env
            )
        )
        self.health_check = (rollout_cfg.rollout_health_check_interval, rollout_cfg.rollout_health_check_timeout)
        # --max-staleness >= 1: a weight update aborts the requests in flight; they resume under the new weights
        self.interrupt = InterruptibleUpdates(self.engine) if interruptible else None
        # SGLang flushes its cache in the update itself; the second flush waits for an idle server, which under
        # --max-staleness (requests of the next rollouts already running) it may not be.
        self.flush_after_update = flush_after_update
        self.heartbeat = None
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
        interval, timeout = self.health_check
        if self.fault_tolerant and interval > 0:
            from tidal.rollout import Heartbeat

            self.heartbeat = Heartbeat(
                self.engine, interval_s=interval, timeout_s=timeout, on_failure=lambda _: self.engine.kill()
            )
            self.heartbeat.start()
        return self.engine.url

    def ensure_alive(self) -> bool:
        """Under --use-fault-tolerance, restart the server if its process is gone; True when it restarted."""
        if self.external or not self.fault_tolerant or self.engine.is_running():
            return False
        logger.warning("%s is not running; restarting it (--use-fault-tolerance)", self.engine.describe())
        self.engine.restart()
        if self.heartbeat is not None:
            self.heartbeat.resume()
        return True

    def pid(self) -> int | None:
        """Process id of the server (its process group leader); None for an external server."""
        return None if self.external else self.engine.pid

    def generate_samples(
        self, prompts: list[list[int]], sampling_params: dict[str, Any], labels: list
    ) -> tuple[list, float]:
        """One batched generation wrapped as unscored Samples (tidal.rollout.generate_samples); and its seconds."""
        from tidal.rollout import generate_samples

        tick = time.monotonic()
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
        return samples, time.monotonic() - tick

    def http_retries(self) -> int:
        """Requests to this engine sent again after a transient failure, since it started (only grows)."""
        return self.engine.http_retries

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

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
            self.engine.restart()
            self.engine.update_weights_from_disk(path, weight_version=weight_version)
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

    def resume_memory(self, tags: list[str]) -> None:
        """Re-allocate what :meth:`release_memory` freed."""
        self.engine.resume_memory_occupation(tags)

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
