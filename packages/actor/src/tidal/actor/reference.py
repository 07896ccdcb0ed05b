"""The frozen reference policy for the KL term: built like the actor, loaded from HF or ``--ref-load``, offloadable.

``ReferenceModel`` wraps an ``Actor`` built from the same ``ActorConfig`` (same architecture, parallel
layout, packed/CP forward and log-prob code), freezes its parameters, and never creates optimizer
state (AdamW allocates it lazily, at the first step, which never comes). Its weights come from the HF
checkpoint (copied from the actor built from it, when given one: the checkpoint is then read once, not twice), or
from a Megatron checkpoint written by ``tidal.ckpt.save_checkpoint`` (``--ref-load``, with no HF weights read).

With ``offload=True`` the parameters live on the CPU between uses: ``compute_log_probs`` moves them to
the device, computes, and moves them back, so the reference costs no accelerator memory while the
actor trains. On a CPU-only machine offloading is a no-op.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Iterator
from pathlib import Path

import torch
from tidal.actor.actor import Actor
from tidal.actor.config import ActorConfig
from tidal.batching import PackedBatch

logger = logging.getLogger(__name__)


class ReferenceModel:
    """Frozen reference log-probs (``ref_log_probs``) on packed batches.

    Every rank of the actor group constructs it and calls ``compute_log_probs`` in the same order
    (TP/CP collectives), like the ``Actor``.

    Args:
        cfg: the actor's config (the reference has the same architecture and precision).
        load_dir: a Megatron checkpoint dir (``--ref-load``) holding the reference weights; None keeps
            the weights of ``cfg.hf_checkpoint``.
        ckpt_step: iteration to load from ``load_dir`` (default: the latest).
        offload: keep the parameters on the CPU between uses.
        weights_from: the actor built from ``cfg.hf_checkpoint`` and not trained yet: its parameters are copied
            instead of reading the checkpoint again (ignored with ``load_dir``).
    """

    def __init__(
        self,
        cfg: ActorConfig,
        *,
        load_dir: str | Path | None = None,
        ckpt_step: int | None = None,
        offload: bool = True,
        weights_from: Actor | None = None,
    ) -> None:
        if cfg.fp32_main_params:  # a frozen model needs no fp32 main copies
            cfg = dataclasses.replace(cfg, fp32_main_params=False)
        weights = "checkpoint" if load_dir is not None else (weights_from or "hf")
        self._actor = Actor(cfg, weights=weights)
        if load_dir is not None:
            from tidal.ckpt import load_checkpoint

            state, _ = load_checkpoint(
                load_dir, self._actor.sharded_state_dict(with_optimizer=False), ckpt_step=ckpt_step, flag="--ref-load"
            )
            self._actor.load_state_dict(state)
        for p in self._actor.model.parameters():
            p.requires_grad_(False)
        self._actor.model.eval()
        self.device = self._actor.device
        self.offload_between_uses = offload
        self.offloaded = False
        self._holds = 0  # open ``loaded()`` contexts
        if offload:
            self.offload()
        logger.info("reference model from %s (offload between uses: %s)", load_dir or cfg.hf_checkpoint, offload)

    @property
    def hf_bytes_read(self) -> int:
        """Bytes of HF weights this rank read to build the reference (0 when copied from the actor or loaded)."""
        return self._actor.hf_bytes_read

    @property
    def model(self) -> torch.nn.Module:
        """The frozen Megatron model."""
        return self._actor.model

    def offload(self) -> None:
        """Move the parameters to the CPU (and release the cached device memory)."""
        if self.device.type == "cpu":
            self.offloaded = True
            return
        self.model.to("cpu")
        torch.cuda.empty_cache()
        self.offloaded = True

    def onload(self) -> None:
        """Move the parameters back to the device."""
        if self.offloaded and self.device.type != "cpu":
            self.model.to(self.device)
        self.offloaded = False

    @contextlib.contextmanager
    def loaded(self) -> Iterator[ReferenceModel]:
        """Keep the parameters on the device for several ``compute_log_probs`` calls (one transfer each way)."""
        self.onload()
        self._holds += 1
        try:
            yield self
        finally:
            self._holds -= 1
            if self._holds == 0 and self.offload_between_uses:
                self.offload()

    @torch.no_grad()
    def compute_log_probs(self, batch: PackedBatch) -> torch.Tensor:
        """Reference log-probs of ``batch.tokens`` (tidal's convention): float32 ``[T]`` on CPU.

        Loads the parameters onto the device first when offloaded, and offloads them again after
        when ``offload`` was requested (unless inside ``loaded()``).
        """
        with self.loaded():
            return self._actor.compute_log_probs(batch)
