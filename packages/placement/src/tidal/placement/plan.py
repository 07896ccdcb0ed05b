"""The resource plan: bundles, who sits on which, and whether the live cluster can hold it (pure, no Ray calls)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tidal.placement.config import PlacementConfig
from tidal.placement.errors import ResourceShortageError

# Shares of one GPU bundle when actor and rollout are co-located (slime's figures): they must sum to <= 1,
# and leave room for a small helper actor in the same bundle.
COLOCATED_ACTOR_GPU_SHARE = 0.4
COLOCATED_ENGINE_GPU_SHARE = 0.2


@dataclass(frozen=True, kw_only=True, slots=True)
class NodeResources:
    """One live Ray node as the shortage check sees it."""

    node_id: str
    node_ip: str
    is_head: bool
    gpus_total: float
    gpus_available: float
    cpus_total: float
    cpus_available: float


@dataclass(frozen=True, kw_only=True, slots=True)
class ResourcePlan:
    """What to ask Ray for. Positions index the bundles after sorting by (node IP, node id, GPU id)."""

    num_bundles: int
    bundle: dict[str, float]
    actor_positions: list[int]
    engine_positions: list[list[int]]
    actor_num_gpus: float
    actor_num_cpus: float
    engine_num_gpus: float
    engine_num_cpus: float

    @classmethod
    def from_config(cls, cfg: PlacementConfig) -> ResourcePlan:
        """Lay out actor ranks and engines on one group of {"GPU": 1, "CPU": share} bundles."""
        num_actor = cfg.num_actor_gpus
        first_rollout = 0 if cfg.colocate else num_actor
        size = cfg.rollout_num_gpus_per_engine
        engines = [
            list(range(first_rollout + e * size, first_rollout + (e + 1) * size)) for e in range(cfg.num_engines)
        ]
        actor_share, engine_share = (
            (COLOCATED_ACTOR_GPU_SHARE, COLOCATED_ENGINE_GPU_SHARE) if cfg.colocate else (1.0, 1.0)
        )
        cpu = cfg.num_cpus_per_bundle
        return cls(
            num_bundles=cfg.num_gpus,
            bundle={"GPU": 1.0, "CPU": cpu},
            actor_positions=list(range(num_actor)),
            engine_positions=engines,
            actor_num_gpus=actor_share,
            # Ray counts resources in units of 1e-4; round down so the shares never exceed the bundle.
            actor_num_cpus=int(cpu * actor_share * 10_000) / 10_000,
            engine_num_gpus=engine_share,
            engine_num_cpus=int(cpu * engine_share * 10_000) / 10_000,
        )


def _fits(blocks: Sequence[int], free: Sequence[float]) -> bool:
    """First-fit decreasing: can every block of GPUs sit on a single node?"""
    left = sorted((int(f) for f in free), reverse=True)
    for block in sorted(blocks, reverse=True):
        for i, room in enumerate(left):
            if room >= block:
                left[i] -= block
                break
        else:
            return False
    return True


def describe_need(cfg: PlacementConfig) -> str:
    """The GPUs ``cfg`` needs, and how they split between actor and rollout, in one phrase."""
    actor = f"actor {cfg.actor_num_nodes} node(s) x {cfg.actor_num_gpus_per_node} GPUs"
    rollout = f"rollout {cfg.num_engines} engine(s) x {cfg.rollout_num_gpus_per_engine} GPUs"
    if cfg.colocate:
        return f"{cfg.num_gpus} GPUs (co-located: {actor}; {rollout} share them)"
    return f"{cfg.num_gpus} GPUs (decoupled, --no-colocate: {actor} + {rollout})"


def _fix_line(cfg: PlacementConfig, gpus_total: int) -> str:
    fixes = []
    if not cfg.colocate:
        size = cfg.rollout_num_gpus_per_engine
        room = (gpus_total - cfg.num_actor_gpus) // size * size
        if room >= size:
            fixes.append(f"--rollout-num-gpus {room} (the most that fits beside the actor)")
        if cfg.num_actor_gpus <= gpus_total:
            fixes.append(f"--colocate (rollout shares the actor's {cfg.num_actor_gpus} GPUs)")
    fixes.append(f"lower --actor-num-nodes / --actor-num-gpus-per-node (actor uses {cfg.num_actor_gpus} GPUs)")
    fixes.append("a smaller --rollout-num-gpus-per-engine if an engine does not fit on one node")
    return "Fix (any one): " + "; ".join(fixes) + "; or add GPUs to the Ray cluster."


def check_resources(cfg: PlacementConfig, nodes: Sequence[NodeResources]) -> None:
    """Fail fast when the cluster can never hold the job, before any placement group exists.

    The check is against the cluster's *total* resources: a job that can never fit fails now. GPUs that exist
    but are busy (another job) are waited for by the placement group, with a timeout and progress log lines.

    Args:
        cfg: the job's placement flags.
        nodes: the live cluster, one entry per alive node.

    Raises:
        ResourceShortageError: with needed vs available per node and the flags to change.
    """
    plan = ResourcePlan.from_config(cfg)
    gpus_total = int(sum(n.gpus_total for n in nodes))
    gpus_free = sum(n.gpus_available for n in nodes)
    cpus_needed = plan.num_bundles * cfg.num_cpus_per_bundle
    cpus_total = sum(n.cpus_total for n in nodes)
    blocks = [cfg.actor_num_gpus_per_node] * cfg.actor_num_nodes
    if not cfg.colocate:
        blocks += [cfg.rollout_num_gpus_per_engine] * cfg.num_engines
    problems = []
    if gpus_total < cfg.num_gpus:
        problems.append(f"needs {cfg.num_gpus} GPUs, the cluster has {gpus_total}")
    elif not _fits(blocks, [n.gpus_total for n in nodes]):
        problems.append(
            f"the GPU blocks {sorted(blocks, reverse=True)} (one per actor node and, when decoupled, per engine) "
            "do not each fit on a single node"
        )
    if cpus_total + 1e-9 < cpus_needed:
        problems.append(
            f"needs {cpus_needed:g} CPUs ({plan.num_bundles} bundles x {cfg.num_cpus_per_bundle:g}), "
            f"the cluster has {cpus_total:g} (lower --num-cpus-per-bundle)"
        )
    if not problems:
        return
    # The first line says it all (what is needed, what there is, what to change); the per-node lines follow.
    lines = [
        f"Not enough resources in the Ray cluster for this job: {'; '.join(problems)}; "
        f"needed: {describe_need(cfg)}; available: {gpus_total} GPUs ({gpus_free:g} free now) on {len(nodes)} "
        f"node(s). {_fix_line(cfg, gpus_total)}"
    ]
    for n in sorted(nodes, key=lambda n: (n.node_ip, n.node_id)):
        head = " (head)" if n.is_head else ""
        lines.append(
            f"    node {n.node_ip} {n.node_id[:8]}{head}: {n.gpus_total:g} GPUs ({n.gpus_available:g} free), "
            f"{n.cpus_total:g} CPUs ({n.cpus_available:g} free)"
        )
    raise ResourceShortageError("\n".join(lines))
