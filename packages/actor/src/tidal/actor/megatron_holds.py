"""What megatron-core's MoE layers keep of a training forward after it, let go as soon as the layer has run.

Megatron's token dispatcher keeps the router's probabilities of its last dispatch (``MoEAlltoAllTokenDispatcher.probs``,
a tensor with its autograd graph) until the layer's next forward overwrites it. With layer recompute, each layer's
forward re-run in backward builds a graph that is never back-propagated and keeps what its nodes saved: the
dispatchers of the layers already back-propagated held their recomputed graphs through the rest of the backward,
and the last micro-batch's past the step (7.4 GiB after a step of a Qwen3-30B-A3B-width model on an H100).
:func:`release_dispatch_graphs` drops the reference once the MoE layer's forward has returned (autograd keeps
what backward needs on its own). ``packages/actor/tests/test_moe.py`` fails when megatron-core stops keeping it
(then this module can go).
"""

from __future__ import annotations

import torch


def drop_dispatch_graphs(model: torch.nn.Module) -> int:
    """Set to None every tensor attribute with an autograd graph on ``model``'s MoE token dispatchers.

    Returns:
        How many attributes were dropped.
    """
    return sum(_drop(module) for module in model.modules())


def release_dispatch_graphs(model: torch.nn.Module) -> int:
    """Drop what each MoE layer's token dispatcher keeps with a graph as soon as the layer's forward returns.

    Returns:
        How many MoE layers got the hook.
    """
    layers = [m for m in model.modules() if getattr(m, "token_dispatcher", None) is not None]
    for layer in layers:
        layer.register_forward_hook(_after_forward)
    return len(layers)


def _after_forward(module: torch.nn.Module, _args: object, _output: object) -> None:
    _drop(module)  # returns None: a forward hook's non-None result would replace the layer's output


def _drop(module: torch.nn.Module) -> int:
    dispatcher = getattr(module, "token_dispatcher", None)
    if dispatcher is None:
        return 0
    dropped = 0
    for name, value in list(vars(dispatcher).items()):
        if isinstance(value, torch.Tensor) and value.grad_fn is not None:
            setattr(dispatcher, name, None)
            dropped += 1
    return dropped
