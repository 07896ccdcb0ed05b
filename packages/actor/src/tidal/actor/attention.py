"""Core attention over packed (THD) sequences, for Megatron's local layer spec.

Megatron's local ``DotProductAttention`` refuses ``packed_seq_params`` (it points at Transformer
Engine). ``PackedCoreAttention`` takes its place in the layer spec: the attention module hands it
``query [T, heads, dim]`` and ``key/value [T, groups, dim]`` plus ``PackedSeqParams`` with
``cu_seqlens``; each segment attends causally to itself only.

* CUDA with fp16/bf16 inputs or under bf16/fp16 autocast: ``torch.nn.attention.varlen.varlen_attn``
  (FlashAttention varlen);
  it has no ``is_causal``, causal is ``window_size=(-1, 0)``. When the caller passes the segment bounds on the host
  (``HostPackedSeqParams``), segments of at least ``cudnn_min_segment`` tokens (the Actor's
  ``--cudnn-attention-min-tokens``, ``set_cudnn_min_segment``) go to cuDNN's attention instead
  (faster than FlashAttention-2 on Hopper), each padded at its end to one of ``CUDNN_BUCKETS_PER_OCTAVE`` lengths per
  power of two, so that cuDNN builds a bounded number of kernel plans however the rollout's lengths vary.
* Otherwise (CPU, or fp32 on CUDA): causal ``scaled_dot_product_attention`` per segment.

Both give the same numbers as attending to each sequence unpacked (tested).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import itertools
import logging
import math

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import divide
from tidal.actor.transfer import to_device

logger = logging.getLogger(__name__)

# A long segment is padded at its end to a multiple of 1/32 of its power of two (at most ~3% more tokens): cuDNN
# builds (~0.1 s) and caches one plan per shape, and 32 lengths per octave bound them to ~100 up to 32k tokens.
CUDNN_BUCKETS_PER_OCTAVE = 32


@dataclasses.dataclass
class HostPackedSeqParams(PackedSeqParams):
    """``PackedSeqParams`` plus the segment bounds as host integers.

    With them attention can route segments by length without reading ``cu_seqlens`` back from the device per layer.
    """

    host_cu_seqlens: tuple[int, ...] | None = None
    route_cache: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)
    """``route_by_length``'s plan for these bounds, made by the first layer and reused by the others."""


def cudnn_bucket_length(length: int) -> int:
    """The padded length a segment of ``length`` tokens is given for cuDNN: the next multiple of 1/32 of its octave."""
    step = max(1, (1 << (length.bit_length() - 1)) // CUDNN_BUCKETS_PER_OCTAVE)
    return -(-length // step) * step


def _own_saved_tensors():
    """Saved-tensor hooks that keep tensors as they are, shadowing outer ones (an activation checkpoint's)."""
    return torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)


def sdpa_backend_error(device: torch.device, backend) -> str | None:
    """Why SDPA's ``backend`` fails a tiny causal GQA forward and backward on ``device``; None when it runs.

    The probe runs with gradients on whatever mode the caller is in: the first long segment often arrives in a
    log-prob pass under ``torch.no_grad()``, and the answer is kept for training too. Its saved tensors bypass any
    saved-tensor hooks in effect: asked for the first time inside a recomputed layer, the probe's tensors would
    otherwise count as the layer's, and the recomputation (which finds the answer cached) would save fewer.
    """
    from torch.nn.attention import sdpa_kernel

    try:
        with torch.inference_mode(False), torch.enable_grad(), _own_saved_tensors():
            q = torch.randn(1, 4, 64, 128, device=device, dtype=torch.bfloat16, requires_grad=True)
            k = torch.randn(1, 2, 64, 128, device=device, dtype=torch.bfloat16, requires_grad=True)
            with sdpa_kernel([backend]):
                F.scaled_dot_product_attention(q, k, k, is_causal=True, enable_gqa=True).sum().backward()
        return None
    except (RuntimeError, ValueError) as exc:
        return str(exc)[:200]


@functools.cache
def cudnn_attention_usable(device_index: int) -> bool:
    """Whether cuDNN's attention runs on this GPU (cuDNN present, a GPU it supports); asked once per process."""
    from torch.nn.attention import SDPBackend

    error = sdpa_backend_error(torch.device("cuda", device_index), SDPBackend.CUDNN_ATTENTION)
    if error is not None:
        logger.warning("cuDNN attention unavailable (%s): long segments use FlashAttention-2", error)
    return error is None


def padded_segment_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float, backend=None
) -> torch.Tensor:
    """Causal attention over one segment ``[L, h, d]``, padded at its end to ``cudnn_bucket_length(L)``.

    ``backend``: the SDPA backend (default cuDNN; the CPU tests take the math one). Padding at the end of a causal
    sequence changes no real row's output or gradient.
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel

    length = query.size(0)
    pad = cudnn_bucket_length(length) - length
    q, k, v = (F.pad(x, (0, 0, 0, 0, 0, pad)) if pad else x for x in (query, key, value))
    q, k, v = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))  # [1, h, L', d], the sequence dim strided
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION if backend is None else backend]):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=q.size(1) != k.size(1))
    return out[0].transpose(0, 1)[:length]


def route_by_length(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    bounds: tuple[int, ...],
    min_long: int,
    long_fn,
    short_fn,
    cache: dict | None = None,
) -> torch.Tensor:
    """Segments of ``min_long`` tokens or more through ``long_fn(q, k, v)``, shorter ones through ``short_fn``.

    Each run of consecutive short segments is one ``short_fn(q, k, v, cu_seqlens, max_seqlen)`` call (varlen);
    outputs are concatenated in token order, so gradients flow back through one split per input. ``cache``: a
    dict that lives as long as ``bounds`` (``HostPackedSeqParams.route_cache``): the plan and the runs'
    ``cu_seqlens`` on the device are made once and reused by every layer.
    """
    cache_key = (min_long, query.device)
    plan = None if cache is None else cache.get(cache_key)
    if plan is None:
        plan = _route_plan(bounds, min_long, query.device)
        if cache is not None:
            cache[cache_key] = plan
    sizes, runs = plan
    outputs = []
    for run, q, k, v in zip(runs, query.split(sizes), key.split(sizes), value.split(sizes), strict=True):
        outputs.append(long_fn(q, k, v) if run is None else short_fn(q, k, v, *run))
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs)


def _route_plan(bounds: tuple[int, ...], min_long: int, device: torch.device):
    """``route_by_length``'s pieces: their sizes, and per piece None (a long segment) or a run's (cu_seqlens, max)."""
    pieces: list[tuple[bool, list[int]]] = []  # (long?, bounds of the segment or of the run of short ones)
    for start, end in itertools.pairwise(bounds):
        if end - start >= min_long:
            pieces.append((True, [start, end]))
        elif pieces and not pieces[-1][0]:
            pieces[-1][1].append(end)
        else:
            pieces.append((False, [start, end]))
    runs = []
    for long, piece in pieces:
        if long:
            runs.append(None)
            continue
        local = torch.tensor([b - piece[0] for b in piece], dtype=torch.int32)
        with torch.inference_mode(False):  # the plan may be made under inference mode and kept for autograd
            local = to_device(local, device)
        runs.append((local, max(b - a for a, b in itertools.pairwise(piece))))
    return [piece[-1] - piece[0] for _, piece in pieces], runs


@functools.cache
def _varlen_attn_supports_gqa() -> bool:
    from torch.nn.attention.varlen import varlen_attn

    return "enable_gqa" in inspect.signature(varlen_attn).parameters


def packed_causal_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    *,
    scale: float,
    host_cu_seqlens: tuple[int, ...] | None = None,
    cudnn_min_segment: int | None = None,
    route_cache: dict | None = None,
) -> torch.Tensor:
    """Causal attention within each packed segment.

    Args:
        query: ``[T, heads, dim]``.
        key: ``[T, groups, dim]`` with ``heads % groups == 0`` (grouped-query attention).
        value: ``[T, groups, dim]``.
        cu_seqlens: int32 ``[segments + 1]`` segment boundaries, ``cu_seqlens[-1] == T``.
        max_seqlen: the longest segment.
        scale: softmax scale (usually ``dim ** -0.5``).
        host_cu_seqlens: ``cu_seqlens`` as host integers, if the caller has them: on CUDA in fp16/bf16, segments of
            ``cudnn_min_segment`` tokens or more then go through cuDNN's attention (None: none do).
        cudnn_min_segment: see ``host_cu_seqlens``.
        route_cache: see ``route_by_length``.

    Returns:
        ``[T, heads, dim]``, the attention output for every token.
    """
    num_heads, num_groups = query.size(1), key.size(1)
    dtype = query.dtype
    if query.is_cuda and torch.is_autocast_enabled("cuda"):
        # RoPE multiplies by fp32 tables, so q/k arrive in fp32 even under bf16 autocast.
        dtype = torch.get_autocast_dtype("cuda")
    if query.is_cuda and dtype in (torch.float16, torch.bfloat16):
        from torch.nn.attention.varlen import varlen_attn

        query, key, value = (x.to(dtype) for x in (query, key, value))

        cu = cu_seqlens.to(device=query.device, dtype=torch.int32)
        # Grouped k/v go in as they are: FlashAttention's varlen kernel takes fewer k/v heads than q heads. torch
        # 2.11's varlen_attn has no enable_gqa flag but passes them through (outputs and gradients identical to
        # repeated k/v and faster, bench/RESULTS.md); later torch asks for it.
        kwargs = {"enable_gqa": True} if num_heads != num_groups and _varlen_attn_supports_gqa() else {}

        def flash(q, k, v, cu, max_len):
            return varlen_attn(q, k, v, cu, cu, max_len, max_len, scale=scale, window_size=(-1, 0), **kwargs)

        if (
            host_cu_seqlens is not None
            and cudnn_min_segment is not None
            and host_cu_seqlens[-1] == query.size(0)
            and max_seqlen >= cudnn_min_segment
            and cudnn_attention_usable(query.device.index or 0)
        ):
            long_fn = functools.partial(padded_segment_attention, scale=scale)
            return route_by_length(
                query, key, value, host_cu_seqlens, cudnn_min_segment, long_fn, flash, cache=route_cache
            )
        return flash(query, key, value, cu, max_seqlen)
    gqa = num_heads != num_groups
    if query.is_cuda and gqa:  # SDPA's enable_gqa sends fp32 to the math kernel: a [heads, T, T] matrix at 32k
        key = key.repeat_interleave(num_heads // num_groups, dim=1)
        value = value.repeat_interleave(num_heads // num_groups, dim=1)
        gqa = False
    # Segments of one length go through ONE batched SDPA call: a rollout of short samples has a few distinct
    # lengths but hundreds of segments, and a call (and its backward) per segment cost most of a CPU training step.
    bounds = cu_seqlens.tolist()
    by_length: dict[int, list[int]] = {}
    for start, end in itertools.pairwise(bounds):
        if end > start:
            by_length.setdefault(end - start, []).append(start)
    rows, outputs = [], []
    for length, starts in by_length.items():
        index = torch.tensor(starts, device=query.device)[:, None] + torch.arange(length, device=query.device)
        # [segments, len, h, d] -> [segments, h, len, d] for SDPA (4-D: 3-D input takes the math kernel on CUDA)
        q, k, v = (x[index].transpose(1, 2) for x in (query, key, value))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
        outputs.append(out.transpose(1, 2).reshape(-1, num_heads, out.size(-1)))
        rows.append(index.reshape(-1))
    if len(outputs) == 1 and len(by_length[length]) == 1:
        return outputs[0]
    rows_cat = torch.cat(rows)
    order = torch.empty_like(rows_cat)
    order[rows_cat] = torch.arange(rows_cat.numel(), device=rows_cat.device)
    return torch.cat(outputs)[order]


class CausalCoreAttentionBase(MegatronModule):
    """What tidal's core-attention modules share: Megatron's constructor arguments, their checks, head bookkeeping.

    The constructor takes the arguments Megatron's ``SelfAttention`` passes to its ``core_attention``
    submodule. Only causal self-attention without dropout, softmax offsets or sliding windows is supported;
    anything else raises ``ValueError`` at construction. Subclasses set ``_name`` (for messages) and
    ``_required_pgs`` (the process groups they need from ``pg_collection``).
    """

    _name = "core attention"
    _required_pgs = ("tp",)

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: ProcessGroupCollection | None = None,
    ) -> None:
        super().__init__(config=config)
        del attention_type, cp_comm_type
        name = self._name
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout != 0.0:
            raise ValueError(f"{name} has no attention dropout; set attention_dropout=0, got {dropout}")
        if config.window_size is not None or config.softmax_type != "vanilla":
            raise ValueError(f"{name} supports plain causal softmax attention only (no window/offset)")
        if attn_mask_type != AttnMaskType.causal:
            raise ValueError(f"{name} is causal only, got attn_mask_type={attn_mask_type}")
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=list(self._required_pgs))
        self.pg_collection = pg_collection
        tp_size = pg_collection.tp.size()
        self.layer_number = max(1, layer_number)
        self.head_dim = config.kv_channels
        self.num_heads_per_partition = divide(config.num_attention_heads, tp_size)
        self.num_groups_per_partition = divide(config.num_query_groups, tp_size)
        self.softmax_scale = 1.0 / math.sqrt(self.head_dim) if softmax_scale is None else softmax_scale

    def _check_bias(self, attention_bias: torch.Tensor | None) -> None:
        if attention_bias is not None:
            raise ValueError(f"{self._name} does not support attention_bias")


class PackedCoreAttention(CausalCoreAttentionBase):
    """Drop-in replacement for Megatron's ``DotProductAttention`` that accepts THD packed sequences.

    Same constructor and restrictions as ``CausalCoreAttentionBase``; context-parallel size 1 only
    (``cp_attention.ContextParallelCoreAttention`` handles CP > 1).
    """

    _name = "PackedCoreAttention"
    cudnn_min_segment: int | None = None
    """Segments at least this long go to cuDNN on CUDA (None: FlashAttention-2 only); the Actor sets it from
    ``--cudnn-attention-min-tokens`` (``set_cudnn_min_segment``)."""

    def __init__(self, config: TransformerConfig, *args, **kwargs) -> None:
        if config.context_parallel_size != 1:
            raise ValueError(
                f"PackedCoreAttention supports context_parallel_size 1 only, got {config.context_parallel_size}"
            )
        super().__init__(config, *args, **kwargs)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> torch.Tensor:
        """Attend within each packed segment; returns ``[T, heads * dim]`` (THD) or ``[S, B, heads * dim]``."""
        del attention_mask, attn_mask_type
        self._check_bias(attention_bias)
        if packed_seq_params is None:
            # SBHD: [S, B, h, d]; treat each batch row as one segment.
            seq_len, batch = query.shape[:2]
            out = [
                packed_causal_attention(
                    query[:, b],
                    key[:, b],
                    value[:, b],
                    torch.tensor([0, seq_len], dtype=torch.int32),
                    seq_len,
                    scale=self.softmax_scale,
                )
                for b in range(batch)
            ]
            return torch.stack(out, dim=1).reshape(seq_len, batch, -1)
        if packed_seq_params.qkv_format != "thd":
            raise ValueError(f"PackedCoreAttention expects qkv_format 'thd', got {packed_seq_params.qkv_format!r}")
        out = packed_causal_attention(
            query,
            key,
            value,
            packed_seq_params.cu_seqlens_q,
            int(packed_seq_params.max_seqlen_q),
            scale=self.softmax_scale,
            host_cu_seqlens=getattr(packed_seq_params, "host_cu_seqlens", None),
            cudnn_min_segment=self.cudnn_min_segment,
            route_cache=getattr(packed_seq_params, "route_cache", None),
        )
        return out.reshape(out.size(0), -1)


def set_cudnn_min_segment(model: torch.nn.Module, tokens: int | None) -> None:
    """Route segments of ``tokens`` or more to cuDNN in every ``PackedCoreAttention`` of ``model`` (None or 0: none)."""
    for module in model.modules():
        if isinstance(module, PackedCoreAttention):
            module.cudnn_min_segment = tokens or None
