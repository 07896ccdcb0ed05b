"""The load-balancing loss of a mixture-of-experts actor's step: its weight in the gradient and its metric.

Megatron's router adds the loss (``moe_aux_loss_coeff`` x Switch Transformer's balance term, per MoE layer and
micro-batch) to the gradient through ``MoEAuxLossAutoScaler`` and records its value per layer in megatron's MoE
metrics tracker. tidal's policy loss is one mean over the step (every micro-batch of every data-parallel rank, whose
gradients are summed), so each micro-batch's balance loss is weighted 1 / (micro-batches of the whole step): the
step's balance loss is the mean over its micro-batches. The same weight holds under the pipeline schedule, which sets
the scale itself from the config's ``moe_grad_scale_func`` at every micro-batch; and the routers do not multiply the
loss by their micro-batch's token count (what megatron does under ``calculate_per_token_loss``, which tidal's pipeline
config sets for its own loss, already normalised by the step's loss tokens).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer.moe.moe_logging import (
    MoEMetricsTracker,
    get_moe_metrics_tracker,
    set_moe_metrics_tracker,
)
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
from megatron.core.transformer.moe.router import Router

_NAME = "load_balancing_loss"


class _StepScale:
    """The balance loss's weight in the current step, handed to megatron's pipeline schedule."""

    def __init__(self) -> None:
        self.scale = torch.ones(())

    def __call__(self) -> torch.Tensor:
        return self.scale


def prepare_model(model: torch.nn.Module) -> None:
    """Let the step's weight alone scale the balance loss: per-step scale for the schedule, no per-token factor."""
    for module in model.modules():
        if isinstance(module, Router):
            module.calculate_per_token_loss = False
    model.config.moe_grad_scale_func = _StepScale()


def begin_step(model: torch.nn.Module, num_micro_batches: int, device: torch.device) -> None:
    """Weight each micro-batch's balance loss 1 / ``num_micro_batches`` (the step's, all DP ranks); a fresh record."""
    scale = torch.tensor(1.0 / num_micro_batches, device=device)
    MoEAuxLossAutoScaler.set_loss_scale(scale)
    if isinstance(model.config.moe_grad_scale_func, _StepScale):
        model.config.moe_grad_scale_func.scale = scale
    set_moe_metrics_tracker(MoEMetricsTracker())  # megatron's process-wide record, sized by the first model it saw


def step_metric(*, num_moe_layers: int, num_micro_batches: int, recomputed: list[int], device: torch.device) -> float:
    """The step's balance loss (without the coefficient) per MoE layer and micro-batch, the same on every rank.

    ``recomputed`` lists the global (0-based) layer indices whose forward ran twice (activation recompute in
    backward), whose records are halved. Summed over the pipeline stages' layers, averaged over the data-parallel
    ranks (each one's ``num_micro_batches``).
    """
    entry = get_moe_metrics_tracker().metrics.get(_NAME)
    values = entry.values.detach().clone() if entry is not None else torch.zeros(1, device=device)
    if recomputed and entry is not None:
        values[[i for i in recomputed if i < values.numel()]] /= 2
    total = values.sum().to(device=device, dtype=torch.float32)
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        dist.all_reduce(total, group=parallel_state.get_pipeline_model_parallel_group())
    if parallel_state.get_data_parallel_world_size() > 1:
        dist.all_reduce(total, group=parallel_state.get_data_parallel_group())
        total /= parallel_state.get_data_parallel_world_size()
    get_moe_metrics_tracker().clear()
    return float(total) / max(num_moe_layers, 1) / num_micro_batches
