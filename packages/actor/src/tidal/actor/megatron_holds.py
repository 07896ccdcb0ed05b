"""What megatron-core's MoE layers keep of a training forward after it, let go where tidal knows it is stale.

Megatron's token dispatcher keeps the router's probabilities of its last dispatch (``MoEAlltoAllTokenDispatcher.probs``,
a tensor with its autograd graph) until the next forward overwrites it. With layer recompute, the last dispatch of a
micro-batch is the one re-run in backward, whose graph is never back-propagated and so keeps what its nodes saved:
7.4 GiB after a step of a Qwen3-30B-A3B-width model on an H100 (the last micro-batch's q/k/v and layer outputs), held
into the next micro-batch and past the step. ``packages/actor/tests/test_moe.py`` fails when megatron-core stops
keeping it (then this module can go).
"""

from __future__ import annotations

import torch


def drop_dispatch_graphs(model: torch.nn.Module) -> int:
    """Set to None every tensor attribute with an autograd graph on ``model``'s MoE token dispatchers.

    Call only between micro-batches (after a backward, or after a pass that raised): the next forward sets them again.

    Returns:
        How many attributes were dropped.
    """
    dropped = 0
    for module in model.modules():
        dispatcher = getattr(module, "token_dispatcher", None)
        if dispatcher is None:
            continue
        for name, value in list(vars(dispatcher).items()):
            if isinstance(value, torch.Tensor) and value.grad_fn is not None:
                setattr(dispatcher, name, None)
                dropped += 1
    return dropped
