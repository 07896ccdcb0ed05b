"""Weight export for weight sync: HF-named tensors in size-bounded buckets, each one flat buffer on the device.

``bridge.named_hf_tensors`` (fp32 as stored, one CPU tensor at a time) is the checkpoint path. Weight sync wants
the engine's dtype on the GPU, in few large buffers (one NCCL broadcast or one IPC handle per bucket). Here every
HF tensor of a bucket is copied straight from a view of the Megatron parameter (q/k/v and gate/up are strided
views, no intermediate concatenation) into its slice of the bucket's flat buffer, with one ``_foreach_copy_`` per
bucket, which casts on the fly. With TP > 1 the shards are all-gathered first (collective: every TP rank iterates).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from tidal.actor.bridge import _Mapping, _to_hf, expected_hf_shapes, weight_mappings
from tidal.actor.hf_config import HFModelSpec

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class HFTensorBucket:
    """HF tensors stored back to back in one flat buffer; iterating yields ``(hf_name, tensor)``."""

    flat: torch.Tensor
    """1-D buffer holding every tensor of the bucket, in order."""
    names: tuple[str, ...]
    """HF names, in buffer order."""
    tensors: tuple[torch.Tensor, ...]
    """Views into ``flat`` with the HF shapes."""

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(zip(self.names, self.tensors, strict=True))


def _hf_views(m: _Mapping, local: torch.Tensor, spec: HFModelSpec) -> list[torch.Tensor]:
    """Views of one unsharded parameter whose row-major element order is each HF tensor's (shapes may differ)."""
    if m.kind == "glu":
        return list(local.chunk(2, dim=0))
    if m.kind == "qkv":
        rest = local.shape[1:]
        qkv = local.reshape(spec.num_key_value_heads, -1, spec.head_dim, *rest)
        return [qkv[:, :-2], qkv[:, -2], qkv[:, -1]]
    return [local]


def _sources(params: dict[str, torch.Tensor], spec: HFModelSpec) -> Iterator[tuple[str, torch.Tensor]]:
    """``(hf_name, source)`` for every HF tensor: views of the parameters (TP = 1) or gathered copies."""
    size = parallel_state.get_tensor_model_parallel_world_size()
    group = parallel_state.get_tensor_model_parallel_group()
    for m in weight_mappings(spec):
        local = params[m.megatron].detach()
        if m.kind == "replicated" or size == 1:
            tensors = _hf_views(m, local, spec)
        else:
            gathered = [torch.empty_like(local) for _ in range(size)]
            dist.all_gather(gathered, local.contiguous(), group=group)
            tensors = _to_hf(m, gathered, spec)
        yield from zip(m.hf, tensors, strict=True)


@dataclass(slots=True)
class _Plan:
    """One bucket's sources (views of the parameters), and its buffer once ``reuse_buffers`` allocated it."""

    names: tuple[str, ...]
    sources: list[torch.Tensor]
    numel: int
    bucket: HFTensorBucket | None = None
    dsts: list[torch.Tensor] | None = None


class HFExporter:
    """Exports a model's HF tensors in buckets; with TP = 1 the source views and bucket layout are built once.

    Args:
        params: Megatron parameter name -> this rank's tensor (the model's parameters or their fp32 main copies);
            updated in place by training, so the cached views stay valid.
        spec: the model's HF spec.
        dtype: dtype of the exported tensors.
        bucket_bytes: a bucket holds tensors up to this many bytes (a single larger tensor gets its own bucket).
        reuse_buffers: keep each bucket's buffer and refill it on the next export (no allocation and no per-tensor
            Python work: one ``_foreach_copy_`` per bucket); a consumer must be done with a bucket before the
            next export. Otherwise every export allocates new buffers, which the consumer may keep.
    """

    def __init__(
        self,
        params: dict[str, torch.Tensor],
        spec: HFModelSpec,
        *,
        dtype: torch.dtype = torch.bfloat16,
        bucket_bytes: int = 512 * 2**20,
        reuse_buffers: bool = False,
    ) -> None:
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
        self.params, self.spec, self.dtype, self.reuse = params, spec, dtype, reuse_buffers
        self.bucket_bytes = bucket_bytes
        self.shapes = expected_hf_shapes(spec)
        self._plans = None
        if parallel_state.get_tensor_model_parallel_world_size() == 1:
            self._plans = [
                _Plan(tuple(n for n, _ in g), [t for _, t in g], sum(t.numel() for _, t in g)) for g in self._groups()
            ]

    def _groups(self) -> Iterator[list[tuple[str, torch.Tensor]]]:
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        pending: list[tuple[str, torch.Tensor]] = []
        pending_numel = 0
        for name, src in _sources(self.params, self.spec):
            if pending and (pending_numel + src.numel()) * itemsize > self.bucket_bytes:
                yield pending
                pending, pending_numel = [], 0
            pending.append((name, src))
            pending_numel += src.numel()
        if pending:
            yield pending

    def buckets(self) -> Iterator[HFTensorBucket]:
        """Every HF tensor, cast to ``dtype``, in HF order (TP > 1: all-gathers; every TP rank must iterate)."""
        if self._plans is None:
            for group in self._groups():
                yield self._fill(
                    _Plan(tuple(n for n, _ in group), [t for _, t in group], sum(t.numel() for _, t in group))
                )
            return
        for plan in self._plans:
            yield self._fill(plan)

    @torch.no_grad()
    def _fill(self, plan: _Plan) -> HFTensorBucket:
        if plan.bucket is not None:
            torch._foreach_copy_(plan.dsts, plan.sources)
            return plan.bucket
        flat = torch.empty(plan.numel, dtype=self.dtype, device=plan.sources[0].device)
        dsts, views, offset = [], [], 0
        for name, src in zip(plan.names, plan.sources, strict=True):
            part = flat[offset : offset + src.numel()]
            dsts.append(part.view(src.shape))
            views.append(part.view(self.shapes[name]))
            offset += src.numel()
        torch._foreach_copy_(dsts, plan.sources)
        bucket = HFTensorBucket(flat=flat, names=plan.names, tensors=tuple(views))
        if self.reuse:
            plan.bucket, plan.dsts = bucket, dsts
        return bucket
