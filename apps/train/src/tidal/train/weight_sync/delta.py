"""--update-weight-delta: each sync sends only the elements whose value in the engines' dtype changed, verified.

The sending rank (rank 0, or each pipeline stage's first rank for its own tensors) keeps a snapshot: one copy of
the tensors it sent, in the engines' dtype, in host memory (pinned when the actor offloads, for the copies back to
the GPU). A sync compares each exported tensor with it on the tensor's device and sends, per tensor, the changed
elements (indices or a bitmask, whichever is smaller, and their values; see ``tidal.rollout.engine_delta``), in
requests of at most --update-weight-buffer-size bytes, through ``/update_weights_from_tensor`` (tensor transport),
as safetensors files the engines read (disk transport) or broadcast through the weight group (nccl transport; see
``tidal.rollout.engine_delta.route_broadcast_deltas``). The engines apply them to their current weights and report a
checksum per tensor; a tensor whose checksum differs from the snapshot's is sent again whole (a warning, and
``weight_sync/delta_fallbacks`` counts it). The driver's :class:`DeltaSync` sends everything whole (and rebuilds
the snapshots) whenever the engines may not hold the version the snapshots hold: the first sync, after a sync that
failed, after a restarted engine was given the weights, or when an engine reports another version.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
import time
from collections.abc import Iterable, Iterator
from itertools import chain, pairwise
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from tidal.train.weight_sync.sync import EngineWeights, WeightSync

logger = logging.getLogger(__name__)


class DeltaSnapshot:
    """The tensors a sending rank's engines hold, in their dtype, in host memory (pinned when ``pin``)."""

    def __init__(self, *, pin: bool) -> None:
        self.pin = pin
        self.tensors: dict[str, torch.Tensor] = {}
        self.dtype: torch.dtype | None = None
        """The engines' dtype (reported by their loader on the first sync); None until then."""

    @property
    def mb(self) -> float:
        """Host memory the snapshot holds, in MiB."""
        return sum(t.nbytes for t in self.tensors.values()) / 2**20

    def store(self, name: str, tensor: torch.Tensor) -> None:
        """Keep ``tensor`` (already in the engines' dtype) as ``name``'s value."""
        held = self.tensors.get(name)
        if held is None or held.shape != tensor.shape or held.dtype != tensor.dtype:
            held = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=self.pin and torch.cuda.is_available())
            self.tensors[name] = held
        held.copy_(tensor)


def _entries(
    named: Iterable[tuple[str, torch.Tensor]], snap: DeltaSnapshot, full: bool, counts: dict[str, float]
) -> Iterator[tuple[str, str, torch.Tensor, int]]:
    """``(hf_name, entry name, payload, expected checksum)`` per tensor to send; the snapshot follows each tensor.

    ``full`` (or no snapshot of the tensor yet): the tensor whole. Otherwise its delta against the snapshot, or
    nothing when no element changed.
    """
    from tidal.rollout import delta_checksum, encode_delta

    for name, tensor in named:
        new = tensor if snap.dtype is None else tensor.to(snap.dtype)
        counts["weight_sync/delta_elements"] += new.numel()
        old = None if full else snap.tensors.get(name)
        if old is None:  # its checksum follows once the engines' dtype is known
            counts["weight_sync/delta_changed"] += new.numel()
            yield name, name, new, None
            continue
        entry = encode_delta(name, new, old.to(new.device, non_blocking=True))
        if entry is None:
            continue
        key, payload, idx = entry
        counts["weight_sync/delta_changed"] += idx.numel()
        snap.tensors[name].view(-1)[idx.cpu()] = new.reshape(-1)[idx].cpu()
        yield name, key, payload, delta_checksum(new)


def _requests(entries: Iterator[tuple], bucket_bytes: int) -> Iterator[list[tuple]]:
    """The entries in requests of at most ``bucket_bytes`` payload bytes (a larger entry goes alone)."""
    request, size = [], 0
    for entry in entries:
        nbytes = entry[2].nbytes
        if request and size + nbytes > bucket_bytes:
            yield request
            request, size = [], 0
        request.append(entry)
        size += nbytes
    if request:
        yield request


class DeltaSender:
    """The sending rank's side of --update-weight-delta; mixed into the trainer rank with ``WeightSender``."""

    _delta_snapshots: dict[int | None, DeltaSnapshot] | None = None

    def sync_delta(self, targets: list[dict[str, Any]], version: str, bucket_bytes: int, tp_size: int,
                   stage: int | None, full: bool, folder: str | None, pin: bool,
                   transport: str = "tensor") -> dict:  # fmt: skip
        """Send the weights (``stage``'s, or the whole model from rank 0) as deltas, or whole when ``full``.

        ``transport`` "tensor": handles, reports in a temporary folder on this host (``folder`` None). "disk": the
        request files and the engines' reports in ``folder`` (shared with the engines). "nccl": broadcast through this
        rank's weight group (:meth:`init_weight_group`), the engines' reports in ``folder``. Only the last part's last
        request sets ``version`` and flushes the engines' cache. Returns the sender's metrics, else {}.
        """
        sender = self._sender(targets, bucket_bytes, stage)
        if sender is None:
            return {}
        named, engines, last = sender
        snaps = self._delta_snapshots = self._delta_snapshots or {}
        snap = snaps.setdefault(stage, DeltaSnapshot(pin=pin))
        where = Path(folder) if folder else Path(tempfile.mkdtemp(prefix="tidal-delta-"))
        try:
            link = _Link(engines, where, disk=transport == "disk", tp_size=tp_size,
                         expected=sum(t["tp_size"] for t in targets),
                         group=self.weight_group if transport == "nccl" else None,
                         timeout_s=targets[0]["timeout_s"])  # fmt: skip
            metrics = _send(link, named, snap, full, bucket_bytes, version if last else None, last)
        finally:
            if folder is None:
                shutil.rmtree(where, ignore_errors=True)
        if full:
            logger.info("delta snapshot%s: %.1f MiB of host memory%s", "" if stage is None else f" of stage {stage}",
                        snap.mb, " (pinned)" if snap.pin else "")  # fmt: skip
        from tidal.train.weight_sync.sender import _stage_metrics

        metrics |= {"weight_sync/delta_snapshot_mb": snap.mb}
        return metrics | _stage_metrics(metrics, stage)


class _Link:
    """One engine set's requests: tensors, files or broadcasts in, checksum reports out.

    ``group``: the sender's weight group ``(group, name)``: the requests are broadcast (nccl transport) and reach
    the delta loader through ``engine_delta.route_broadcast_deltas``, installed here on every engine first.
    """

    def __init__(self, engines: list, folder: Path, *, disk: bool, tp_size: int, expected: int,
                 group: tuple[Any, str] | None = None, timeout_s: float = 300.0) -> None:  # fmt: skip
        from tidal.rollout import DELTA_LOADER, DELTA_ROUTE, update_weights_from_tensor

        self.engines, self.folder, self.disk, self.tp_size, self.expected = engines, folder, disk, tp_size, expected
        self.group, self.timeout_s = group, timeout_s
        folder.mkdir(parents=True, exist_ok=True)
        self.num_requests, self.mb = 0, 0.0
        if group is not None:  # no tensors: an empty one travels by value, whichever host the engine is on
            update_weights_from_tensor(engines, [(DELTA_ROUTE, torch.empty(0))], flush_cache=False, tp_size=tp_size,
                                       load_format=DELTA_LOADER)  # fmt: skip

    def send(self, entries: list[tuple[str, torch.Tensor]], version: str | None, flush: bool) -> dict[str, Any]:
        """Apply ``entries`` on every engine; each engine process's report ``{"dtype", "sums"}`` merged."""
        from tidal.rollout import DELTA_FILE, DELTA_LOADER, DELTA_REPORT, RolloutError, update_weights_from_tensor

        for old in self.folder.glob("*.json"):
            old.unlink()
        self.mb += sum(t.nbytes for _, t in entries) / 2**20
        if self.disk:
            from safetensors.torch import save_file

            path = self.folder / f"delta-{self.num_requests:05d}.safetensors"
            save_file({k: t.contiguous().cpu() for k, t in entries}, str(path))
            entries = [(f"{DELTA_FILE}{path}", torch.empty(0))]  # an empty tensor travels by value, not as a handle
        self.num_requests += 1
        report = f"{DELTA_REPORT}{self.folder}"
        if self.group is not None:
            self._broadcast([(report, torch.zeros(1, dtype=torch.uint8)), *entries], version, flush)
        else:
            update_weights_from_tensor(self.engines, [*entries, (report, torch.empty(0))], bucket_bytes=2**62,
                                       weight_version=version, flush_cache=flush, tp_size=self.tp_size,
                                       load_format=DELTA_LOADER)  # fmt: skip
        reports = [json.loads(p.read_text()) for p in sorted(self.folder.glob("*.json"))]
        if len(reports) != self.expected:
            raise RolloutError(
                f"--update-weight-delta: {len(reports)} of {self.expected} engine processes reported the delta they "
                f"applied; each engine must be started with --custom-weight-loader {DELTA_LOADER}"
            )
        return {"dtype": reports[0]["dtype"], "sums": [r["sums"] for r in reports]}

    def _broadcast(self, entries: list[tuple[str, torch.Tensor]], version: str | None, flush: bool) -> None:
        """One request through the weight group, the report entry first (what routes it to the delta loader)."""
        import torch.distributed as dist
        from tidal.rollout import update_weights_from_distributed

        group, name = self.group
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else "cpu"
        update_weights_from_distributed(self.engines, group, [(k, t.to(device)) for k, t in entries], group_name=name,
                                        bucket_bytes=2**62, weight_version=version, timeout_s=self.timeout_s,
                                        flush_cache=flush)  # fmt: skip


def _send(link: _Link, named, snap: DeltaSnapshot, full: bool, bucket_bytes: int, version: str | None,
          flush: bool) -> dict[str, float]:  # fmt: skip
    """Send every request, check the engines' checksums, send mismatched tensors again whole; the metrics."""
    from tidal.rollout import RolloutError, delta_checksum

    start = time.perf_counter()
    counts = {"weight_sync/delta_elements": 0.0, "weight_sync/delta_changed": 0.0}
    fallbacks, pending = 0, None
    requests = _requests(_entries(named, snap, full or snap.dtype is None, counts), bucket_bytes)
    for batch, following in pairwise(chain(requests, [None])):  # each request with whether it is the last
        last = following is None
        report = link.send([(key, payload) for _, key, payload, _ in batch], version if last else None, flush and last)
        if snap.dtype is None:  # the first sync: now the engines' dtype is known, the snapshot and sums follow it
            snap.dtype = getattr(torch, report["dtype"])
        expected = {}
        for name, key, payload, total in batch:
            value = payload.to(snap.dtype) if key == name else None
            if value is not None:
                snap.store(name, value)
                total = delta_checksum(value)
            expected[name] = total
        bad = _mismatched(expected, report["sums"])
        if bad:
            fallbacks += len(bad)
            logger.warning("--update-weight-delta: the engines' checksums of %d tensor(s) (%s) differ from the "
                           "actor's after the delta; sending them whole", len(bad), ", ".join(bad[:5]))  # fmt: skip
            again = link.send([(n, snap.tensors[n]) for n in bad], version if last else None, flush and last)
            still = _mismatched({n: delta_checksum(snap.tensors[n]) for n in bad}, again["sums"])
            if still:
                raise RolloutError(f"--update-weight-delta: the engines' weights of {', '.join(still[:5])} differ "
                                   f"from the actor's even after sending them whole")  # fmt: skip
        pending = last
    if pending is None and version is not None:  # nothing changed: still record the version and flush
        link.send([], version, flush)
    seconds = time.perf_counter() - start
    return counts | {
        "weight_sync/seconds": seconds,
        "weight_sync/mb": link.mb,
        "weight_sync/num_buckets": float(link.num_requests),
        "weight_sync/delta_fallbacks": float(fallbacks),
        "weight_sync/delta_full": float(full),
    }


def _mismatched(expected: dict[str, int], reports: list[dict[str, str | None]]) -> list[str]:
    """The tensors some engine process reports another checksum of.

    "error": it could not apply the entry; None: it holds only a shard, so it cannot check the whole tensor.
    """
    return sorted(n for n, s in expected.items() if any(r.get(n, "missing") not in (str(s), None) for r in reports))


class DeltaSync:
    """The driver's side: whether a sync may send deltas, and the calls on the sending ranks."""

    def __init__(self, sync: WeightSync) -> None:
        self.sync = sync
        self.base: int | None = None
        """The version every engine holds and the snapshots hold; None: the next sync sends everything whole."""

    def forget(self) -> None:
        """The engines may hold other weights than the snapshots (a restarted engine got the actor's current ones)."""
        self.base = None

    def send(self, engines: EngineWeights, version: int) -> dict[str, float]:
        """Hand ``version`` to ``engines`` as deltas against :attr:`base` (or whole); the senders' metrics."""
        from tidal.rollout import RolloutError

        ws, plan = self.sync, self.sync.plan
        full = self.base is None
        if not full:
            try:
                engines.check_weight_version(self.base)
            except RolloutError as e:
                logger.warning("--update-weight-delta: %s; sending the weights whole", e)
                full = True
        self.base = None
        targets = engines.weight_targets(plan.timeout_s)
        tp = max(t["tp_size"] for t in targets)
        folder = None
        if plan.transport != "tensor":  # the engines' reports (and the disk transport's files) in the run folder
            folder = ws.export.root / f"v{version:06d}-delta"
            shutil.rmtree(folder, ignore_errors=True)
        if plan.transport == "nccl":
            ws._weight_group(targets)
        stages = [None] if ws.actors.on_gpu and plan.transport == "tensor" else ws._stages()
        pin = plan.offload_train

        def send(stage: int | None, left: float) -> list:
            where = None if folder is None else str(folder if stage is None else folder / f"pp{stage}")
            return ws.actors.call_all("sync_delta", targets, str(version), plan.bucket_bytes, tp, stage, full, where,
                                      pin, plan.transport, timeout=left)  # fmt: skip

        metrics = ws._stages_in_turn(stages, send)
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)
        self.base = version
        elements = metrics.get("weight_sync/delta_elements", 0.0)
        metrics["weight_sync/delta_changed_share"] = metrics.get("weight_sync/delta_changed", 0.0) / max(elements, 1)
        metrics["weight_sync/delta_full"] = float(full)
        return metrics
