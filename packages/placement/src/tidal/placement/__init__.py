"""tidal.placement: Ray resource plans, ordered placement groups, conflict-free ports, and Ray lifecycle."""

from tidal.placement.config import PlacementConfig, parse_ray_env
from tidal.placement.errors import PlacementError, ResourceShortageError
from tidal.placement.groups import (
    BundleInfo,
    Placement,
    Rendezvous,
    create_placement,
    wait_for_placement_group,
)
from tidal.placement.lifecycle import ray_session, read_cluster, runtime_env, shutdown_ray, start_ray
from tidal.placement.plan import NodeResources, ResourcePlan, check_resources
from tidal.placement.ports import EnginePorts, PortAllocator, allocate_ports

__all__ = [
    "BundleInfo",
    "EnginePorts",
    "NodeResources",
    "Placement",
    "PlacementConfig",
    "PlacementError",
    "PortAllocator",
    "Rendezvous",
    "ResourcePlan",
    "ResourceShortageError",
    "allocate_ports",
    "check_resources",
    "create_placement",
    "parse_ray_env",
    "ray_session",
    "read_cluster",
    "runtime_env",
    "shutdown_ray",
    "start_ray",
    "wait_for_placement_group",
]
