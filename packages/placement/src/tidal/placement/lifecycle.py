"""Ray lifecycle: start a local Ray or connect to a cluster, read it, and tear it down.

A local Ray declares the GPUs that exist, or logical ones on a CPU-only machine (see tidal.placement.devices).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import ray
from ray._private import ray_constants
from ray._private import state as ray_state
from tidal.placement.config import PlacementConfig
from tidal.placement.devices import detect_gpus, plan_local_gpus
from tidal.placement.plan import NodeResources
from tidal.placement.ports import forget_allocators

logger = logging.getLogger(__name__)


def runtime_env(cfg: PlacementConfig) -> dict[str, Any]:
    """The job-wide Ray runtime env: ``--ray-env`` variables reach every task and actor of the job."""
    return {"env_vars": dict(cfg.ray_env)} if cfg.ray_env else {}


def start_ray(cfg: PlacementConfig) -> None:
    """Start a local Ray (no dashboard) or connect to ``cfg.cluster_address`` (``--ray-address``, ``$RAY_ADDRESS``).

    A local Ray declares the CUDA GPUs detected on this machine; on a machine without any (CPU mode) it declares
    as many logical GPUs as the job needs, so the same placement code runs there
    (:func:`tidal.placement.devices.plan_local_gpus` holds the rule; ``--num-gpus-local`` overrides the count).
    Ray's own exit hook and kernel fate-sharing stop the local processes when the driver exits, including on
    Ctrl-C; call :func:`shutdown_ray` to stop earlier.

    Args:
        cfg: the placement flags.

    Raises:
        ResourceShortageError: a local Ray would have fewer GPUs than the job needs (raised before Ray starts).
    """
    if ray.is_initialized():
        logger.warning("Ray is already initialized in this process; start_ray(%s) reuses it", cfg.cluster_address)
        return
    common: dict[str, Any] = {"runtime_env": runtime_env(cfg), "include_dashboard": False}
    with uv_run_propagation(cfg):
        if cfg.cluster_address:
            how = "--ray-address" if cfg.ray_address else "RAY_ADDRESS"
            logger.info("connecting to the Ray cluster at %s (%s)", cfg.cluster_address, how)
            ray.init(address=cfg.cluster_address, **common)
        else:
            local = plan_local_gpus(cfg, detect_gpus())
            logger.info("starting a local Ray: %d CPUs, %s", cfg.num_cpus_local, local.describe())
            # "local" forces a fresh instance even when RAY_ADDRESS points elsewhere.
            ray.init(address="local", num_cpus=cfg.num_cpus_local, num_gpus=local.num_gpus, **common)


@contextmanager
def uv_run_propagation(cfg: PlacementConfig) -> Iterator[None]:
    """Within it, ``ray.init`` ships a `uv run` driver's environment only with ``--ray-propagate-uv-env``.

    (And only when Ray's own ``RAY_ENABLE_UV_RUN_RUNTIME_ENV`` leaves it on.)

    Under `uv run`, Ray by default uploads the working directory and starts every worker through `uv run`, which
    rebuilds the workspace per worker (tens of seconds, hundreds of packages). Ray reads the switch from
    ray_constants at init time; it is restored on exit, so it only affects the ``ray.init`` inside.
    """
    saved = ray_constants.RAY_ENABLE_UV_RUN_RUNTIME_ENV
    ray_constants.RAY_ENABLE_UV_RUN_RUNTIME_ENV = saved and cfg.ray_propagate_uv_env
    try:
        yield
    finally:
        ray_constants.RAY_ENABLE_UV_RUN_RUNTIME_ENV = saved


def shutdown_ray() -> None:
    """Disconnect from Ray; a local Ray started by :func:`start_ray` is stopped with all its processes.

    Placement groups and actors of this job go with it (they fate-share with the driver).
    """
    forget_allocators()
    if ray.is_initialized():
        ray.shutdown()


@contextmanager
def ray_session(cfg: PlacementConfig) -> Iterator[None]:
    """Start or connect to Ray for a ``with`` block and always shut it down, also on Ctrl-C."""
    start_ray(cfg)
    try:
        yield
    finally:
        shutdown_ray()


def read_cluster() -> list[NodeResources]:
    """The alive nodes of the connected cluster with their total and currently free GPUs/CPUs."""
    # Per-node *available* resources are only in Ray's developer API (ray._private.state).
    available = ray_state.available_resources_per_node()
    nodes = []
    for node in ray.nodes():
        if not node.get("Alive"):
            continue
        total = node.get("Resources", {})
        free = available.get(node["NodeID"], {})
        nodes.append(
            NodeResources(
                node_id=node["NodeID"],
                node_ip=node["NodeManagerAddress"],
                is_head="node:__internal_head__" in total,
                gpus_total=total.get("GPU", 0.0),
                gpus_available=free.get("GPU", 0.0),
                cpus_total=total.get("CPU", 0.0),
                cpus_available=free.get("CPU", 0.0),
            )
        )
    return nodes
