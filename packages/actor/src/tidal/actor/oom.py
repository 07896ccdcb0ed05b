"""An out-of-memory in a micro-batch, reported in one line with the budget the memory plan says would fit."""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable
from typing import TypeVar

import torch
from tidal.actor.errors import ActorOutOfMemoryError
from tidal.actor.megatron_holds import drop_dispatch_graphs
from tidal.actor.memory_plan import GIB

logger = logging.getLogger(__name__)

TRAIN_FLAG = "--max-tokens-per-gpu"
LOGPROB_FLAG = "--log-probs-max-tokens-per-gpu"
T = TypeVar("T")


def _peak_and_limit(device: torch.device) -> tuple[int, int]:
    if device.type != "cuda":
        return 0, 0
    return torch.cuda.max_memory_allocated(device), torch.cuda.get_device_properties(device).total_memory


def oom_message(*, what: str, tokens: int, peak: int, limit: int, flag: str, fitting_tokens: int | None) -> str:
    """The one line an out-of-memory becomes."""
    seen = f"peak {peak / GIB:.1f} GiB of the card's {limit / GIB:.1f} GiB" if limit else "host memory"
    if fitting_tokens and fitting_tokens >= tokens:
        advice = (
            f"the memory plan expected {tokens} tokens to fit (up to {fitting_tokens}), so something else holds memory "
            f"on the card (another process, co-located engines): lower {flag}"
        )
    elif fitting_tokens:
        advice = f"the memory plan says {flag} {fitting_tokens} fits: lower {flag} to it"
    elif fitting_tokens == 0:
        advice = "the memory plan says no micro-batch fits beside the weights and optimizer state"
    else:
        advice = f"lower {flag}"
    extra = "add --recompute-activations, " if flag == TRAIN_FLAG else ""
    return (
        f"out of GPU memory in the {what} pass on a micro-batch of {tokens} tokens ({seen}); {advice}, or "
        f"{extra}use --optimizer-cpu-offload or a larger --tensor-model-parallel-size"
    )


def run_reporting_oom[T](
    fn: Callable[[], T],
    *,
    what: str,
    tokens: int,
    device: torch.device,
    flag: str,
    fitting_tokens: Callable[[int], int | None],
    model: torch.nn.Module | None = None,
) -> T:
    """``fn()``, with a ``torch.OutOfMemoryError`` turned into an ``ActorOutOfMemoryError`` of one line.

    The error is raised after the handler has ended, so the failed pass's traceback (and the activations its frames
    hold) is dropped before the caller sees it; on a GPU some of that memory has still been seen held afterwards,
    so the caller should end the run rather than train on.

    Args:
        fn: the micro-batch's pass.
        what: the pass ("training", "log-prob").
        tokens: the micro-batch's token count.
        device: the actor's device.
        flag: the option that sets this pass's budget.
        fitting_tokens: called with the card's bytes, returns the plan's largest fitting budget (or None).
        model: the model whose pass it was: what its layers still hold of the failed pass is let go.
    """
    try:
        return fn()
    except torch.OutOfMemoryError:
        peak, limit = _peak_and_limit(device)
    if model is not None:
        forget_failed_pass(model)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    fits = fitting_tokens(limit) if limit else None
    message = oom_message(what=what, tokens=tokens, peak=peak, limit=limit, flag=flag, fitting_tokens=fits)
    logger.error(message)
    raise ActorOutOfMemoryError(message)


def forget_failed_pass(model: torch.nn.Module) -> None:
    """Drop what megatron-core's layers keep of a pass that raised.

    ``TransformerLayer.mlp_norm_manager`` holds the layer's input (a ``[tokens, 1, hidden]`` tensor) from the pre-MLP
    norm until the MLP's end, so an out-of-memory inside the MLP left it referenced (8 GiB after a 1M-token log-prob
    pass of an 8B model on an H100); an MoE layer's token dispatcher keeps its routing probabilities' graph
    (``tidal.actor.megatron_holds``).
    """
    drop_dispatch_graphs(model)
    for module in model.modules():
        if getattr(module, "mlp_norm_manager", None) is not None:
            module.mlp_norm_manager = None
