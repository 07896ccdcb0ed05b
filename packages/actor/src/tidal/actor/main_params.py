"""fp32 main (master) copies of half-precision model parameters: Megatron-style mixed precision.

With ``params_dtype="bfloat16"`` and ``fp32_main_params=True`` the model holds bf16 parameters, so forward and
backward run in bf16 with no autocast (no per-micro-batch cast of every weight, a bf16 residual stream, bf16 saved
activations), while the optimizer works on fp32 copies: RL learning rates (~1e-6) are far below bf16's resolution
(~4e-3 relative), so an update applied to bf16 weights directly would vanish.

Gradients: autograd writes each parameter's bf16 gradient; a post-accumulate-grad hook adds it into the fp32
``.grad`` of the parameter's main copy and frees it, so accumulation over micro-batches is in fp32 and at most one
bf16 gradient per parameter exists at a time. Linear layers under megatron's gradient-accumulation fusion skip the
bf16 gradient: their weight-gradient GEMM adds into ``param.main_grad``, the same fp32 tensor. Memory per parameter:
2 (bf16) + 4 (main) + 4 (main grad) + 8 (Adam) = 18 bytes, against 16 for fp32 parameters, but activations are half
the size and no bf16 weight copies are cached.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

# Attributes megatron-core sets on parameters that tidal's DP reduction and TP-aware clipping read.
_PARAM_ATTRS = (
    "tensor_model_parallel",
    "partition_dim",
    "partition_stride",
    "sequence_parallel",
    "shared",
    "allreduce",  # False on MoE experts: summed over the expert-data-parallel group
)


class MainParams:
    """fp32 main copies of ``params`` (same order) with fp32 gradient accumulation.

    Args:
        params: the model's trainable (bf16/fp16) parameters.
    """

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        self.model_params = params
        self.main: list[torch.nn.Parameter] = []
        for p in params:
            main = torch.nn.Parameter(p.detach().to(torch.float32, copy=True))
            for attr in _PARAM_ATTRS:
                if hasattr(p, attr):
                    setattr(main, attr, getattr(p, attr))
            main.grad = torch.zeros_like(main)
            p.main_grad = main.grad  # where megatron's gradient-accumulation fusion adds linear weight gradients
            self.main.append(main)
        self._handles = [
            p.register_post_accumulate_grad_hook(_accumulator(m)) for p, m in zip(params, self.main, strict=True)
        ]

    def zero_grad(self) -> None:
        """Zero the fp32 gradients (kept allocated) and drop any half-precision gradient left on the model."""
        torch._foreach_zero_([m.grad for m in self.main])
        for p in self.model_params:
            p.grad = None

    @torch.no_grad()
    def copy_to_model(self) -> None:
        """Round the fp32 main parameters into the model's parameters (after an optimizer step)."""
        torch._foreach_copy_(self.model_params, self.main)

    @torch.no_grad()
    def copy_from_model(self) -> None:
        """Set the main parameters from the model's (after loading model weights only)."""
        torch._foreach_copy_(self.main, self.model_params)


def _accumulator(main: torch.nn.Parameter):
    def hook(param: torch.Tensor) -> None:
        if param.grad is None:  # gradient-accumulation fusion: the GEMM already added it into main_grad
            return
        main.grad.add_(param.grad)
        param.grad = None

    return hook
