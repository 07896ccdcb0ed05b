"""One training rank's checkpoint IO, configured by its ``CkptConfig``: what to save where, what to load from where.

``CheckpointIO.from_config(cfg.ckpt)`` reads every checkpoint flag once (``--save``, ``--keep-last``,
``--async-save``, ``--load``, ``--ckpt-step``, ``--no-load-optim``, ``--no-load-rng``, ``--max-shard-bytes``), so
a trainer hands it its sharded state dict and gets back what to load into the model, without knowing the flags.
Each rank's RNG states (python, numpy, torch, CUDA, Megatron's tracker) travel in the checkpoint beside the model.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tidal.ckpt.config import DEFAULT_MAX_SHARD_BYTES

if TYPE_CHECKING:
    import torch
    from tidal.ckpt.checkpoint import CheckpointSaver
    from tidal.ckpt.config import CkptConfig


@dataclass(kw_only=True, slots=True)
class CheckpointIO:
    """Save and load Megatron checkpoints (with the rank's RNG state) and write HF copies; collective calls."""

    save_dir: str | None = None
    """Where :meth:`save` writes iterations (``--save``); None: saving is an error."""
    load_dir: str | None = None
    """What :meth:`load` reads (``--load``); None: nothing to resume from."""
    ckpt_step: int | None = None
    """Iteration to load instead of the tracker's (``--ckpt-step``)."""
    keep_last: int | None = None
    """Keep only the newest K iterations (``--keep-last``)."""
    async_save: bool = False
    """Return once the writer process started; published by the next save or :meth:`finalize` (``--async-save``)."""
    load_optimizer: bool = True
    """Load the optimizer section (False under ``--no-load-optim``)."""
    load_rng: bool = True
    """Load and restore this rank's RNG states (False under ``--no-load-rng``)."""
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES
    """Largest safetensors shard of an HF copy written by :meth:`save_hf` (``--max-shard-bytes``)."""
    _saver: CheckpointSaver | None = field(default=None, init=False, repr=False)
    """The saver of ``save_dir`` (it holds pending async saves), made at the first :meth:`save`."""

    @classmethod
    def from_config(cls, cfg: CkptConfig) -> CheckpointIO:
        """The checkpoint IO ``cfg``'s flags describe."""
        return cls(
            save_dir=cfg.save,
            load_dir=cfg.load,
            ckpt_step=cfg.ckpt_step,
            keep_last=cfg.keep_last,
            async_save=cfg.async_save,
            load_optimizer=not cfg.no_load_optim,
            load_rng=not cfg.no_load_rng,
            max_shard_bytes=cfg.max_shard_bytes,
        )

    def save(self, iteration: int, sharded_state_dict: dict[str, Any], *, common_state: dict[str, Any]) -> str:
        """Save ``sharded_state_dict`` plus this rank's RNG states as ``iteration`` into ``save_dir``.

        Returns:
            The iteration directory (under ``async_save`` it is published later, by the next save or
            :meth:`finalize`).

        Raises:
            ValueError: No ``save_dir``.
        """
        from tidal.ckpt.checkpoint import CheckpointSaver
        from tidal.ckpt.state import RNG_STATE_KEY, rng_state_sharded_object

        if self.save_dir is None:
            raise ValueError("saving a checkpoint needs --save DIR")
        if self._saver is None:
            self._saver = CheckpointSaver(self.save_dir, keep_last=self.keep_last, async_save=self.async_save)
        state = {**sharded_state_dict, RNG_STATE_KEY: rng_state_sharded_object()}
        saved = self._saver.save(iteration, state, common_state=common_state)
        return str(getattr(saved, "path", saved))

    def load(self, sharded_state_dict: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """Load ``load_dir`` into the sections of ``sharded_state_dict``, and the rank's RNG unless ``load_rng`` is off.

        Build ``sharded_state_dict`` with the optimizer only when :attr:`load_optimizer` is set.

        Returns:
            ``(state_dict, common_state)`` as :func:`tidal.ckpt.load_checkpoint` gives them, the RNG section
            taken out (already applied).

        Raises:
            ValueError: No ``load_dir``.
            CheckpointError: See :func:`tidal.ckpt.load_checkpoint`.
        """
        from tidal.ckpt.checkpoint import load_checkpoint
        from tidal.ckpt.state import RNG_STATE_KEY, restore_rng_state, rng_state_sharded_object

        if self.load_dir is None:
            raise ValueError("loading a checkpoint needs --load DIR")
        state = dict(sharded_state_dict)
        if self.load_rng:
            state[RNG_STATE_KEY] = rng_state_sharded_object()
        loaded, common = load_checkpoint(self.load_dir, state, ckpt_step=self.ckpt_step)
        rng = loaded.pop(RNG_STATE_KEY, None)
        if rng is not None:
            restore_rng_state(rng)
        return loaded, common

    def finalize(self) -> list[str]:
        """Wait until a pending ``async_save`` is durable and published (every rank calls it)."""
        return [] if self._saver is None else [str(p) for p in self._saver.finalize()]

    def save_hf(
        self,
        out_dir: str | Path,
        tensors: Iterable[tuple[str, torch.Tensor]],
        *,
        source_dir: str | Path | None = None,
        max_shard_bytes: int | None = None,
    ) -> str:
        """Write ``tensors`` as an HF checkpoint in shards of ``max_shard_bytes`` (default: ``--max-shard-bytes``)."""
        from tidal.ckpt.hf import save_hf_checkpoint

        shard = max_shard_bytes or self.max_shard_bytes
        return str(save_hf_checkpoint(out_dir, tensors, source_dir=source_dir, max_shard_bytes=shard))
