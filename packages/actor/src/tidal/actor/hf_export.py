"""Weight export for weight sync: HF-named tensors in size-bounded buckets, each one flat buffer on the device.

``bridge.named_hf_tensors`` (fp32 as stored, one CPU tensor at a time) is the checkpoint path. Weight sync wants
the engine's dtype on the GPU, in few large buffers (one NCCL broadcast or one IPC handle per bucket). Here every
HF tensor of a bucket is copied straight from a view of the Megatron parameter (q/k/v and gate/up are strided
views, no intermediate concatenation) into its slice of the bucket's flat buffer, with one ``_foreach_copy_`` per
bucket, which casts on the fly. With TP > 1 the shards are all-gathered first (collective: every TP rank iterates),
and so are the stacked experts of an MoE layer with expert parallelism (every expert-parallel rank iterates).
With pipeline stages every rank still yields the whole model: a bucket's layout follows from the HF shapes alone,
each stage fills the slices of the tensors it holds, and each stage's run of slices is broadcast from it over the
pipeline group (every rank of the pipeline iterates). With ``stage_only`` a rank yields its own stage's tensors
alone, in HF order, and nothing crosses stages (only its TP group iterates together): each stage sends its own share
to the engines (the train app's ``--update-weight-transport nccl`` at PP > 1).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from megatron.core import parallel_state
from tidal.actor.bridge import (
    EXPERT_BIAS,
    EXPERT_KINDS,
    _Mapping,
    _to_hf,
    expected_hf_shapes,
    gather_shards,
    weight_mappings,
)
from tidal.actor.hf_config import HFModelSpec
from tidal.actor.pipeline import PipelineStage, broadcast_from_stage

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
    if m.kind in EXPERT_KINDS:
        return _to_hf(m, [local], spec)
    if m.kind == "glu":
        return list(local.chunk(2, dim=0))
    if m.kind == "qkv":
        rest = local.shape[1:]
        qkv = local.reshape(spec.num_key_value_heads, -1, spec.head_dim, *rest)
        return [qkv[:, :-2], qkv[:, -2], qkv[:, -1]]
    return [local]


def _sources(
    params: dict[str, torch.Tensor], spec: HFModelSpec, stage: PipelineStage, *, stage_only: bool = False
) -> Iterator[tuple[str, int, torch.Tensor | None, bool]]:
    """``(hf_name, owner stage, source, float32)`` for every HF tensor (``stage_only``: for those of ``stage`` alone).

    The source is a view of the parameter (not split over TP/EP) or a gathered copy; None for the tensors another
    stage holds. ``float32``: the tensor is exported in float32 whatever the export's dtype (the score-correction bias).
    """
    for m in weight_mappings(spec):
        owner = stage.owner(m.megatron)
        fp32 = m.kind == EXPERT_BIAS
        if owner != stage.rank and stage_only:
            continue
        if owner != stage.rank:
            yield from ((name, owner, None, fp32) for name in m.hf)
            continue
        local = params[stage.local_name(m.megatron)].detach()
        gathered = gather_shards(m, local)
        tensors = _hf_views(m, local, spec) if gathered is None else _to_hf(m, gathered, spec)
        yield from ((name, owner, t, fp32) for name, t in zip(m.hf, tensors, strict=True))


@dataclass(slots=True)
class _Plan:
    """One bucket's sources (views of the parameters; None: another stage's), and its buffer once allocated."""

    names: tuple[str, ...]
    sources: list[torch.Tensor | None]
    numel: int
    dtype: torch.dtype
    segments: tuple[tuple[int, int, int], ...] = ()
    """``(start, end, owner stage)`` of each run of the flat buffer filled by one stage (pipeline parallelism)."""
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
        stage: this rank's pipeline stage (``params`` named as in its module); None for the whole model.
        stage_only: export ``stage``'s own tensors alone (no broadcast between stages); otherwise the whole model.
        fixed_sources: ``params`` are the live tensors (views of them stay valid); False: ``params`` computes each
            tensor when looked up (LoRA's merged weights), so every export looks them up again.
    """

    def __init__(
        self,
        params: dict[str, torch.Tensor],
        spec: HFModelSpec,
        *,
        dtype: torch.dtype = torch.bfloat16,
        bucket_bytes: int = 512 * 2**20,
        reuse_buffers: bool = False,
        stage: PipelineStage | None = None,
        stage_only: bool = False,
        fixed_sources: bool = True,
    ) -> None:
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
        self.params, self.spec, self.dtype, self.reuse = params, spec, dtype, reuse_buffers
        self.stage_only = stage_only
        self.stage = stage or PipelineStage(rank=0, size=1, num_layers=spec.num_layers)
        self.device = next(iter(params.values())).device
        self.bucket_bytes = bucket_bytes
        self.shapes = expected_hf_shapes(spec)
        self._plans = None
        if (
            parallel_state.get_tensor_model_parallel_world_size() == 1
            and fixed_sources
            and (spec.moe is None or parallel_state.get_expert_model_parallel_world_size() == 1)
        ):  # views of the parameters, no gathered copies: the plans hold for every export
            self._plans = list(self._groups())

    def _numel(self, name: str) -> int:
        return math.prod(self.shapes[name])

    def _groups(self) -> Iterator[_Plan]:
        """The buckets' plans in HF order; the float32-only tensors (if the export is not float32) in a last one."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        pending: list[tuple[str, int, torch.Tensor | None]] = []
        fp32_only: list[tuple[str, int, torch.Tensor | None]] = []
        pending_numel = 0
        for name, owner, src, fp32 in _sources(self.params, self.spec, self.stage, stage_only=self.stage_only):
            if fp32 and self.dtype != torch.float32:
                fp32_only.append((name, owner, src))
                continue
            if pending and (pending_numel + self._numel(name)) * itemsize > self.bucket_bytes:
                yield self._plan(pending)
                pending, pending_numel = [], 0
            pending.append((name, owner, src))
            pending_numel += self._numel(name)
        if pending:
            yield self._plan(pending)
        if fp32_only:
            yield self._plan(fp32_only, torch.float32)

    def _plan(self, group: list[tuple[str, int, torch.Tensor | None]], dtype: torch.dtype | None = None) -> _Plan:
        segments: list[tuple[int, int, int]] = []
        offset = 0
        for name, owner, _ in group:
            end = offset + self._numel(name)
            if segments and segments[-1][2] == owner:
                segments[-1] = (segments[-1][0], end, owner)
            else:
                segments.append((offset, end, owner))
            offset = end
        return _Plan(
            tuple(n for n, _, _ in group),
            [t for _, _, t in group],
            offset,
            dtype or self.dtype,
            tuple(segments) if self.stage.size > 1 and not self.stage_only else (),
        )

    def buckets(self) -> Iterator[HFTensorBucket]:
        """Every HF tensor (``stage_only``: this stage's), cast to ``dtype``, in HF order.

        The routers' score-correction biases stay float32 (a bf16 copy would move the engine's expert choice off the
        actor's): when ``dtype`` is not float32 they come last, in a float32 bucket of their own.

        Collective with TP > 1 (all-gathers: every TP rank must iterate) and with pipeline stages unless
        ``stage_only`` (broadcasts: every rank of the pipeline must iterate).
        """
        for plan in self._plans if self._plans is not None else self._groups():
            yield self._fill(plan)

    @torch.no_grad()
    def _fill(self, plan: _Plan) -> HFTensorBucket:
        if plan.bucket is not None:
            self._copy(plan.dsts, plan.sources, plan.segments, plan.bucket.flat)
            return plan.bucket
        flat = torch.empty(plan.numel, dtype=plan.dtype, device=self.device)
        dsts, views, offset = [], [], 0
        for name, src in zip(plan.names, plan.sources, strict=True):
            part = flat[offset : offset + self._numel(name)]
            dsts.append(part.view(src.shape) if src is not None else None)
            views.append(part.view(self.shapes[name]))
            offset += self._numel(name)
        self._copy(dsts, plan.sources, plan.segments, flat)
        bucket = HFTensorBucket(flat=flat, names=plan.names, tensors=tuple(views))
        if self.reuse:
            plan.bucket, plan.dsts = bucket, dsts
        return bucket

    def _copy(
        self,
        dsts: list[torch.Tensor | None],
        sources: list[torch.Tensor | None],
        segments: tuple[tuple[int, int, int], ...],
        flat: torch.Tensor,
    ) -> None:
        """This stage's tensors into their slices (one multi-tensor copy), then each stage's run from its owner."""
        pairs = [(d, s) for d, s in zip(dsts, sources, strict=True) if s is not None]
        if pairs:
            torch._foreach_copy_([d for d, _ in pairs], [s for _, s in pairs])
        for start, end, owner in segments:
            broadcast_from_stage(flat[start:end], owner)
