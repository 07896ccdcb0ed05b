"""Per-token log-probs and entropy from vocab-parallel logits, computed in chunks.

The LM head is column-parallel: each TP rank holds the logits of its ``V / tp`` slice of the
vocabulary. ``vocab_parallel_log_probs`` computes ``log softmax`` across ranks with two
all-reduces of ``[tokens]``-sized tensors (max and sum-exp) plus one for the target logit, so the
full ``[tokens, V]`` logits never exist on one rank.

``chunked_log_probs`` applies the LM head ``chunk_size`` tokens at a time. With autograd on,
each chunk runs under ``torch.utils.checkpoint`` so only the ``[tokens, hidden]`` input is kept
and each chunk's logits are rebuilt during backward. Peak extra memory, in bytes:

    forward:  ~ 3 * chunk_size * (V / tp) * 4      (fp32 logits, exp, softmax of ONE chunk)
    backward: ~ 4 * chunk_size * (V / tp) * 4      (recomputed chunk plus its gradient)

independent of the number of tokens (versus ``T * V / tp * 4`` for full logits).

With TP = 1 the log-softmax needs no cross-rank reductions: ``local_log_probs`` reads the (bf16) logits once into
an fp32 log-softmax (one kernel) instead of materialising fp32 logits, shifted logits and their exponentials
(~6 full passes over ``[chunk, V]``); with ``fused=True`` on CUDA it is two Triton kernels instead
(``logsumexp_kernel.fused_log_probs``: one row reduction forward, one elementwise pass backward).
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region
from torch.utils.checkpoint import checkpoint

logger = logging.getLogger(__name__)


def vocab_parallel_log_probs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    with_entropy: bool = False,
    group: dist.ProcessGroup | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of ``targets`` (and the entropy) under ``softmax(logits)`` split over the TP group.

    Args:
        logits: ``[N, V / tp]`` this rank's vocabulary slice (rank ``r`` holds ids ``[r*V/tp, (r+1)*V/tp)``).
        targets: int64 ``[N]`` global token ids.
        with_entropy: also return the entropy of each row's distribution.
        group: the tensor-parallel group (default: Megatron's).

    Returns:
        ``(log_probs [N], entropy [N] or None)`` in float32, differentiable w.r.t. ``logits``.
    """
    group = group if group is not None else parallel_state.get_tensor_model_parallel_group()
    tp_size = dist.get_world_size(group) if dist.is_initialized() else 1
    logits = logits.float()
    local_vocab = logits.size(-1)
    vocab_start = (dist.get_rank(group) if tp_size > 1 else 0) * local_vocab

    def reduce(x: torch.Tensor) -> torch.Tensor:
        return reduce_from_tensor_model_parallel_region(x, group=group) if tp_size > 1 else x

    row_max = logits.detach().max(dim=-1).values
    if tp_size > 1:
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
    shifted = logits - row_max.unsqueeze(-1)
    exp = shifted.exp()
    sum_exp = reduce(exp.sum(dim=-1))
    log_z = sum_exp.log()  # logsumexp minus row_max

    local_ids = targets - vocab_start
    in_slice = (local_ids >= 0) & (local_ids < local_vocab)
    picked = shifted.gather(-1, local_ids.clamp(0, local_vocab - 1).unsqueeze(-1)).squeeze(-1)
    target_shifted = reduce(torch.where(in_slice, picked, torch.zeros_like(picked)))
    log_probs = target_shifted - log_z

    entropy = None
    if with_entropy:
        # H = log Z - sum_v p_v * shifted_v, with p = exp / Z
        weighted = reduce((exp * shifted).sum(dim=-1))
        entropy = log_z - weighted / sum_exp
    return log_probs, entropy


def local_log_probs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of ``targets`` (and entropy) under ``softmax(logits / temperature)`` for a full vocabulary (TP = 1).

    Args:
        logits: ``[N, V]`` in any float dtype; the softmax is computed in float32.
        targets: int64 ``[N]``.
        temperature: divide the logits by it first.
        with_entropy: also compute the entropy (else the second output is zeros).
        entropy_grad: let gradients flow through the entropy (False: it is a metric only).

    Returns:
        ``(log_probs [N], entropy [N])`` float32.
    """
    if temperature != 1.0:
        logits = logits.float() / temperature
    logp = torch.log_softmax(logits, dim=-1, dtype=torch.float32)
    lp = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    if not with_entropy:
        return lp, torch.zeros_like(lp)
    src = logp if entropy_grad else logp.detach()
    return lp, -(src.exp() * src).sum(dim=-1)


def chunked_log_probs(
    hidden: torch.Tensor,
    output_layer: torch.nn.Module,
    output_weight: torch.Tensor | None,
    targets: torch.Tensor,
    *,
    chunk_size: int,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = True,
    fused: bool = False,
    recompute: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Apply the (column-parallel) LM head chunk by chunk and return log-probs of ``targets``.

    Args:
        hidden: ``[N, 1, hidden]`` final hidden states (after the final norm).
        output_layer: Megatron's ``ColumnParallelLinear`` LM head.
        output_weight: the shared embedding weight when embeddings are tied, else None.
        targets: int64 ``[N]`` token each row should predict.
        chunk_size: rows per chunk.
        temperature: logits are divided by it first (the sampling temperature of the rollout).
        with_entropy: also return the per-row entropy.
        entropy_grad: let gradients flow through the entropy (False when it is only a metric).
        fused: with TP = 1 on CUDA, run the log-softmax as Triton kernels (``fused_log_probs``).
        recompute: with autograd on, rebuild each chunk's logits in backward (else keep them: faster, but
            ~2 bytes x rows x V / tp more memory).

    Returns:
        ``(log_probs [N], entropy [N] or None)``, float32.
    """
    tp1 = parallel_state.get_tensor_model_parallel_world_size() == 1

    def one_chunk(h: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits, _ = output_layer(h, weight=output_weight)
        if fused and tp1 and logits.is_cuda:  # one Triton reduction forward, one elementwise pass backward
            from tidal.actor.logsumexp_kernel import fused_log_probs

            return fused_log_probs(
                logits.squeeze(1), t, temperature=temperature, with_entropy=with_entropy, entropy_grad=entropy_grad
            )
        if tp1:
            return local_log_probs(
                logits.squeeze(1), t, temperature=temperature, with_entropy=with_entropy, entropy_grad=entropy_grad
            )
        logits = logits.squeeze(1).float()
        if temperature != 1.0:
            logits = logits / temperature
        lp, ent = vocab_parallel_log_probs(logits, t, with_entropy=with_entropy)
        return lp, ent if ent is not None else torch.zeros_like(lp)

    lps, ents = [], []
    for start in range(0, hidden.size(0), chunk_size):
        h, t = hidden[start : start + chunk_size], targets[start : start + chunk_size]
        if recompute and torch.is_grad_enabled() and h.requires_grad:
            lp, ent = checkpoint(one_chunk, h, t, use_reentrant=False)
        else:
            lp, ent = one_chunk(h, t)
        lps.append(lp)
        ents.append(ent)
    return torch.cat(lps), (torch.cat(ents) if with_entropy else None)


def to_token_convention(row_values: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Shift per-row predictions to tidal's per-token convention.

    Row ``t`` of the model predicts token ``t + 1``; the convention stores at position ``t`` the
    log-prob of ``tokens[t]`` given the tokens of the same sequence before it, and 0 at each
    sequence's first token (which has no prediction).
    """
    shifted = torch.cat([row_values.new_zeros(1), row_values[:-1]])
    # index_fill_ with a Python scalar: ``x[idx] = 0`` would copy the 0 from the host and make the host wait
    return shifted.index_fill_(0, cu_seqlens[:-1].long().clamp(max=shifted.numel() - 1), 0.0)
