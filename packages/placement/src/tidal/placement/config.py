"""PlacementConfig: the GPU layout flags of a tidal job, checked without Ray (standard library only)."""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

_ENV_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def parse_ray_env(items: Iterable[str]) -> dict[str, str]:
    """Parse ``--ray-env KEY=VALUE`` items into a mapping for the Ray runtime env.

    Args:
        items: strings such as ``"TORCHINDUCTOR_FORCE_DISABLE_CACHES=1"``; the value may itself contain ``=``.

    Returns:
        The mapping, in the order given.

    Raises:
        ValueError: an item has no ``=``, an invalid variable name, or repeats a key with another value.
    """
    env: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not _ENV_KEY.fullmatch(key):
            raise ValueError(
                f"--ray-env expects KEY=VALUE with KEY a valid environment variable name, got {item!r}; "
                "for example --ray-env TORCHINDUCTOR_FORCE_DISABLE_CACHES=1"
            )
        if key in env and env[key] != value:
            raise ValueError(f"--ray-env sets {key} twice ({env[key]!r} and {value!r}); pass it once")
        env[key] = value
    return env


def _engine_spans(start: int, size: int, gpus_per_node: int) -> bool:
    """Whether GPUs [start, start+size) cross a boundary between blocks of ``gpus_per_node``."""
    return start // gpus_per_node != (start + size - 1) // gpus_per_node


@dataclass(frozen=True, kw_only=True, slots=True)
class PlacementConfig:
    """Where the actor (trainer) and the rollout engines run, and how tidal talks to Ray."""

    actor_num_nodes: int = 1
    """Nodes the actor (Megatron trainer) spans."""
    actor_num_gpus_per_node: int = 1
    """Actor ranks (GPUs) on each of those nodes."""
    rollout_num_gpus: int = 1
    """GPUs for all SGLang engines of this job together; 0 places none (`train` sets 0 when
    --rollout-external-engine-addrs is given: those servers run elsewhere)."""
    rollout_num_gpus_per_engine: int = 1
    """GPUs of one SGLang engine (its TP size); an engine never spans nodes."""
    colocate: bool = field(default=False, metadata={"negatable": True})
    """Actor and rollout share the same GPUs; off (slime's default): rollout gets its own GPUs, and the
    job needs actor + rollout GPUs."""
    ray_address: str | None = None
    """Connect to this existing Ray cluster (`auto`: the one started on this machine by `ray start`); None:
    the RAY_ADDRESS environment variable if set (`ray job submit` and KubeRay set it), else start a local Ray."""
    num_gpus_local: int | None = None
    """GPUs a local Ray declares (None: the CUDA GPUs detected; on a machine without any, as many
    logical GPUs as the job needs; see tidal.placement.devices)."""
    num_cpus_local: int = 2
    """CPUs a local Ray declares."""
    num_cpus_per_bundle: float = 0.1
    """CPU share of each GPU bundle (actors in a bundle ask a fraction of it)."""
    placement_timeout_s: float = field(default=300.0, metadata={"flag": "--placement-timeout"})
    """Seconds to wait for the placement group before failing with what is pending."""
    ray_env: Mapping[str, str] = field(default_factory=dict, metadata={"action": "append", "metavar": "KEY=VALUE"})
    """Environment variables for every Ray worker (the job's runtime env)."""
    ray_propagate_uv_env: bool = False
    """Under `uv run`, let Ray ship the working dir and `uv run` every worker (off:
    workers use the driver's interpreter, which is right when all nodes share the environment)."""

    def __post_init__(self) -> None:
        for flag, value in (
            ("--actor-num-nodes", self.actor_num_nodes),
            ("--actor-num-gpus-per-node", self.actor_num_gpus_per_node),
            ("--rollout-num-gpus-per-engine", self.rollout_num_gpus_per_engine),
            ("--num-cpus-local", self.num_cpus_local),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{flag} must be an integer >= 1, got {value!r}")
        if not isinstance(self.rollout_num_gpus, int) or isinstance(self.rollout_num_gpus, bool):
            raise ValueError(f"--rollout-num-gpus must be an integer >= 0, got {self.rollout_num_gpus!r}")
        if self.rollout_num_gpus < 0:
            raise ValueError(f"--rollout-num-gpus must be >= 0 (0: no engine of this job), got {self.rollout_num_gpus}")
        if self.num_gpus_local is not None and self.num_gpus_local < 1:
            raise ValueError(f"--num-gpus-local must be >= 1 (or unset), got {self.num_gpus_local}")
        if not 0 < self.num_cpus_per_bundle <= 64:
            raise ValueError(f"--num-cpus-per-bundle must be in (0, 64], got {self.num_cpus_per_bundle}")
        if not self.placement_timeout_s > 0:
            raise ValueError(f"--placement-timeout must be > 0 seconds, got {self.placement_timeout_s}")
        parse_ray_env(f"{k}={v}" for k, v in self.ray_env.items())
        self._check_layout()

    def _check_layout(self) -> None:
        per_engine = self.rollout_num_gpus_per_engine
        if self.rollout_num_gpus % per_engine:
            suggestion = max(per_engine, self.rollout_num_gpus // per_engine * per_engine)
            raise ValueError(
                f"--rollout-num-gpus ({self.rollout_num_gpus}) must be a multiple of --rollout-num-gpus-per-engine "
                f"({per_engine}); use --rollout-num-gpus {suggestion} or another --rollout-num-gpus-per-engine"
            )
        if not self.colocate:
            return
        actor_gpus = self.num_actor_gpus
        if self.rollout_num_gpus > actor_gpus:
            raise ValueError(
                f"with --colocate the rollout shares the actor's GPUs, so --rollout-num-gpus ({self.rollout_num_gpus}) "
                f"must be <= --actor-num-nodes x --actor-num-gpus-per-node ({actor_gpus}); lower --rollout-num-gpus "
                "or drop --colocate to give rollout its own GPUs"
            )
        gpus_per_node = self.actor_num_gpus_per_node
        for engine in range(self.num_engines):
            if _engine_spans(engine * per_engine, per_engine, gpus_per_node):
                raise ValueError(
                    f"with --colocate, engine {engine} (--rollout-num-gpus-per-engine {per_engine}) would span two "
                    f"nodes of --actor-num-gpus-per-node {gpus_per_node} GPUs; use an engine size that divides "
                    f"{gpus_per_node}"
                )

    @property
    def cluster_address(self) -> str | None:
        """The Ray cluster to connect to: ``ray_address``, else ``$RAY_ADDRESS``; None starts a local Ray."""
        return self.ray_address or os.environ.get("RAY_ADDRESS") or None

    @property
    def num_actor_gpus(self) -> int:
        """GPUs (ranks) of the actor: actor_num_nodes x actor_num_gpus_per_node."""
        return self.actor_num_nodes * self.actor_num_gpus_per_node

    @property
    def num_engines(self) -> int:
        """Number of SGLang engines: rollout_num_gpus / rollout_num_gpus_per_engine."""
        return self.rollout_num_gpus // self.rollout_num_gpus_per_engine

    @property
    def num_gpus(self) -> int:
        """GPUs the job needs: the actor's, plus the rollout's when not co-located."""
        return self.num_actor_gpus + (0 if self.colocate else self.rollout_num_gpus)
