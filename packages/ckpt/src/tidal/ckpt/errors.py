"""Errors of tidal.ckpt: every way a checkpoint can fail to load exactly has its own class."""


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved or loaded exactly; the message says why and what to do."""


class CheckpointNotFoundError(CheckpointError):
    """The load directory does not exist, is a file, or holds no checkpoint at all."""


class TrackerFileMissingError(CheckpointError):
    """The directory holds iteration directories but no latest_checkpointed_iteration.txt."""


class IterationNotFoundError(CheckpointError):
    """The tracker file or --ckpt-step names an iteration that is missing or incomplete."""


class NotAMegatronCheckpointError(CheckpointError):
    """A Hugging Face checkpoint (or a single iteration directory) was passed where a Megatron load dir belongs."""


class CheckpointMismatchError(CheckpointError):
    """The checkpoint's tensors do not match the state being loaded (missing/unused key, shape mismatch)."""


class HFCheckpointError(CheckpointError):
    """A Hugging Face safetensors checkpoint is malformed (missing shard, bad index, duplicate tensor)."""
