"""AdamW with its state in host memory (``--optimizer-cpu-offload``): GPU memory for bigger models or batches.

Adam's two moments are 8 bytes per parameter, the largest item of a mixed-precision actor (with fp32 main weights:
2 bf16 + 4 main + 4 main gradient + 8 Adam = 18 bytes; a 7B model's moments alone are 61 GB). Here they live in
host memory and the update runs on the CPU: the parameters and gradients stream through one pinned staging buffer
in slices of ``staging_bytes`` (device to host, AdamW on the slice, host to device; on CUDA the next slice's download
overlaps the CPU update of this one), so the host holds the moments plus two staging pairs, never a second full copy
of the weights. The update is torch's own fused AdamW on the CPU, the arithmetic of ``torch.optim.AdamW``; the price is
the transfer and the CPU's speed (``bench/RESULTS.md``).

On a CPU-only machine the same code runs with host-to-host copies, which is what the CPU tests exercise.

:func:`move_tensors` is the co-located hand-off (``Actor.offload`` / ``Actor.onload``): it moves parameters,
gradients and optimizer state between the GPU and (pinned) host memory in place, so every holder of a tensor (the
model, the optimizer's state keyed by its parameters) sees it move.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.optim.adamw import adamw

logger = logging.getLogger(__name__)


def move_tensors(tensors: Iterable[torch.Tensor], device: torch.device) -> int:
    """Move each tensor's data to ``device`` in place (``t.data = ...``); bytes moved (0 for those already there).

    To the host, the copies land in pinned memory so that the way back is an asynchronous copy; the call returns
    after the copies are done.
    """
    moved, seen = 0, set()
    for t in tensors:
        if t.device == device or id(t) in seen:
            continue
        seen.add(id(t))
        if device.type == "cpu":
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=torch.cuda.is_available())
            host.copy_(t.data, non_blocking=True)
            t.data = host
        else:
            t.data = t.data.to(device, non_blocking=True)
        moved += t.numel() * t.element_size()
    if moved and torch.cuda.is_available():
        torch.cuda.synchronize()
        if device.type == "cpu":
            torch.cuda.empty_cache()
    return moved


def host_copy_shapes(
    tensors: Iterable[torch.Tensor], *, with_host: bool = False
) -> list[tuple[torch.Size, torch.dtype]]:
    """Shape and dtype of the host copy :func:`move_tensors` makes of each distinct tensor not yet on the host.

    ``with_host`` counts the tensors already on the host too (what a CPU test can compare).
    """
    shapes, seen = [], set()
    for t in tensors:
        if (with_host or t.device.type != "cpu") and id(t) not in seen:
            seen.add(id(t))
            shapes.append((t.shape, t.dtype))
    return shapes


class PinnedReservation:
    """Pins host memory for ``shapes`` in a background thread, then hands it to torch's pinned-memory cache.

    Pinned host memory comes from ``cudaHostAlloc``, about 1.2 GB/s on an H200 host: the first offload of a 1.5B
    actor (26 GiB) took 22.3 s, later ones 0.56 s (``bench/RESULTS.md``). torch caches freed pinned blocks by
    size (rounded up to a power of two), so blocks of the sizes :func:`move_tensors` will ask for, allocated and
    released here while the engines start, are the ones the first offload gets. :meth:`wait` before that offload.
    """

    def __init__(self, shapes: list[tuple[torch.Size, torch.dtype]]) -> None:
        self.shapes = shapes
        self.bytes = sum(torch.Size(s).numel() * d.itemsize for s, d in shapes)
        self.seconds: float | None = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._pin, name="tidal-pin-host-memory", daemon=True)
        self._thread.start()

    def _pin(self) -> None:
        tick = time.perf_counter()
        try:
            held = [torch.empty(s, dtype=d, pin_memory=True) for s, d in self.shapes]
            del held  # back to torch's cache, not to the system
        except BaseException as e:  # e.g. the host is short of memory: the offload will pin (or fail) itself
            self.error = e
        self.seconds = time.perf_counter() - tick

    def wait(self) -> None:
        """Block until the memory is pinned (at once after the first call); a failure is logged, not raised."""
        self._thread.join()
        if self.error is not None:
            logger.warning("pinning %.1f GiB of host memory for offload failed: %r", self.bytes / 2**30, self.error)
            self.error = None


class CPUOffloadAdamW(torch.optim.Optimizer):
    """``torch.optim.AdamW`` (no amsgrad) whose ``exp_avg``/``exp_avg_sq`` are fp32 host tensors.

    ``param_groups`` and ``state`` are keyed by the (device) parameters as in any torch optimizer, so learning-rate
    schedules and state dicts work unchanged; ``state_dict()`` holds host tensors and ``load_state_dict`` keeps
    them on the host (torch's would move them to the parameters' device).

    Args:
        params: the parameters to update (any floating dtype and device; the update is computed in fp32).
        staging_bytes: size of the pinned fp32 staging buffer for each of parameters and gradients.
    """

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter],
        *,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        staging_bytes: int = 256 * 2**20,
    ) -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        self._staging_numel = max(1, staging_bytes // 4)
        self._staging: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    def init_state(self) -> None:
        """Give every parameter its zero state now (the same update as lazy creation), e.g. to checkpoint it."""
        for group in self.param_groups:
            for p in group["params"]:
                self._param_state(p)

    def _param_state(self, p: torch.Tensor) -> dict[str, torch.Tensor]:
        state = self.state[p]
        if not state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros(p.shape, dtype=torch.float32)
            state["exp_avg_sq"] = torch.zeros(p.shape, dtype=torch.float32)
        return state

    def _buffers(self, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Two (parameters, gradients) staging pairs, pinned on CUDA; on CPU one pair serves both."""
        if self._staging is None:
            pin = device.type == "cuda"

            def pair() -> tuple[torch.Tensor, torch.Tensor]:
                return tuple(torch.empty(self._staging_numel, dtype=torch.float32, pin_memory=pin) for _ in range(2))

            first = pair()
            self._staging = [first, pair() if pin else first]
        return self._staging

    def _slices(self, params: list[torch.Tensor]) -> Iterator[list[tuple[torch.Tensor, int, int, int]]]:
        """Consecutive (param, start, stop, staging offset) runs that fill the staging buffer at most once each."""
        batch, used = [], 0
        for p in params:
            start, numel = 0, p.numel()
            while start < numel:
                take = min(numel - start, self._staging_numel - used)
                batch.append((p, start, start + take, used))
                used += take
                start += take
                if used == self._staging_numel:
                    yield batch
                    batch, used = [], 0
        if batch:
            yield batch

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        """One AdamW update of every parameter with a gradient; ``closure`` is not supported.

        On CUDA the slices are pipelined through two staging pairs: while the CPU updates slice i, the device copies
        slice i + 1 to the host (all copies on the current stream, so slice i + 1's download is ordered after slice
        i - 1's upload from the same buffers).
        """
        if closure is not None:
            raise ValueError("CPUOffloadAdamW.step does not take a closure")
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            cuda = params[0].device.type == "cuda"
            buffers = self._buffers(params[0].device)
            steps = {p: self._param_state(p)["step"] + 0 for p in params}  # the step before this update
            batches = list(self._slices(params))
            ready = [self._download(batches[0], *buffers[0], cuda)] if cuda else []
            for i, batch in enumerate(batches):
                host_p, host_g = buffers[i % 2]
                if cuda:  # start the next slice's download, then wait for this one's
                    if i + 1 < len(batches):
                        ready.append(self._download(batches[i + 1], *buffers[(i + 1) % 2], cuda))
                    ready[i].synchronize()
                else:
                    self._download(batch, host_p, host_g, cuda)
                self._update(group, batch, host_p, host_g, steps)
                for p, start, stop, off in batch:
                    p.detach().view(-1)[start:stop].copy_(host_p[off : off + stop - start], non_blocking=cuda)
            if cuda:  # the last uploads read the staging buffers
                torch.cuda.current_stream().synchronize()
            for p in params:
                self.state[p]["step"] += 1

    @staticmethod
    def _download(batch, host_p: torch.Tensor, host_g: torch.Tensor, cuda: bool) -> torch.cuda.Event | None:
        """Copy ``batch``'s parameter and gradient slices into the staging pair; on CUDA, the event that marks it."""
        for p, start, stop, off in batch:
            host_p[off : off + stop - start].copy_(p.detach().view(-1)[start:stop], non_blocking=cuda)
            host_g[off : off + stop - start].copy_(p.grad.view(-1)[start:stop], non_blocking=cuda)
        if not cuda:
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    def _update(self, group: dict[str, Any], batch, host_p: torch.Tensor, host_g: torch.Tensor, steps) -> None:
        beta1, beta2 = group["betas"]
        adamw(
            [host_p[off : off + b - a] for _, a, b, off in batch],
            [host_g[off : off + b - a] for _, a, b, off in batch],
            [self.state[p]["exp_avg"].view(-1)[a:b] for p, a, b, _ in batch],
            [self.state[p]["exp_avg_sq"].view(-1)[a:b] for p, a, b, _ in batch],
            [],
            [steps[p].clone() for p, *_ in batch],  # incremented by adamw: once per slice, from the same value
            foreach=False,
            fused=True,  # torch's fused CPU kernel: one vectorised pass, ~13x the single-tensor path here
            amsgrad=False,
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=False,
        )

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a ``state_dict()`` of this class or of ``torch.optim.AdamW``; the moments stay in host memory."""
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups) or any(
            len(s["params"]) != len(g["params"]) for s, g in zip(saved_groups, self.param_groups, strict=True)
        ):
            raise ValueError("loaded optimizer state has a different number of parameter groups or parameters")
        state: defaultdict[torch.Tensor, dict[str, Any]] = defaultdict(dict)
        for saved, group in zip(saved_groups, self.param_groups, strict=True):
            group.update({k: v for k, v in saved.items() if k != "params"})
            for saved_id, p in zip(saved["params"], group["params"], strict=True):
                if saved_id in state_dict["state"]:
                    state[p] = {
                        k: v.detach().to("cpu", torch.float32).clone() if torch.is_tensor(v) else v
                        for k, v in state_dict["state"][saved_id].items()
                    }
        self.state = state
