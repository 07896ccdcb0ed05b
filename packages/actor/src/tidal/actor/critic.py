"""PPO's critic: the actor's architecture with a scalar value head, its own AdamW, trained on the value loss.

``Critic`` is an :class:`tidal.actor.Actor` (same HF checkpoint, parallel layout, packed/CP forward, pipeline
schedule, gradient all-reduce and clipping, offload and checkpoint code) whose last stage ends in a
:class:`tidal.actor.bridge.ValueHead` (hidden -> 1, zero-initialised) instead of the LM head, whose learning rate
is ``--critic-lr``, and whose loss is :func:`tidal.actor.loss.critic_loss` (``--value-clip``). It lives in the
actor's processes, on the actor's GPUs (slime's colocated critic), so it adds one model and its optimizer state to
each rank's memory; ``offload()`` moves it off the device like the actor.

Values follow tidal's token convention: ``values[t]`` is the value of the state before token ``t`` (the hidden
state at ``t - 1``), aligned with the log-prob of token ``t`` and the loss mask.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import torch
from tidal.actor.actor import Actor
from tidal.actor.config import ActorConfig
from tidal.actor.loss import critic_loss
from tidal.batching import PackedBatch

logger = logging.getLogger(__name__)

CHECKPOINT_SECTIONS = {"model": "critic_model", "optimizer": "critic_optimizer"}
"""The sections of a tidal checkpoint that hold the critic, beside the actor's "model" and "optimizer"."""


class Critic(Actor):
    """One rank's share of the value model; every rank of the actor group builds one and calls it in step.

    Args:
        cfg: the actor's config: the critic is built from ``cfg.hf_checkpoint``, trains with ``cfg.critic_lr``
            (``cfg.lr`` when None) and clips its values by ``cfg.value_clip``.
        load_dir: a tidal checkpoint dir whose ``"critic_model"`` section initialises the critic (``--critic-load``);
            None: the HF checkpoint's backbone and a zero value head.
        ckpt_step: iteration to load from ``load_dir`` (default: the latest).
        weights: where the backbone's initial weights come from, as for :class:`tidal.actor.Actor`: ``"hf"``
            reads the checkpoint, the actor built from it lends its parameters (nothing read), ``"checkpoint"``
            reads nothing for a checkpoint loaded next (always so with ``load_dir``).
    """

    value_head = True
    kind = "critic"
    metric_prefix = "critic"
    ckpt_prefix = "critic."

    def __init__(
        self,
        cfg: ActorConfig,
        *,
        load_dir: str | Path | None = None,
        ckpt_step: int | None = None,
        weights: str | Actor = "hf",
    ) -> None:
        lr = cfg.lr if cfg.critic_lr is None else cfg.critic_lr
        # the actor's loss options do not apply to the value loss
        cfg = dataclasses.replace(cfg, lr=lr, entropy_coef=0.0, loss_type="policy_loss", custom_loss_function_path=None)
        super().__init__(cfg, weights="checkpoint" if load_dir is not None else weights)
        self._loss_fn = critic_loss
        self.loss_settings = dataclasses.replace(self.loss_settings, value_clip=cfg.value_clip)
        if load_dir is not None:
            from tidal.ckpt import load_checkpoint

            request = self.checkpoint_sections(with_optimizer=False)
            state, _ = load_checkpoint(load_dir, request, ckpt_step=ckpt_step, flag="--critic-load")
            self.load_checkpoint_sections(state)
            logger.info("critic loaded from %s", load_dir)

    def checkpoint_sections(self, *, with_optimizer: bool = True) -> dict:
        """``sharded_state_dict()`` as the checkpoint sections ``critic_model`` (and ``critic_optimizer``)."""
        return {CHECKPOINT_SECTIONS[k]: v for k, v in self.sharded_state_dict(with_optimizer=with_optimizer).items()}

    def load_checkpoint_sections(self, state: dict) -> None:
        """Load the critic's sections of what ``tidal.ckpt`` loaded (other sections are ignored)."""
        self.load_state_dict({k: state[v] for k, v in CHECKPOINT_SECTIONS.items() if v in state})

    def _head(self, targets: torch.Tensor, *, with_entropy: bool):
        del targets, with_entropy  # a value per row, whatever the next token

        def head(*, hidden_states, output_layer, **_):
            return output_layer(hidden_states).float().reshape(-1), None  # [S, 1, 1] -> [S]

        return head

    def compute_values(self, batch: PackedBatch) -> torch.Tensor:
        """Values of ``batch`` under the current weights: float32 ``[T]`` on CPU, ``values[t]`` = V(tokens[:t])."""
        return self.compute_log_probs(batch)

    def named_hf_tensors(self):
        """A critic has no HF export (no LM head); its weights travel in tidal checkpoints only."""
        raise NotImplementedError("the critic's weights are saved in tidal checkpoints, not exported as HF tensors")

    def hf_tensor_buckets(self, **_):
        """A critic is never synced to the engines."""
        raise NotImplementedError("the critic is not synced to the rollout engines")
