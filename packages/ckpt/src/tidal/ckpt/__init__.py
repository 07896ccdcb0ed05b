"""tidal.ckpt: Megatron checkpoints that load exactly or fail clearly, and Hugging Face safetensors IO.

Config and errors import eagerly (standard library only); the rest loads on first access, so that
command-line validation answers before heavy dependencies are imported.
"""

from __future__ import annotations

import importlib
import importlib.metadata
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
from tidal.ckpt.hf_config_file import read_hf_config_json

if TYPE_CHECKING:
    from tidal.ckpt.atomic import fresh_tmp_dir, publish_dir
    from tidal.ckpt.checkpoint import load_checkpoint, save_checkpoint
    from tidal.ckpt.checkpoint_io import CheckpointIO
    from tidal.ckpt.hf import HFCheckpointReader, save_hf_checkpoint
    from tidal.ckpt.layout import (
        TRACKER_FILENAME,
        best_iteration,
        list_iterations,
        mark_best_iteration,
        resolve_checkpoint,
    )
    from tidal.ckpt.state import TrainerState

_LAZY = {
    "fresh_tmp_dir": "atomic",
    "publish_dir": "atomic",
    "CheckpointIO": "checkpoint_io",
    "load_checkpoint": "checkpoint",
    "save_checkpoint": "checkpoint",
    "save_hf_checkpoint": "hf",
    "HFCheckpointReader": "hf",
    "TRACKER_FILENAME": "layout",
    "best_iteration": "layout",
    "mark_best_iteration": "layout",
    "list_iterations": "layout",
    "resolve_checkpoint": "layout",
    "TrainerState": "state",
}

# The installed distribution's version (pyproject.toml's), e.g. "0.1.0".
__version__ = importlib.metadata.version("tidal-ckpt")


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
    "TRACKER_FILENAME",
    "CheckpointError",
    "CheckpointIO",
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "CkptConfig",
    "HFCheckpointError",
    "HFCheckpointReader",
    "IterationNotFoundError",
    "NotAMegatronCheckpointError",
    "TrackerFileMissingError",
    "TrainerState",
    "best_iteration",
    "fresh_tmp_dir",
    "list_iterations",
    "load_checkpoint",
    "mark_best_iteration",
    "publish_dir",
    "read_hf_config_json",
    "resolve_checkpoint",
    "save_checkpoint",
    "save_hf_checkpoint",
]
