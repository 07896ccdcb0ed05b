"""The frozen teacher of on-policy distillation: a model of its own architecture on the actor's ranks.

``TeacherModel`` is a :class:`tidal.actor.ReferenceModel` built from ``--teacher-hf-checkpoint`` instead of the
actor's checkpoint: its own config.json (layers, width, heads, Qwen2/Qwen3 family), the actor's precision and
parallel layout, no adapters, parameters frozen and kept on the CPU between uses. The trainer computes its log-probs
of every sample's tokens before the rollout's first step (``"teacher_log_probs"``) and adds
``--teacher-kl-coef x (teacher - old log-prob)`` to each response token's advantage
(:func:`tidal.actor.trainer.train_on_rollout`).
"""

from __future__ import annotations

import dataclasses
import logging

from tidal.actor.config import ActorConfig
from tidal.actor.reference import ReferenceModel

logger = logging.getLogger(__name__)


def teacher_config(cfg: ActorConfig) -> ActorConfig:
    """The config the teacher is built from: ``cfg``'s precision and kernels on ``cfg.teacher_hf_checkpoint``."""
    if cfg.teacher_hf_checkpoint is None:
        raise ValueError("a teacher needs --teacher-hf-checkpoint DIR (the teacher's HF model dir)")
    return dataclasses.replace(
        cfg,
        hf_checkpoint=cfg.teacher_hf_checkpoint,
        teacher_hf_checkpoint=None,
        teacher_kl_coef=1.0,
        advantage_estimator="grpo",
        custom_advantage_function_path=None,
        lora_rank=0,
        use_rollout_routing_replay=False,
        fp32_main_params=False,
    )


class TeacherModel(ReferenceModel):
    """Frozen teacher log-probs (``teacher_log_probs``) of the actor's packed batches.

    Every rank of the actor group constructs it and calls ``compute_log_probs`` in the same order, like the actor.

    Args:
        cfg: the actor's config; the teacher is ``cfg.teacher_hf_checkpoint`` with the actor's precision and
            ``--rollout-temperature`` (its logits divided by it, as the actor's are).
        offload: keep the parameters on the CPU between uses (no-op on a CPU-only machine).
    """

    def __init__(self, cfg: ActorConfig, *, offload: bool = True) -> None:
        super().__init__(teacher_config(cfg), offload=offload)
        logger.info("teacher model from %s: %d parameters", cfg.teacher_hf_checkpoint, self.num_params)

    @property
    def num_params(self) -> int:
        """Parameters of this rank's teacher shard."""
        return sum(p.numel() for p in self.model.parameters())
