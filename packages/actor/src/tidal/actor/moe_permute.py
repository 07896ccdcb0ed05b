"""Token permutation of the all-to-all MoE dispatcher without atomic adds.

Megatron-core's unfused ``permute`` sorts a token's ``k`` copies by expert with ``index_select``, whose backward is
an ``index_add_`` into the token rows, and ``unpermute`` sums the expert outputs back with ``scatter_add_``: both
are atomic adds of ``k`` rows into each token's row, slow on a GPU at ``k = 8`` (and the fused versions need
Transformer Engine). With dropless top-k routing every token has exactly ``k`` copies, so both directions are a
gather by a permutation and a sum over ``k``:

* permute: ``permuted = tokens[sorted_indices]``; backward ``grad_tokens = grad_permuted[inverse].sum(1)``;
* unpermute: ``out = permuted[inverse].sum(1)``; backward ``grad_permuted = grad_out[sorted_indices]``;

where ``inverse[t]`` lists the positions of token ``t``'s copies in expert order. :func:`install` replaces the two
names in megatron's token-dispatcher module with these for the all-to-all dispatcher's calls (probabilities passed
to ``permute``, no fusion, no token dropping); every other call goes to megatron's own functions unchanged.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.moe import moe_utils, token_dispatcher

_INVERSE = "_tidal_inverse"  # attribute of the sorted indices a fast permute returned: the inverse [tokens, k]


class _Permute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tokens: torch.Tensor, sorted_indices: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(inverse)
        return tokens.index_select(0, sorted_indices)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (inverse,) = ctx.saved_tensors
        return _sum_copies(grad, inverse), None, None


class _Unpermute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, permuted: torch.Tensor, sorted_indices: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(sorted_indices)
        return _sum_copies(permuted, inverse)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (sorted_indices,) = ctx.saved_tensors
        return grad.index_select(0, sorted_indices), None, None


def _sum_copies(rows: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """Each token's ``k`` rows (positions ``inverse[t]``) summed: ``[tokens, hidden]``."""
    tokens, k = inverse.shape
    return rows.index_select(0, inverse.reshape(-1)).view(tokens, k, -1).sum(1, dtype=rows.dtype)


def permute(tokens, routing_map, probs=None, num_out_tokens=None, fused=False, drop_and_pad=False, **kwargs):
    """Megatron's ``permute``; the all-to-all dispatcher's dropless call runs without atomic adds."""
    num_tokens = tokens.shape[0]
    if (
        fused
        or drop_and_pad
        or probs is None
        or kwargs.get("align_size", 0)
        or num_out_tokens is None
        or num_tokens == 0
        or num_out_tokens % num_tokens
    ):
        return _megatron_permute(
            tokens, routing_map, probs=probs, num_out_tokens=num_out_tokens, fused=fused, drop_and_pad=drop_and_pad,
            **kwargs,
        )  # fmt: skip
    k = num_out_tokens // num_tokens
    routing_map = routing_map.bool()
    torch._assert_async(routing_map.sum(1).eq(k).all(), "MoE permute: a token not routed to exactly top-k experts")
    flat_sorted = routing_map.T.contiguous().reshape(-1).argsort(descending=True, stable=True)[:num_out_tokens]
    sorted_indices = flat_sorted % num_tokens
    permuted_probs = probs.T.contiguous().reshape(-1)[flat_sorted]
    inverse = sorted_indices.argsort(stable=True).view(num_tokens, k)
    permuted = _Permute.apply(tokens, sorted_indices, inverse)
    setattr(sorted_indices, _INVERSE, inverse)
    return permuted, permuted_probs, sorted_indices, None, kwargs.get("tokens_per_expert")


def unpermute(permuted_tokens, sorted_indices, restore_shape, probs=None, fused=False, **kwargs):
    """Megatron's ``unpermute``; after a fast :func:`permute` the copies are summed without atomic adds."""
    inverse = getattr(sorted_indices, _INVERSE, None)
    padded = kwargs.get("drop_and_pad") or kwargs.get("pad_offsets") is not None
    if inverse is None or fused or probs is not None or padded:
        return _megatron_unpermute(permuted_tokens, sorted_indices, restore_shape, probs=probs, fused=fused, **kwargs)
    return _Unpermute.apply(permuted_tokens, sorted_indices, inverse).view(restore_shape)


_megatron_permute = moe_utils.permute
_megatron_unpermute = moe_utils.unpermute


def install() -> None:
    """Route megatron's token dispatchers through :func:`permute` / :func:`unpermute` (idempotent)."""
    token_dispatcher.permute = permute
    token_dispatcher.unpermute = unpermute
