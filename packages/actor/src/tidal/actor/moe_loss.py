"""Expert balance in a mixture-of-experts actor's step: the load-balancing loss's weight and metric, the expert load.

Megatron's router adds the loss (``moe_aux_loss_coeff`` x Switch Transformer's balance term, per MoE layer and
micro-batch) to the gradient through ``MoEAuxLossAutoScaler`` and records its value per layer in megatron's MoE
metrics tracker. tidal's policy loss is one mean over the step (every micro-batch of every data-parallel rank, whose
gradients are summed), so each micro-batch's balance loss is weighted 1 / (micro-batches of the whole step): the
step's balance loss is the mean over its micro-batches. The same weight holds under the pipeline schedule, which sets
the scale itself from the config's ``moe_grad_scale_func`` at every micro-batch; and the routers do not multiply the
loss by their micro-batch's token count (what megatron does under ``calculate_per_token_loss``, which tidal's pipeline
config sets for its own loss, already normalised by the step's loss tokens).

:class:`ExpertLoad` counts, in the training forwards, the tokens each router sends to each expert (every token of the
micro-batches, padding included), whatever the loss: ``train/moe_expert_load_max`` is the busiest expert's share
over the even share, averaged over the MoE layers (1.0: perfectly even; E: one expert takes every token).
"""

from __future__ import annotations

import functools

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


class ExpertLoad:
    """Tokens routed to each expert per MoE layer during the training forwards of a step (router forward hooks)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.counts: dict[str, torch.Tensor] = {}
        for name, module in model.named_modules():
            if isinstance(module, Router):
                module.register_forward_hook(functools.partial(self._count, name))

    def _count(self, name: str, module: torch.nn.Module, _args: object, output: tuple) -> None:
        if module.training and torch.is_grad_enabled():  # not the log-prob passes
            routed = output[1].sum(dim=0).float()  # routing map [tokens, experts]
            self.counts[name] = self.counts[name] + routed if name in self.counts else routed

    def reset(self) -> None:
        """Forget the counts (call at the start of a step)."""
        self.counts = {}

    def metric(self, device: torch.device) -> float:
        """The busiest expert's share over the even share, mean over the MoE layers, the same on every rank."""
        sums = torch.zeros(2, device=device)  # (sum over this stage's layers, number of layers)
        if self.counts:
            counts = torch.stack([self.counts[k] for k in sorted(self.counts)]).to(device)
            if parallel_state.get_data_parallel_world_size() > 1:
                dist.all_reduce(counts, group=parallel_state.get_data_parallel_group())
            ratio = counts.max(dim=1).values / counts.mean(dim=1).clamp_min(1e-12)
            sums = torch.stack([ratio.sum(), torch.tensor(float(len(ratio)), device=device)])
        if parallel_state.get_pipeline_model_parallel_world_size() > 1:
            dist.all_reduce(sums, group=parallel_state.get_pipeline_model_parallel_group())
        return float(sums[0] / sums[1].clamp_min(1))
