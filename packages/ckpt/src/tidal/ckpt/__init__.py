"""tidal.ckpt: Megatron checkpoints that load exactly or fail clearly, and Hugging Face safetensors IO."""

from tidal.ckpt.checkpoint import load_checkpoint, save_checkpoint
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
from tidal.ckpt.hf import iter_hf_tensors, save_hf_checkpoint
from tidal.ckpt.layout import TRACKER_FILENAME, iteration_dir_name, list_iterations, resolve_checkpoint
from tidal.ckpt.state import (
    RNG_STATE_KEY,
    TrainerState,
    capture_rng_state,
    restore_rng_state,
    rng_state_sharded_object,
)

__all__ = [
    "RNG_STATE_KEY",
    "TRACKER_FILENAME",
    "CheckpointError",
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "CkptConfig",
    "HFCheckpointError",
    "IterationNotFoundError",
    "NotAMegatronCheckpointError",
    "TrackerFileMissingError",
    "TrainerState",
    "capture_rng_state",
    "iter_hf_tensors",
    "iteration_dir_name",
    "list_iterations",
    "load_checkpoint",
    "resolve_checkpoint",
    "restore_rng_state",
    "rng_state_sharded_object",
    "save_checkpoint",
    "save_hf_checkpoint",
]
