"""AdamW with its state in host memory (``--optimizer-cpu-offload``): GPU memory for bigger models or batches.

Adam's two moments are 8 bytes per parameter, the largest item of a mixed-precision actor (with fp32 main weights:
2 bf16 + 4 main + 4 main gradient + 8 Adam = 18 bytes; a 7B model's moments alone are 61 GB). Here they live in
host memory and the update runs on the CPU: the parameters and gradients stream through one pinned staging buffer
in slices of ``staging_bytes`` (device to host, AdamW on the slice, host to device), so the host holds the moments
plus the staging buffer, never a second full copy of the weights. The update is torch's own functional AdamW, the
arithmetic of ``torch.optim.AdamW``; the price is the transfer and the CPU's speed (``bench/RESULTS.md``).

On a CPU-only machine the same code runs with host-to-host copies, which is what the CPU tests exercise.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.optim.adamw import adamw


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
        self._staging: tuple[torch.Tensor, torch.Tensor] | None = None

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

    def _buffers(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if self._staging is None:
            pin = device.type == "cuda"
            self._staging = tuple(
                torch.empty(self._staging_numel, dtype=torch.float32, pin_memory=pin) for _ in range(2)
            )
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
        """One AdamW update of every parameter with a gradient; ``closure`` is not supported."""
        if closure is not None:
            raise ValueError("CPUOffloadAdamW.step does not take a closure")
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            host_p, host_g = self._buffers(params[0].device)
            beta1, beta2 = group["betas"]
            steps = {p: self._param_state(p)["step"] + 0 for p in params}  # the step before this update
            for batch in self._slices(params):
                views = []
                for p, start, stop, off in batch:
                    n = stop - start
                    host_p[off : off + n].copy_(p.detach().view(-1)[start:stop], non_blocking=True)
                    host_g[off : off + n].copy_(p.grad.view(-1)[start:stop], non_blocking=True)
                    views.append((p, start, stop, off, n))
                if params[0].device.type == "cuda":
                    torch.cuda.current_stream().synchronize()
                adamw(
                    [host_p[off : off + n] for _, _, _, off, n in views],
                    [host_g[off : off + n] for _, _, _, off, n in views],
                    [self.state[p]["exp_avg"].view(-1)[a:b] for p, a, b, _, _ in views],
                    [self.state[p]["exp_avg_sq"].view(-1)[a:b] for p, a, b, _, _ in views],
                    [],
                    [steps[p].clone() for p, *_ in views],  # incremented by adamw: once per slice, from the same value
                    foreach=False,
                    amsgrad=False,
                    beta1=beta1,
                    beta2=beta2,
                    lr=group["lr"],
                    weight_decay=group["weight_decay"],
                    eps=group["eps"],
                    maximize=False,
                )
                for p, start, stop, off, n in views:
                    p.detach().view(-1)[start:stop].copy_(host_p[off : off + n], non_blocking=True)
                if params[0].device.type == "cuda":  # the staging buffer is refilled by the next batch
                    torch.cuda.current_stream().synchronize()
            for p in params:
                self.state[p]["step"] += 1

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
