"""The non-tensor state a resumed run needs: the trainer's counters and every RNG stream.

``TrainerState`` goes into the checkpoint's common state (one copy, written by rank 0). RNG states differ per
rank, so they are a ``ShardedObject`` with one shard per global rank: loading them at another world size is a
``CheckpointMismatchError`` that says to pass ``--no-load-rng``. Everything here survives
``torch.load(weights_only=True)``: numpy's state is stored as a tensor, not as a pickled ndarray.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from megatron.core.dist_checkpointing import ShardedObject
from tidal.ckpt.errors import CheckpointError

logger = logging.getLogger(__name__)

RNG_STATE_KEY = "rng_state"


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainerState:
    """Where the training loop stands; saved in the common state, restored exactly on resume."""

    rollout_id: int
    """The last finished rollout; the resumed run starts at rollout_id + 1."""
    weight_version: int
    """Version of the weights the rollout engines hold (bumped at every weight sync)."""
    data_epoch: int = 0
    """Epoch of the prompt dataset."""
    data_offset: int = 0
    """Prompts consumed in the current epoch."""
    data_seed: int = 0
    """Seed of the dataset shuffle."""
    rng_state: dict[str, Any] | None = dataclasses.field(default=None, compare=False, repr=False)
    """Python, numpy and torch CPU RNG states of the process that owns this state (the driver), or None."""
    rollout_carry: list[Any] | None = dataclasses.field(default=None, repr=False)
    """What the rollout side carries from one rollout to the next (partial rollout's unfinished groups), as plain
    lists/dicts of JSON types; opaque here. None: nothing carried."""
    rollout_buffer: list[Any] | None = dataclasses.field(default=None, repr=False)
    """Rollouts generated but not yet trained on (asynchronous training), as plain JSON data; opaque here. None:
    none was waiting."""

    @classmethod
    def capture(
        cls,
        *,
        rollout_id: int,
        weight_version: int,
        data_epoch: int = 0,
        data_offset: int = 0,
        data_seed: int = 0,
        rollout_carry: list[Any] | None = None,
        rollout_buffer: list[Any] | None = None,
    ) -> TrainerState:
        """The given counters (and rollout carry-over and buffer) plus this process's python/numpy/torch RNG states."""
        return cls(
            rollout_id=rollout_id,
            weight_version=weight_version,
            data_epoch=data_epoch,
            data_offset=data_offset,
            data_seed=data_seed,
            rng_state=_host_rng_state(),
            rollout_carry=rollout_carry,
            rollout_buffer=rollout_buffer,
        )

    def restore_rng(self) -> None:
        """Set this process's python/numpy/torch RNG streams to those captured by ``capture``."""
        if self.rng_state is None:
            raise CheckpointError(
                "this trainer state holds no RNG states (it was built without TrainerState.capture); the resumed "
                "run cannot draw the same samples as an uninterrupted one"
            )
        restore_rng_state(self.rng_state)

    def to_dict(self) -> dict[str, Any]:
        """Plain dict for ``save_checkpoint(common_state=...)`` (loadable with ``weights_only=True``).

        Raises:
            CheckpointError: ``rollout_carry`` or ``rollout_buffer`` is not plain JSON data (it could be saved but
                not loaded back).
        """
        try:
            json.dumps([self.rollout_carry, self.rollout_buffer])
        except (TypeError, ValueError) as e:
            raise CheckpointError(
                f"the rollout carry-over is not plain data and would not load back from the checkpoint: {e}; "
                "labels of partial-rollout samples must be JSON values (str, number, list, dict, None)"
            ) from e
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, state: dict[str, Any]) -> TrainerState:
        """Rebuild from a loaded common state; a missing field is a ``CheckpointError`` naming it."""
        names = [f.name for f in dataclasses.fields(cls)]
        required = [f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING]
        missing = [name for name in required if name not in state]
        if missing:
            raise CheckpointError(
                f"checkpoint common state lacks trainer field(s) {missing} (it has {sorted(state)}); it was not "
                f"written by tidal's trainer. Load it with --hf-checkpoint or a fresh --save directory instead."
            )
        opaque = ("rng_state", "rollout_carry", "rollout_buffer")
        values: dict[str, Any] = {name: int(state[name]) for name in names if name in state and name not in opaque}
        return cls(**values, **{name: state.get(name) for name in opaque})


def _host_rng_state() -> dict[str, Any]:
    np_state = np.random.get_state()
    return {
        "random": random.getstate(),
        "numpy": (
            str(np_state[0]),
            torch.from_numpy(np.asarray(np_state[1], dtype=np.int64)),
            int(np_state[2]),
            int(np_state[3]),
            float(np_state[4]),
        ),
        "torch": torch.get_rng_state(),
    }


def capture_rng_state() -> dict[str, Any]:
    """This process's python, numpy, torch CPU, CUDA (when present) and Megatron tracker RNG states."""
    return {
        **_host_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        "tracker": _tracker_states(),
    }


def restore_rng_state(state: dict[str, Any]) -> None:
    """Set every RNG stream from ``capture_rng_state()``'s output (as loaded from a checkpoint).

    CUDA and tracker states are optional (``TrainerState.rng_state`` holds only python/numpy/torch).
    """
    random.setstate(_as_tuples(state["random"]))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None:
        if not torch.cuda.is_available():
            logger.warning("checkpoint holds CUDA RNG states but CUDA is unavailable; they are not restored")
        else:
            torch.cuda.set_rng_state_all(state["cuda"])
    if state.get("tracker"):
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        get_cuda_rng_tracker().set_states(state["tracker"])


def rng_state_sharded_object(key: str = RNG_STATE_KEY) -> ShardedObject:
    """This rank's RNG states as a ShardedObject (one shard per global rank) for a sharded state dict.

    For loading, pass the same object (its data is replaced by the loaded states); then
    ``restore_rng_state(loaded[key])``. Requires ``torch.distributed`` to be initialized.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    return ShardedObject(key, capture_rng_state(), (world,), (rank,), replica_id=0)


def _tracker_states() -> dict[str, torch.Tensor]:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    try:
        return dict(get_cuda_rng_tracker().get_states())
    except (RuntimeError, AssertionError):  # tracker not initialized / no CUDA on an unpatched CPU run
        return {}


def _as_tuples(value: Any) -> Any:
    if isinstance(value, list | tuple):
        return tuple(_as_tuples(v) for v in value)
    return value
