"""tidal.batching: varlen packing, dynamic batch size and context-parallel splitting for RL batches.

The config and batch arithmetic are standard library only and import eagerly; everything that needs torch or
numpy is imported on first access, so ``from tidal.batching import BatchingConfig`` stays fast (command-line
validation before torch is loaded).
"""

from __future__ import annotations

import importlib
import importlib.metadata
from typing import TYPE_CHECKING, Any

from tidal.batching.config import BatchingConfig
from tidal.batching.errors import BatchingError

if TYPE_CHECKING:
    from tidal.batching.context_parallel import (
        ContextParallelShard,
        gather_from_context_parallel,
        split_for_context_parallel,
    )
    from tidal.batching.micro_batches import (
        alignment_multiple,
        pack_micro_batches,
        plan_from_config,
        unpack_micro_batches,
    )
    from tidal.batching.packing import pack, unpack
    from tidal.batching.partition import plan_micro_batches
    from tidal.batching.stats import plan_stats
    from tidal.batching.types import PackedBatch

_LAZY = {
    "ContextParallelShard": "context_parallel",
    "gather_from_context_parallel": "context_parallel",
    "split_for_context_parallel": "context_parallel",
    "alignment_multiple": "micro_batches",
    "pack_micro_batches": "micro_batches",
    "plan_from_config": "micro_batches",
    "unpack_micro_batches": "micro_batches",
    "pack": "packing",
    "unpack": "packing",
    "plan_micro_batches": "partition",
    "plan_stats": "stats",
    "PackedBatch": "types",
}

# The installed distribution's version (pyproject.toml's), e.g. "0.1.0".
__version__ = importlib.metadata.version("tidal-batching")


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'tidal.batching' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"tidal.batching.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


__all__ = [
    "BatchingConfig",
    "BatchingError",
    "ContextParallelShard",
    "PackedBatch",
    "alignment_multiple",
    "gather_from_context_parallel",
    "pack",
    "pack_micro_batches",
    "plan_from_config",
    "plan_micro_batches",
    "plan_stats",
    "split_for_context_parallel",
    "unpack",
    "unpack_micro_batches",
]
