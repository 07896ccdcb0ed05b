"""tidal.placement: Ray resource plans, ordered placement groups, conflict-free ports, and Ray lifecycle.

Config and errors import eagerly (standard library only); the rest loads on first access, so that
command-line validation answers before heavy dependencies are imported.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from typing import TYPE_CHECKING, Any

from tidal.placement.config import PlacementConfig, parse_ray_env
from tidal.placement.devices import LocalGpus, detect_gpus, gpu_memory_bytes, plan_local_gpus
from tidal.placement.errors import PlacementError, ResourceShortageError

if TYPE_CHECKING:
    from tidal.placement.groups import create_placement
    from tidal.placement.lifecycle import ray_session, shutdown_ray, start_ray
    from tidal.placement.plan import ResourcePlan
    from tidal.placement.ports import PortAllocator

_LAZY = {
    "create_placement": "groups",
    "ray_session": "lifecycle",
    "shutdown_ray": "lifecycle",
    "start_ray": "lifecycle",
    "PortAllocator": "ports",
    "ResourcePlan": "plan",
}

# The installed distribution's version (pyproject.toml's), e.g. "0.1.0".
__version__ = importlib.metadata.version("tidal-placement")


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


__all__ = [
    "LocalGpus",
    "PlacementConfig",
    "PlacementError",
    "PortAllocator",
    "ResourcePlan",
    "ResourceShortageError",
    "create_placement",
    "detect_gpus",
    "gpu_memory_bytes",
    "parse_ray_env",
    "plan_local_gpus",
    "ray_session",
    "shutdown_ray",
    "start_ray",
]
