"""tidal.ckpt: Megatron checkpoints that load exactly or fail clearly, and Hugging Face safetensors IO.

Config and errors import eagerly (standard library only); the rest loads on first access, so that
command-line validation answers before heavy dependencies are imported.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from tidal.ckpt.config import CkptConfig
from tidal.ckpt.errors import (
    CheckpointError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    HFCheckpointError,
    IterationNotFoundError,
    NotAMegatronCheckpointError,
    TrackerFileMissingError,
)

if TYPE_CHECKING:
    from tidal.ckpt.checkpoint import CheckpointSaver, load_checkpoint, save_checkpoint
    from tidal.ckpt.hf import save_hf_checkpoint
    from tidal.ckpt.layout import TRACKER_FILENAME, list_iterations, resolve_checkpoint
    from tidal.ckpt.state import RNG_STATE_KEY, TrainerState, restore_rng_state, rng_state_sharded_object

_LAZY = {
    "CheckpointSaver": "checkpoint",
    "load_checkpoint": "checkpoint",
    "save_checkpoint": "checkpoint",
    "save_hf_checkpoint": "hf",
    "TRACKER_FILENAME": "layout",
    "list_iterations": "layout",
    "resolve_checkpoint": "layout",
    "RNG_STATE_KEY": "state",
    "TrainerState": "state",
    "restore_rng_state": "state",
    "rng_state_sharded_object": "state",
}


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
    "RNG_STATE_KEY",
    "TRACKER_FILENAME",
    "CheckpointError",
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "CheckpointSaver",
    "CkptConfig",
    "HFCheckpointError",
    "IterationNotFoundError",
    "NotAMegatronCheckpointError",
    "TrackerFileMissingError",
    "TrainerState",
    "list_iterations",
    "load_checkpoint",
    "resolve_checkpoint",
    "restore_rng_state",
    "rng_state_sharded_object",
    "save_checkpoint",
    "save_hf_checkpoint",
]
