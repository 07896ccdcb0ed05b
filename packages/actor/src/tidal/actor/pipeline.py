"""Pipeline parallelism: which layers a stage holds, Megatron's 1F1B schedule, and what crosses stages.

Stage ``s`` of ``P`` holds the global layers ``[s * L / P, (s + 1) * L / P)`` (Megatron numbers them locally from 0
in the module names, globally in checkpoints), the word embedding on the first stage, the final norm and the output
layer on the last; with tied embeddings the last stage holds a copy of the embedding as its output weight (loaded
from the same HF tensor, its gradient summed with the first stage's every step).

The Actor drives ``megatron.core.pipeline_parallel.get_forward_backward_func()`` (1F1B without interleaving) with
``variable_seq_lengths``: every stage receives the same packed micro-batches (as every TP rank does), the first
stage embeds the tokens, activations travel between stages with their shapes, and the last stage runs tidal's
chunked log-prob head and the loss. What exists on the last stage only (log-probs, metrics) is broadcast over the
pipeline group; weight export broadcasts each HF tensor from the stage that owns it (``bridge``, ``hf_export``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func

logger = logging.getLogger(__name__)

_LAYER_PREFIX = "decoder.layers."


@dataclass(frozen=True, slots=True)
class PipelineStage:
    """One pipeline stage's share of a model of ``num_layers`` decoder layers (``size`` 1: the whole model)."""

    rank: int
    """This stage (0 = embeds the tokens)."""
    size: int
    """Number of stages."""
    num_layers: int
    """Decoder layers of the whole model (a multiple of ``size``)."""

    @classmethod
    def current(cls, num_layers: int) -> PipelineStage:
        """This process's stage from Megatron's parallel state."""
        if not parallel_state.model_parallel_is_initialized():
            return cls(rank=0, size=1, num_layers=num_layers)
        size = parallel_state.get_pipeline_model_parallel_world_size()
        return cls(rank=parallel_state.get_pipeline_model_parallel_rank(), size=size, num_layers=num_layers)

    @property
    def first(self) -> bool:
        """Holds the word embedding."""
        return self.rank == 0

    @property
    def last(self) -> bool:
        """Holds the final norm and the output layer (and computes the log-probs and the loss)."""
        return self.rank == self.size - 1

    @property
    def layer_offset(self) -> int:
        """Global index of this stage's first decoder layer."""
        return self.rank * (self.num_layers // self.size)

    def owner(self, megatron_name: str) -> int:
        """The stage holding a parameter named as in the whole model (``decoder.layers.<global index>...``)."""
        if megatron_name.startswith(_LAYER_PREFIX):
            return int(megatron_name[len(_LAYER_PREFIX) :].split(".", 1)[0]) // (self.num_layers // self.size)
        return 0 if megatron_name.startswith("embedding.") else self.size - 1

    def local_name(self, megatron_name: str) -> str:
        """The name of one of this stage's parameters in its own module (local layer index)."""
        if not megatron_name.startswith(_LAYER_PREFIX):
            return megatron_name
        index, rest = megatron_name[len(_LAYER_PREFIX) :].split(".", 1)
        return f"{_LAYER_PREFIX}{int(index) - self.layer_offset}.{rest}"


def broadcast_from_stage(tensor: torch.Tensor, owner: int) -> None:
    """Broadcast ``tensor`` (contiguous, in place) from stage ``owner`` to every stage of this pipeline."""
    group = parallel_state.get_pipeline_model_parallel_group()
    dist.broadcast(tensor, src=dist.get_global_rank(group, owner), group=group)


def broadcast_object_from_last_stage(obj: Any) -> Any:
    """The last stage's ``obj`` (picklable) on every stage of this pipeline."""
    group = parallel_state.get_pipeline_model_parallel_group()
    box = [obj]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, group.size() - 1), group=group)
    return box[0]


def run_schedule(
    model: torch.nn.Module,
    micro_batches: Sequence[Any],
    forward: Callable[[Any], Any],
    loss: Callable[[Any, Any], tuple[torch.Tensor, torch.Tensor, Any]],
    *,
    forward_only: bool,
) -> list[Any]:
    """Run ``micro_batches`` through Megatron's pipeline schedule (forward, and backward unless ``forward_only``).

    ``forward(mb)`` runs this stage's model on one micro-batch (the last stage returns what ``loss`` takes, the
    others their hidden states, which the schedule sends on). On the last stage ``loss(mb, output)`` returns
    ``(loss, num_tokens, data)``: the loss is back-propagated as is (``calculate_per_token_loss``: no rescaling)
    and ``data`` is collected. Returns the collected data, in micro-batch order (empty on other stages).
    """
    batches = iter(micro_batches)

    def forward_step(data_iterator, _model):
        mb = next(data_iterator)
        return forward(mb), lambda output: loss(mb, output)

    return get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=batches,
        model=model,
        num_microbatches=len(micro_batches),
        seq_length=max(int(getattr(mb, "num_tokens", 1)) for mb in micro_batches),  # unused: variable_seq_lengths
        micro_batch_size=1,
        forward_only=forward_only,
    )


def all_reduce_tied_embedding_grad(grad: torch.Tensor | None) -> None:
    """Sum the tied word embedding's gradient over its first-stage and last-stage copies (Megatron's embedding group).

    Megatron does this in ``finalize_model_grads``, which tidal does not use (its DP reduction is its own): after
    it, both copies take the same update, as the one shared matrix does at PP = 1.
    """
    if grad is None or not parallel_state.is_rank_in_embedding_group(ignore_virtual=True):
        return
    dist.all_reduce(grad, group=parallel_state.get_embedding_group())
