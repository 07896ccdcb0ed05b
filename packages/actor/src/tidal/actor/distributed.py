"""Process-group set-up and the collective pieces of an optimizer step (DP all-reduce, TP x PP-aware clipping).

One code path on CPU and GPU: torch.distributed (gloo on CPU, NCCL on GPU), Megatron's
``parallel_state`` for the TP/PP/CP/DP groups, a flat DP all-reduce of gradients and a gradient norm
over TP x PP that counts TP-duplicated parameters (norms, biases of row-parallel layers) and the last
pipeline stage's copy of a tied embedding once.
"""

from __future__ import annotations

import datetime
import logging
import math
import os
from collections.abc import Iterable

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.core.tensor_parallel.layers import param_is_not_tensor_parallel_duplicate
from tidal.actor.compat import apply_cpu_compat
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

logger = logging.getLogger(__name__)


def init_distributed(
    *,
    rank: int,
    world_size: int,
    master_addr: str,
    master_port: int,
    tensor_model_parallel_size: int = 1,
    context_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    expert_model_parallel_size: int = 1,
    seed: int = 1234,
    timeout_s: float = 600.0,
) -> None:
    """Join the actor's process group and set up Megatron's parallel state and RNG tracker.

    Uses NCCL when CUDA is available (binding this process to ``LOCAL_RANK`` or ``rank % devices``),
    gloo otherwise; applies the CPU compatibility patches first. Idempotent for the process group
    (an already initialised default group is reused). Megatron's rank order: TP fastest, then CP, DP, PP
    (with TP=2 x PP=2, ranks 0-1 are stage 0 and ranks 2-3 stage 1). With ``pipeline_model_parallel_size`` P > 1
    the ``Actor`` holds one stage (1/P of the layers; the HF layer count must divide by P) and runs micro-batches
    through Megatron's 1F1B schedule (package README, "Pipeline parallelism"). With ``expert_model_parallel_size``
    E > 1 (mixture-of-experts models) each group of E consecutive ranks of a stage splits every MoE layer's experts
    E ways and exchanges tokens all-to-all (the expert tensor-parallel size is 1).

    Raises:
        ValueError: the world size is not a multiple of TP x CP x PP (or of EP x PP), CP, PP or EP < 1, or PP > 1
            together with CP > 1 (not supported).
    """
    check_pipeline_model_parallel_size(pipeline_model_parallel_size, context_parallel_size=context_parallel_size)
    check_expert_model_parallel_size(
        expert_model_parallel_size, world_size=world_size, pipeline_model_parallel_size=pipeline_model_parallel_size
    )
    apply_cpu_compat()
    if context_parallel_size < 1:
        raise ValueError(f"--context-parallel-size must be >= 1, got {context_parallel_size}")
    if world_size % (tensor_model_parallel_size * context_parallel_size * pipeline_model_parallel_size):
        raise ValueError(
            f"world size {world_size} is not a multiple of --tensor-model-parallel-size {tensor_model_parallel_size}"
            f" x --context-parallel-size {context_parallel_size}"
            f" x --pipeline-model-parallel-size {pipeline_model_parallel_size}"
        )
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", rank % torch.cuda.device_count()))
        torch.cuda.set_device(local)
        backend = "nccl"
    else:
        backend = "gloo"
    if not dist.is_initialized():
        dist.init_process_group(
            backend,
            init_method=f"tcp://{master_addr}:{master_port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tensor_model_parallel_size,
        context_parallel_size=context_parallel_size,
        pipeline_model_parallel_size=pipeline_model_parallel_size,
        expert_model_parallel_size=expert_model_parallel_size,
        expert_tensor_parallel_size=1,
    )
    model_parallel_cuda_manual_seed(seed)
    logger.info(
        "rank %d/%d joined (%s): tp=%d cp=%d pp=%d dp=%d ep=%d",
        rank,
        world_size,
        backend,
        tensor_model_parallel_size,
        context_parallel_size,
        pipeline_model_parallel_size,
        parallel_state.get_data_parallel_world_size(),
        expert_model_parallel_size,
    )


def check_pipeline_model_parallel_size(size: int, *, context_parallel_size: int = 1) -> None:
    """Check the pipeline-parallel size on its own and against context parallelism, naming the flags.

    Raises:
        ValueError: ``size`` < 1, or ``size`` > 1 with ``context_parallel_size`` > 1.
    """
    if size < 1:
        raise ValueError(f"--pipeline-model-parallel-size must be >= 1, got {size}")
    if size > 1 and context_parallel_size > 1:
        raise ValueError(
            f"--pipeline-model-parallel-size {size} with --context-parallel-size {context_parallel_size} is not "
            "supported by tidal-actor (pipeline stages are not wired to the context-parallel shards and gathers); "
            "use one of them, e.g. --context-parallel-size 1, or --pipeline-model-parallel-size 1 with "
            "--tensor-model-parallel-size for the model's size"
        )


def check_expert_model_parallel_size(size: int, *, world_size: int, pipeline_model_parallel_size: int = 1) -> None:
    """Check the expert-parallel size against the ranks of one pipeline stage, naming the flags.

    Raises:
        ValueError: ``size`` < 1, or the ranks of a stage (world size / PP) not a multiple of ``size``.
    """
    if size < 1:
        raise ValueError(f"--expert-model-parallel-size must be >= 1, got {size}")
    per_stage = world_size // max(pipeline_model_parallel_size, 1)
    if per_stage % size:
        raise ValueError(
            f"--expert-model-parallel-size {size} does not divide the {per_stage} trainer GPU(s) of a pipeline stage "
            f"({world_size} GPU(s) / --pipeline-model-parallel-size {pipeline_model_parallel_size}); choose an "
            "expert-parallel size that divides it"
        )


def data_parallel_rank_and_size() -> tuple[int, int]:
    """This process's data-parallel rank and the DP size (after :func:`init_distributed`)."""
    return parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()


def stage_export_role() -> tuple[int, bool, bool]:
    """``(pipeline stage, exports, sends)`` of this rank in a per-stage weight export (after :func:`init_distributed`).

    ``Actor.hf_tensor_buckets(stage_only=True)`` is collective over a TP group: ``exports`` is True on the ranks of
    the TP group of the stage's first rank (DP rank 0, CP rank 0), which iterate it together; ``sends`` on that first
    rank alone (TP rank 0 too), which hands the stage's tensors on. The other replicas of the stage do nothing. With
    expert parallelism the export also gathers the experts over the first rank's expert-parallel group (ranks of other
    DP ranks), so ``exports`` is True on that whole group (expert-data-parallel rank 0).
    """
    first = parallel_state.get_data_parallel_rank() == 0 and parallel_state.get_context_parallel_rank() == 0
    sends = first and parallel_state.get_tensor_model_parallel_rank() == 0
    exports = first
    if parallel_state.get_expert_model_parallel_world_size() > 1:
        exports = parallel_state.get_expert_data_parallel_rank() == 0
    return parallel_state.get_pipeline_model_parallel_rank(), exports, sends


def _squared_norm(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Sum of squares of ``grads`` in fp32 (one multi-tensor kernel for all per-tensor norms, no squared copies)."""
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    return torch.stack(torch._foreach_norm([g.detach() for g in grads], 2, dtype=torch.float32)).square().sum()


def destroy_distributed() -> None:
    """Tear down Megatron's parallel state and the default process group.

    megatron-core's ``destroy_model_parallel`` leaves some process groups in ``parallel_state``'s globals
    (``_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP`` and its gloo twin); they are dropped here, in the process whose
    gloo threads they own. A process forked later would otherwise inherit the objects without the threads, and its
    first ``initialize_model_parallel``, overwriting them, would run a group's destructor that joins threads absent
    from the child: a hang for ever.
    """
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    drop_leftover_groups()
    if dist.is_initialized():
        dist.destroy_process_group()


def drop_leftover_groups() -> list[str]:
    """Set every ``parallel_state`` global that still holds a process group to None; return their names."""
    names = [name for name, value in vars(parallel_state).items() if isinstance(value, dist.ProcessGroup)]
    for name in names:
        setattr(parallel_state, name, None)
    return names


def all_reduce_gradients(params: Iterable[torch.nn.Parameter]) -> None:
    """Sum gradients over the data-parallel x context-parallel group (one flat buffer per dtype).

    Context-parallel ranks hold partial gradients of the same micro-batches (their own tokens'), so
    they are summed together with the data-parallel replicas. Expert parameters (``allreduce`` False: an MoE layer's
    experts) already hold the gradient of every token the expert-parallel group routed to them, so they are summed
    over the expert-data-parallel group instead (the replicas of the same experts).
    """
    params = list(params)
    dense = [p for p in params if getattr(p, "allreduce", True)]
    experts = [p for p in params if not getattr(p, "allreduce", True)]
    if parallel_state.get_data_parallel_world_size(with_context_parallel=True) > 1:
        _sum_grads(dense, parallel_state.get_data_parallel_group(with_context_parallel=True))
    if experts and parallel_state.get_expert_data_parallel_world_size() > 1:
        _sum_grads(experts, parallel_state.get_expert_data_parallel_group())


def _sum_grads(params: list[torch.nn.Parameter], group: dist.ProcessGroup) -> None:
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
    for grads in by_dtype.values():
        flat = _flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=group)
        for grad, reduced in zip(grads, _unflatten_dense_tensors(flat, grads), strict=True):
            grad.copy_(reduced)


def clip_gradients(params: list[torch.nn.Parameter], max_norm: float) -> float:
    """Global L2 norm of the model's gradients across TP x PP ranks; scales them to ``max_norm`` if > 0.

    TP-sharded parameters contribute their local shard on every rank; replicated ones only on
    TP rank 0, so each weight is counted once; each pipeline stage counts its own layers, and the last
    stage's copy of a tied embedding (Megatron marks it ``shared``) is left to the first stage's. Expert parameters
    (``allreduce`` False) differ across the expert-parallel group: theirs are summed over expert-parallel x PP. Every
    rank of the model-parallel group gets the same norm, so a non-finite one skips the step everywhere.
    Returns the norm before clipping (``inf``/``nan`` when a gradient is not finite; nothing is scaled then).
    """
    counted = [
        p
        for p in params
        if p.grad is not None and param_is_not_tensor_parallel_duplicate(p) and not getattr(p, "shared", False)
    ]
    device = params[0].device
    sq = _squared_norm([p.grad for p in counted if getattr(p, "allreduce", True)], device)
    if parallel_state.get_model_parallel_group().size() > 1:  # TP x PP
        dist.all_reduce(sq, group=parallel_state.get_model_parallel_group())
    expert_grads = [p.grad for p in counted if not getattr(p, "allreduce", True)]
    if expert_grads:
        expert_sq = _squared_norm(expert_grads, device)
        group = parallel_state.get_expert_tensor_model_pipeline_parallel_group()  # EP x PP (expert TP is 1)
        if group.size() > 1:
            dist.all_reduce(expert_sq, group=group)
        sq = sq + expert_sq
    norm = math.sqrt(sq.item())
    if max_norm > 0 and math.isfinite(norm) and norm > max_norm:
        scale = max_norm / (norm + 1e-6)
        torch._foreach_mul_([p.grad for p in params if p.grad is not None], scale)
    return norm
