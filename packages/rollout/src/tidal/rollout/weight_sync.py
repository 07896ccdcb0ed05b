"""Weight updates from the trainer's tensors into running SGLang engines (co-located path).

SGLang takes tensors on ``/update_weights_from_tensor`` as torch ``ForkingPickler`` payloads: a CPU tensor
travels as a shared-memory handle, a CUDA tensor as a CUDA IPC handle, so no weight bytes cross HTTP. The
update is wrapped in ``/begin_weight_update`` ... ``/end_weight_update`` (SGLang 0.5.23 answers 400 outside
that session) and sent in size-bounded buckets so that the trainer never holds a second full copy.
"""

from __future__ import annotations

import base64
import contextlib
import datetime
import functools
import io
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from multiprocessing.reduction import ForkingPickler

import torch
import torch.distributed as dist
import torch.multiprocessing  # importing it registers the tensor reductions with ForkingPickler
from tidal.rollout.engine import SGLangEngine
from tidal.rollout.errors import RolloutError
from tidal.rollout.netif import pin_gloo_interface

logger = logging.getLogger(__name__)

DEFAULT_BUCKET_BYTES = 512 * 1024 * 1024


def _buckets(named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[list]:
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor.detach().contiguous()))
        size += nbytes
    if bucket:
        yield bucket


def _begin_weight_update(engine: SGLangEngine) -> None:
    """Open ``engine``'s weight-update session; one left open by a trainer that died in a sync is closed first.

    A trainer SIGKILLed between ``/begin_weight_update`` and ``/end_weight_update`` (its ``finally`` never ran)
    leaves the session open, and SGLang then refuses every later begin ("already open"): a run resumed against the
    same server (--rollout-external-engine-addrs) could never sync again. That session's update is over (its
    sender is gone), so closing it loses nothing; a warning says it happened.
    """
    try:
        engine.call("/begin_weight_update", {}, what="begin_weight_update")
    except RolloutError as e:
        if "already open" not in str(e):
            raise
        logger.warning("%s: a weight-update session was left open (a trainer died mid-sync); closed", engine.describe())
        engine.call("/end_weight_update", {}, what="end_weight_update")
        engine.call("/begin_weight_update", {}, what="begin_weight_update")


def _with_last(items: Iterable[list]) -> Iterator[tuple[list, bool]]:
    """Each item with whether it is the last one, looking one ahead (the last bucket flushes the cache)."""
    pending = None
    for item in items:
        if pending is not None:
            yield pending, False
        pending = item
    if pending is not None:
        yield pending, True


def _serialize(named_tensors: list[tuple[str, torch.Tensor]]) -> str:
    buffer = io.BytesIO()
    ForkingPickler(buffer).dump(named_tensors)  # what sglang's MultiprocessingSerializer does
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def update_weights_from_tensor(
    engines: SGLangEngine | Sequence[SGLangEngine],
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    weight_version: str | None = None,
    tp_size: int = 1,
    flush_cache: bool = True,
    load_format: str | None = None,
) -> dict[str, float]:
    """Push HF-named tensors into every engine, bucket by bucket; the cache is flushed after the last bucket.

    Several processes may send one after another, each its own part of an update (one pipeline stage's tensors):
    the last part alone passes ``weight_version`` and ``flush_cache``, so no engine reports the version with part of
    the weights. A CPU tensor's handle names a shared-memory file, which any process on the host opens; a CUDA
    tensor's handle opens only on a GPU the engine's process sees (SGLang rebuilds it on that device).

    Sets torch's tensor sharing strategy to ``file_system`` for this process: with the default strategy
    the server rejects the shared-memory handles ("digest sent was rejected").

    Args:
        engines: Running engines on this node (all get every tensor; weight updates bypass any router).
        named_tensors: ``(hf_name, tensor)`` pairs, e.g. ``Actor.named_hf_tensors()``; consumed once.
        bucket_bytes: Most tensor bytes per request.
        weight_version: Version recorded by the engines (and in every later sample) once all buckets are in.
        tp_size: Tensor-parallel size of each engine (each TP rank gets its own copy of the payload).
        flush_cache: Whether the last bucket flushes the engines' cache (False: more of the update follows).
        load_format: The engines' custom weight loader to apply the tensors with (``engine_delta.LOADER``: deltas);
            None: the model's own ``load_weights``.

    Returns:
        Metrics: ``weight_sync/seconds``, ``weight_sync/mb``, ``weight_sync/num_buckets``,
        ``weight_sync/num_tensors``.

    Raises:
        RolloutError: An engine refused a bucket (the session is still closed on every engine).
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    engines = [engines] if isinstance(engines, SGLangEngine) else list(engines)
    torch.multiprocessing.set_sharing_strategy("file_system")
    start, total_bytes, num_buckets, num_tensors = time.perf_counter(), 0, 0, 0
    for engine in engines:
        _begin_weight_update(engine)
    try:
        for bucket, last in _with_last(_buckets(named_tensors, bucket_bytes)):
            _send(engines, bucket, tp_size, flush=last and flush_cache, weight_version=weight_version if last else None,
                  load_format=load_format)  # fmt: skip
            num_buckets += 1
            num_tensors += len(bucket)
            total_bytes += sum(t.numel() * t.element_size() for _, t in bucket)
    finally:
        for engine in engines:
            engine.call("/end_weight_update", {}, what="end_weight_update")
    seconds = time.perf_counter() - start
    logger.info("weight update from tensors: %.1f MB in %d buckets, %.2f s", total_bytes / 2**20, num_buckets, seconds)
    return {
        "weight_sync/seconds": seconds,
        "weight_sync/mb": total_bytes / 2**20,
        "weight_sync/num_buckets": float(num_buckets),
        "weight_sync/num_tensors": float(num_tensors),
    }


def _send(engines: list[SGLangEngine], bucket: list, tp_size: int, *, flush: bool, weight_version: str | None,
          load_format: str | None = None) -> None:  # fmt: skip
    payload = {"serialized_named_tensors": [_serialize(bucket) for _ in range(tp_size)], "flush_cache": flush}
    if load_format is not None:
        payload["load_format"] = load_format
    if weight_version is not None:
        payload["weight_version"] = weight_version
    names = f"{bucket[0][0]} .. {bucket[-1][0]}"
    for engine in engines:
        engine.call("/update_weights_from_tensor", payload, what=f"update_weights_from_tensor({names})")


# ---- decoupled path: broadcast from the trainer through a process group --------------------------------


def _new_process_group(
    *, backend: str, init_method: str, world_size: int, rank: int, group_name: str, timeout_s: float
) -> dist.ProcessGroup:
    """A group beside the default one (the trainer's own world is untouched), built as SGLang builds its side."""
    from torch.distributed import distributed_c10d as c10d

    timeout = datetime.timedelta(seconds=timeout_s)
    store, rank, world_size = next(c10d.rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    group, _ = c10d._new_process_group_helper(
        world_size,
        rank,
        [],
        c10d.Backend(backend),
        c10d.PrefixStore(group_name, store),
        group_name=group_name,
        timeout=timeout,
    )
    c10d._world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


@contextlib.contextmanager
def _engine_calls_in_background(calls: list[Callable[[], object]], timeout_s: float, what: str) -> Iterator[None]:
    """Run blocking engine calls in threads while the body takes part in the matching collective.

    Every wait is bounded: a rejected update otherwise leaves the trainer's side of the collective hanging.
    """
    errors: list[BaseException] = []

    def run(fn: Callable[[], object]) -> None:
        try:
            fn()
        except BaseException as e:  # handed to the caller's thread below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(fn,), daemon=True) for fn in calls]
    for thread in threads:
        thread.start()
    try:
        yield
    finally:
        deadline = time.monotonic() + timeout_s
        for thread in threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
    if errors:
        raise errors[0]
    if any(thread.is_alive() for thread in threads):
        raise RolloutError(f"{what}: an engine did not answer within {timeout_s:.0f} s")


def init_weights_update_group(
    engines: SGLangEngine | Sequence[SGLangEngine],
    *,
    master_address: str,
    master_port: int,
    group_name: str = "tidal_weight_sync",
    backend: str | None = None,
    engine_tp_sizes: Sequence[int] | None = None,
    timeout_s: float = 120.0,
) -> dist.ProcessGroup:
    """Join the trainer (rank 0) and every engine rank in one process group for weight broadcasts.

    Args:
        engines: Running engines; engine ``i``'s ranks follow those of engines before it.
        master_address: Address of this (trainer) process, reachable by the engines.
        master_port: Free port for the group's rendezvous.
        group_name: Name both sides use for the group.
        backend: "nccl" on GPU, "gloo" on CPU (default: by ``torch.cuda.is_available()``).
        engine_tp_sizes: Tensor-parallel size of each engine (default 1 each).
        timeout_s: Bound on the rendezvous and, later, on every broadcast in the group.

    Returns:
        The trainer's handle of the group, for :func:`update_weights_from_distributed`.
    """
    engines = [engines] if isinstance(engines, SGLangEngine) else list(engines)
    tp_sizes = list(engine_tp_sizes or [1] * len(engines))
    if len(tp_sizes) != len(engines):
        raise ValueError(f"engine_tp_sizes has {len(tp_sizes)} entries for {len(engines)} engines")
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "gloo":  # the trainer's side of a group spanning nodes: bind where the engines can reach it
        pin_gloo_interface(os.environ, master_address)
    world_size = 1 + sum(tp_sizes)
    calls: list[Callable[[], object]] = []
    for i, engine in enumerate(engines):
        payload = {
            "master_address": master_address,
            "master_port": master_port,
            "rank_offset": 1 + sum(tp_sizes[:i]),
            "world_size": world_size,
            "group_name": group_name,
            "backend": backend,
        }
        calls.append(functools.partial(engine.call, "/init_weights_update_group", payload))
    with _engine_calls_in_background(calls, timeout_s, "init_weights_update_group"):
        group = _new_process_group(
            backend=backend,
            init_method=f"tcp://{master_address}:{master_port}",
            world_size=world_size,
            rank=0,
            group_name=group_name,
            timeout_s=timeout_s,
        )
    logger.info("weight update group %r: trainer + %d engine ranks (%s)", group_name, world_size - 1, backend)
    return group


def update_weights_from_distributed(
    engines: SGLangEngine | Sequence[SGLangEngine],
    group: dist.ProcessGroup,
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    group_name: str = "tidal_weight_sync",
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    weight_version: str | None = None,
    timeout_s: float = 300.0,
    flush_cache: bool = True,
) -> dict[str, float]:
    """Broadcast HF-named tensors from the trainer (rank 0 of ``group``) into every engine, bucket by bucket.

    The tensors must live where the group's backend works (CUDA for NCCL, CPU for gloo). Each bucket is
    announced to the engines over HTTP (names, dtypes, shapes) in background threads while this thread
    broadcasts; both waits are bounded by ``timeout_s``. The last bucket sets ``weight_version`` and, with
    ``flush_cache``, flushes the engines' cache: a part of an update that more calls complete (one pipeline stage's
    tensors, each stage through its own group, one after the other) passes neither.

    Returns:
        Metrics: ``weight_sync/seconds``, ``weight_sync/mb``, ``weight_sync/num_buckets``,
        ``weight_sync/num_tensors``.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    engines = [engines] if isinstance(engines, SGLangEngine) else list(engines)
    start, total_bytes, num_buckets, num_tensors = time.perf_counter(), 0, 0, 0
    for engine in engines:
        _begin_weight_update(engine)
    try:
        for bucket, last in _with_last(_buckets(named_tensors, bucket_bytes)):
            payload = {
                "names": [name for name, _ in bucket],
                "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in bucket],
                "shapes": [list(t.shape) for _, t in bucket],
                "group_name": group_name,
                "flush_cache": last and flush_cache,
            }
            if last and weight_version is not None:
                payload["weight_version"] = weight_version
            calls = [functools.partial(e.call, "/update_weights_from_distributed", payload) for e in engines]
            with _engine_calls_in_background(calls, timeout_s, "update_weights_from_distributed"):
                for _, tensor in bucket:
                    dist.broadcast(tensor, src=0, group=group)
            num_buckets += 1
            num_tensors += len(bucket)
            total_bytes += sum(t.numel() * t.element_size() for _, t in bucket)
    finally:
        for engine in engines:
            engine.call("/end_weight_update", {}, what="end_weight_update")
    seconds = time.perf_counter() - start
    logger.info(
        "weight broadcast (%s): %.1f MB in %d buckets, %.2f s", group_name, total_bytes / 2**20, num_buckets, seconds
    )
    return {
        "weight_sync/seconds": seconds,
        "weight_sync/mb": total_bytes / 2**20,
        "weight_sync/num_buckets": float(num_buckets),
        "weight_sync/num_tensors": float(num_tensors),
    }


def destroy_weights_update_group(
    engines: SGLangEngine | Sequence[SGLangEngine], group: dist.ProcessGroup, *, group_name: str = "tidal_weight_sync"
) -> None:
    """Tear the weight-update group down on the engines and in this process.

    An engine that no longer holds the group (it was restarted, or is gone) is logged and skipped: this process's
    side is torn down all the same, so that a fresh group can take its place.
    """
    engines = [engines] if isinstance(engines, SGLangEngine) else list(engines)
    try:
        for engine in engines:
            try:
                engine.call("/destroy_weights_update_group", {"group_name": group_name},
                            what="destroy_weights_update_group")  # fmt: skip
            except RolloutError as e:
                logger.warning("%s could not leave weight-update group %s: %s", engine.url, group_name, e)
    finally:
        dist.destroy_process_group(group)
