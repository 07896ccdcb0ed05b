"""One placement group of GPU bundles in a deterministic order, and who runs on which bundle."""

from __future__ import annotations

import ipaddress
import logging
import time
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
from tidal.placement.config import PlacementConfig
from tidal.placement.errors import PlacementError
from tidal.placement.lifecycle import read_cluster
from tidal.placement.plan import ResourcePlan, check_resources
from tidal.placement.ports import EnginePorts, PortAllocator

logger = logging.getLogger(__name__)

PROGRESS_EVERY_S = 30.0
PROBE_TIMEOUT_S = 120.0


@dataclass(frozen=True, kw_only=True, slots=True)
class BundleInfo:
    """Where one bundle of the group landed: its index in the group, node and physical GPU id."""

    index: int
    node_id: str
    node_ip: str
    gpu_id: int


@dataclass(frozen=True, kw_only=True, slots=True)
class Rendezvous:
    """torch.distributed rendezvous of the actor: rank 0's node IP and a port reserved there."""

    master_addr: str
    master_port: int


@ray.remote(num_cpus=0.0001, num_gpus=0.0001, max_calls=0)
def _probe() -> tuple[str, str, int]:
    # max_calls=0 lets one worker per node serve every probe (Ray retires GPU task workers by default).
    ctx = ray.get_runtime_context()
    return ray.util.get_node_ip_address(), ctx.get_node_id(), int(ray.get_gpu_ids()[0])


def wait_for_placement_group(pg: PlacementGroup, *, timeout_s: float, what: str = "placement group") -> None:
    """Wait until ``pg`` is ready, logging progress at least every 30 s.

    Raises:
        PlacementError: on timeout, naming the pending bundles and the free resources; the group is removed.
    """
    deadline = time.monotonic() + timeout_s
    ready = pg.ready()
    while True:
        left = deadline - time.monotonic()
        done, _ = ray.wait([ready], timeout=max(0.0, min(PROGRESS_EVERY_S, left)))
        if done:
            ray.get(ready)
            return
        table = placement_group_table(pg)
        # Unplaced bundles are listed too, with an empty node id.
        placed_indices = {i for i, node in table.get("bundles_to_node_id", {}).items() if node}
        placed = len(placed_indices)
        free = ray.available_resources()
        status = (
            f"{placed}/{len(pg.bundle_specs)} bundles placed, state {table.get('state')}; cluster free: "
            f"{free.get('GPU', 0):g} GPUs, {free.get('CPU', 0):g} CPUs"
        )
        if time.monotonic() >= deadline:
            pending = [b for i, b in enumerate(pg.bundle_specs) if i not in placed_indices]
            remove_placement_group(pg)
            raise PlacementError(
                f"timed out after {timeout_s:g} s waiting for the {what}: {status}; pending bundles: {pending}. "
                "The group was removed. Free GPUs in the cluster, lower the GPU flags, or raise --placement-timeout"
            )
        logger.info("waiting for the %s of %d bundles: %s", what, len(pg.bundle_specs), status)


def _probe_bundles(pg: PlacementGroup) -> list[BundleInfo]:
    """Ask each bundle where it is: rounds of one probe per node, so one warm worker per node answers all."""
    by_node: dict[str, list[int]] = {}
    for index, node_id in sorted(placement_group_table(pg)["bundles_to_node_id"].items()):
        by_node.setdefault(node_id, []).append(index)
    infos: list[BundleInfo] = []
    for round_ in range(max(len(v) for v in by_node.values())):
        indices = [v[round_] for v in by_node.values() if round_ < len(v)]
        refs = [
            _probe.options(
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i)
            ).remote()
            for i in indices
        ]
        try:
            answers = ray.get(refs, timeout=PROBE_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError as e:
            raise PlacementError(
                f"the probes of bundles {indices} did not answer in {PROBE_TIMEOUT_S:g} s; a Ray worker could not "
                "start on their node(s) (see the raylet logs under /tmp/ray/session_latest/logs)"
            ) from e
        for i, (ip, node_id, gpu) in zip(indices, answers, strict=True):
            infos.append(BundleInfo(index=i, node_id=node_id, node_ip=ip, gpu_id=gpu))
    return sorted(infos, key=_bundle_order)


def _bundle_order(b: BundleInfo) -> tuple[Any, ...]:
    """Node IP (numerically when it parses), then node id (simulated nodes share an IP), then GPU id."""
    try:
        ip: Any = (0, ipaddress.ip_address(b.node_ip).packed)
    except ValueError:
        ip = (1, b.node_ip.encode())
    return ip, b.node_id, b.gpu_id


class Placement:
    """The job's placement group with actor ranks and rollout engines mapped to its bundles.

    Attributes:
        pg: the Ray placement group (one bundle per GPU).
        plan: the resource plan it realizes.
        bundles: every bundle in deterministic order (node IP, node id, GPU id).
        actor_bundles: group bundle index of each actor rank.
        engine_bundles: group bundle indices of each engine; co-located engines share the actor's bundles.
    """

    def __init__(self, cfg: PlacementConfig, pg: PlacementGroup, plan: ResourcePlan, bundles: list[BundleInfo]):
        self.cfg, self.pg, self.plan, self.bundles = cfg, pg, plan, bundles
        self._by_index = {b.index: b for b in bundles}
        self.actor_bundles = [bundles[p].index for p in plan.actor_positions]
        self.engine_bundles = [[bundles[p].index for p in positions] for positions in plan.engine_positions]

    def scheduling(self, bundle_index: int) -> PlacementGroupSchedulingStrategy:
        """Strategy that pins a task/actor (and its children) to the group's bundle ``bundle_index``."""
        return PlacementGroupSchedulingStrategy(
            self.pg, placement_group_bundle_index=bundle_index, placement_group_capture_child_tasks=True
        )

    def bundle(self, bundle_index: int) -> BundleInfo:
        """Node and GPU of the group's bundle ``bundle_index``."""
        return self._by_index[bundle_index]

    def actor_options(self, rank: int, rendezvous: Rendezvous | None = None) -> dict[str, Any]:
        """``ActorClass.options(**placement.actor_options(rank, rdzv))`` for actor rank ``rank``.

        With ``rendezvous``, the rank's torch.distributed variables go into its runtime env (merged over the
        job's ``--ray-env``). CUDA_VISIBLE_DEVICES is left to Ray, which sets it from the bundle's GPU (setting
        it in a runtime env would also change what ``ray.get_gpu_ids()`` reports).
        """
        options: dict[str, Any] = {
            "num_cpus": self.plan.actor_num_cpus,
            "num_gpus": self.plan.actor_num_gpus,
            "scheduling_strategy": self.scheduling(self.actor_bundles[rank]),
        }
        if rendezvous is not None:
            env = self.rank_env(rank, rendezvous)
            del env["CUDA_VISIBLE_DEVICES"]
            options["runtime_env"] = {"env_vars": env}
        return options

    def engine_options(self, engine: int) -> dict[str, Any]:
        """Options for the Ray actor that runs engine ``engine``; it sits in the engine's first bundle."""
        return {
            "num_cpus": self.plan.engine_num_cpus,
            "num_gpus": self.plan.engine_num_gpus,
            "scheduling_strategy": self.scheduling(self.engine_bundles[engine][0]),
        }

    def engine_node_ip(self, engine: int) -> str:
        """IP of the node engine ``engine`` runs on (all its bundles are on that node)."""
        return self.bundle(self.engine_bundles[engine][0]).node_ip

    def engine_visible_devices(self, engine: int) -> str:
        """CUDA_VISIBLE_DEVICES for the SGLang server of engine ``engine``: the GPUs of all its bundles."""
        return ",".join(str(self.bundle(i).gpu_id) for i in self.engine_bundles[engine])

    def engine_ports(self, engine: int) -> EnginePorts:
        """Reserve HTTP, NCCL and dist-init ports for engine ``engine`` on its node."""
        return PortAllocator(self.engine_node_ip(engine)).engine_ports()

    def rendezvous(self) -> Rendezvous:
        """Reserve the actor's torch.distributed master port on rank 0's node."""
        ip = self.bundle(self.actor_bundles[0]).node_ip
        return Rendezvous(master_addr=ip, master_port=PortAllocator(ip).allocate(1)[0])

    def rank_env(self, rank: int, rendezvous: Rendezvous) -> dict[str, str]:
        """Environment of actor rank ``rank`` for ``torch.distributed`` (env:// rendezvous) and its GPU."""
        me = self.bundle(self.actor_bundles[rank])
        same_node = [r for r, i in enumerate(self.actor_bundles) if self.bundle(i).node_id == me.node_id]
        nodes = list(dict.fromkeys(self.bundle(i).node_id for i in self.actor_bundles))
        return {
            "RANK": str(rank),
            "WORLD_SIZE": str(len(self.actor_bundles)),
            "LOCAL_RANK": str(same_node.index(rank)),
            "LOCAL_WORLD_SIZE": str(len(same_node)),
            "NODE_RANK": str(nodes.index(me.node_id)),
            "MASTER_ADDR": rendezvous.master_addr,
            "MASTER_PORT": str(rendezvous.master_port),
            "CUDA_VISIBLE_DEVICES": str(me.gpu_id),
        }

    def remove(self) -> None:
        """Remove the placement group (its actors die with it)."""
        remove_placement_group(self.pg)


def create_placement(cfg: PlacementConfig, *, name: str = "tidal") -> Placement:
    """Check the live cluster, then create and order the job's placement group.

    The check runs before anything is created, so a too-small cluster fails in seconds instead of hanging.

    Args:
        cfg: the placement flags; Ray must already be started (:func:`tidal.placement.start_ray`).
        name: the placement group's name.

    Returns:
        The ready placement with actor ranks and engines mapped to bundles.

    Raises:
        ResourceShortageError: the cluster has fewer GPUs/CPUs than the flags need.
        PlacementError: the group did not become ready within ``cfg.placement_timeout_s`` (it is removed), or an
            engine would span two nodes.
    """
    check_resources(cfg, read_cluster())
    plan = ResourcePlan.from_config(cfg)
    pg = placement_group([dict(plan.bundle) for _ in range(plan.num_bundles)], strategy="PACK", name=name)
    wait_for_placement_group(pg, timeout_s=cfg.placement_timeout_s, what=f"placement group {name!r}")
    try:
        placement = Placement(cfg, pg, plan, _probe_bundles(pg))
        _check_engines_on_one_node(placement)
        for ip in sorted({b.node_ip for b in placement.bundles}):
            PortAllocator(ip)  # created by the driver, so the allocators live as long as the job
    except BaseException:
        remove_placement_group(pg)
        raise
    logger.info(
        "placement %r: %d bundles on %d node(s); actor ranks -> bundles %s; engines -> %s",
        name,
        plan.num_bundles,
        len({b.node_id for b in placement.bundles}),
        placement.actor_bundles,
        placement.engine_bundles,
    )
    return placement


def _check_engines_on_one_node(placement: Placement) -> None:
    for engine, indices in enumerate(placement.engine_bundles):
        nodes = {placement.bundle(i).node_ip + "/" + placement.bundle(i).node_id[:8] for i in indices}
        if len(nodes) > 1:
            raise PlacementError(
                f"Ray packed the bundles so that engine {engine} would span nodes {sorted(nodes)}; choose "
                "--rollout-num-gpus-per-engine and --actor-num-gpus-per-node that divide each node's GPU count"
            )
