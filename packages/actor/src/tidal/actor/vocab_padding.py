"""Vocabulary padding for tensor parallelism: pad on load, mask the padded logits, strip on export.

The embedding and LM head are split over the TP ranks by vocabulary rows, so their row count must
be divisible by the TP size. When the HF ``vocab_size`` is not, the Megatron model is built with
``padded_vocab_size`` rows (rounded up to a multiple of ``128 * tp``, Megatron's
``--make-vocab-size-divisible-by 128`` rule), the extra rows are zero, and a forward hook on the
LM head sets the padded columns' logits to ``PADDED_LOGIT`` so that they carry no probability: the
log-probs and entropy equal those of the unpadded model (their gradient through the hook is zero,
so the padded rows stay zero). Export drops the padded rows. A vocabulary already divisible by the
TP size is left as it is.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

MAKE_VOCAB_SIZE_DIVISIBLE_BY = 128
"""Megatron's default ``--make-vocab-size-divisible-by``; the padded size is a multiple of this times TP."""
PADDED_LOGIT = -1e30
"""Logit of a padded vocabulary entry: finite (so ``p * logit`` is 0, not NaN, in the entropy) and
representable in bf16; ``exp(PADDED_LOGIT - max)`` is exactly 0 in fp32."""


def padded_vocab_size(vocab_size: int, tensor_model_parallel_size: int) -> int:
    """Rows of the Megatron embedding/LM head for an HF vocabulary at this TP size.

    ``vocab_size`` itself when divisible by the TP size; else the next multiple of ``128 * tp``.
    """
    tp = tensor_model_parallel_size
    if vocab_size % tp == 0:
        return vocab_size
    multiple = MAKE_VOCAB_SIZE_DIVISIBLE_BY * tp
    return -(-vocab_size // multiple) * multiple


def pad_vocab_rows(tensor: torch.Tensor, padded_size: int) -> torch.Tensor:
    """Append zero rows to a ``[vocab, ...]`` tensor up to ``padded_size`` rows."""
    extra = padded_size - tensor.size(0)
    if extra < 0:
        raise ValueError(f"cannot pad a vocabulary of {tensor.size(0)} rows down to {padded_size}")
    if extra == 0:
        return tensor
    return torch.cat([tensor, tensor.new_zeros((extra, *tensor.shape[1:]))])


def install_padded_logits_mask(model: torch.nn.Module, vocab_size: int, *, tp_rank: int) -> bool:
    """Mask the logits of padded vocabulary entries in ``model.output_layer`` (a forward hook).

    Args:
        model: a Megatron ``GPTModel`` whose LM head (``output_layer``, vocab-parallel) may be padded.
        vocab_size: the real (HF) vocabulary size.
        tp_rank: this rank's tensor-parallel rank (it holds rows ``[tp_rank * local, (tp_rank + 1) * local)``).

    Returns:
        True when this rank's slice holds padded entries and a hook was installed.
    """
    layer = model.output_layer
    local = layer.output_size_per_partition
    start = tp_rank * local
    num_real = max(0, min(local, vocab_size - start))
    if num_real == local:
        return False

    def mask_padded(_module, _args, output):
        logits, bias = output
        return logits.index_fill(-1, padded_ids.to(logits.device), PADDED_LOGIT), bias

    padded_ids = torch.arange(num_real, local)
    layer.register_forward_hook(mask_padded)
    logger.info("vocabulary padded to %d rows per rank; %d padded logits masked on this rank", local, local - num_real)
    return True
