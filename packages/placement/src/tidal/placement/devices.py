"""The GPUs a local Ray declares: the CUDA GPUs that exist, or logical ones on a CPU-only machine (stdlib only).

The rule, decided once here and used by both the command line's check and :func:`tidal.placement.start_ray`:

- CUDA GPUs detected (``nvidia-smi``, narrowed by ``CUDA_VISIBLE_DEVICES``): Ray declares exactly those, and a
  job that needs more fails before Ray starts, with needed vs available in one line.
- none detected: CPU mode. Ray declares *logical* GPUs, as many as the job needs, so the same placement code runs
  every actor rank and engine on the CPU (the embedded default and the test-suite run this way); the log says so.
  The local Ray's CPUs still bound how many GPU bundles fit.

``--num-gpus-local N`` overrides the count: fewer than detected (use part of a machine), or any number in CPU mode.
Detection never imports torch, so the check answers in well under a second.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from tidal.placement.config import PlacementConfig
from tidal.placement.errors import ResourceShortageError
from tidal.placement.plan import describe_need

NVIDIA_SMI_TIMEOUT_S = 10.0


def _visible_devices() -> list[str] | None:
    """``CUDA_VISIBLE_DEVICES`` as a list (None: unset); "-1" or an empty value hides every GPU."""
    value = os.environ.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return None
    ids = [v.strip() for v in value.split(",") if v.strip()]
    return [] if not ids or ids[0] in ("-1", "NoDevFiles") else ids


def _installed_gpus() -> int:
    """CUDA GPUs on this machine: ``nvidia-smi -L``, else the driver's /proc entries, else 0."""
    smi = shutil.which("nvidia-smi")
    if smi is not None:
        try:
            out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=NVIDIA_SMI_TIMEOUT_S, check=False)
        except (OSError, subprocess.TimeoutExpired):
            out = None
        if out is not None and out.returncode == 0:
            return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))
    proc = Path("/proc/driver/nvidia/gpus")
    return len(list(proc.iterdir())) if proc.is_dir() else 0


def gpu_memory_bytes() -> int | None:
    """Memory of the smallest CUDA GPU on this machine (``nvidia-smi -q -d MEMORY``); None without one."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run(
            [smi, "-q", "-d", "MEMORY"], capture_output=True, text=True, timeout=NVIDIA_SMI_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return parse_gpu_memory(out.stdout) if out.returncode == 0 else None


def parse_gpu_memory(report: str) -> int | None:
    """The smallest "FB Memory Usage" total of an ``nvidia-smi -q -d MEMORY`` report, in bytes."""
    totals, in_fb = [], False
    for line in report.splitlines():
        text = line.strip()
        if text.endswith("Memory Usage"):
            in_fb = text.startswith("FB")
        elif in_fb and text.startswith("Total") and text.endswith("MiB"):
            totals.append(int(text.split(":")[1].split()[0]) * 2**20)
            in_fb = False
    return min(totals) if totals else None


def detect_gpus() -> int:
    """CUDA GPUs this process may use (what Ray would see), without importing torch."""
    installed = _installed_gpus()
    visible = _visible_devices()
    return installed if visible is None else min(installed, len(visible))


@dataclass(frozen=True, kw_only=True, slots=True)
class LocalGpus:
    """What a local Ray declares for a job (a plan object, derived from the config and the machine)."""

    num_gpus: int
    """GPUs the local Ray declares."""
    detected: int
    """CUDA GPUs detected on this machine."""
    logical: bool
    """CPU mode: no CUDA GPU, so the GPUs are logical and every rank and engine runs on the CPU."""

    def describe(self) -> str:
        """One phrase for the log: how many GPUs, and whether they are real."""
        if self.logical:
            return (
                f"{self.num_gpus} logical GPUs (CPU mode: no CUDA GPU detected; every actor rank and engine runs "
                "on the CPU)"
            )
        return f"{self.num_gpus} GPUs (of {self.detected} CUDA GPU(s) detected)"


def _fixes(cfg: PlacementConfig, available: int) -> list[str]:
    fixes = []
    if not cfg.colocate and cfg.num_actor_gpus <= available:
        fixes.append(f"--colocate (rollout shares the actor's {cfg.num_actor_gpus})")
        room = (available - cfg.num_actor_gpus) // cfg.rollout_num_gpus_per_engine * cfg.rollout_num_gpus_per_engine
        if room >= 1:
            fixes.append(f"--rollout-num-gpus {room}")
    fixes.append("lower --actor-num-nodes / --actor-num-gpus-per-node / --rollout-num-gpus")
    return fixes


def plan_local_gpus(cfg: PlacementConfig, detected: int) -> LocalGpus:
    """Decide what a local Ray declares for ``cfg`` on a machine with ``detected`` CUDA GPUs, and check it fits.

    Raises:
        ValueError: ``--num-gpus-local`` asks for more GPUs than the machine has.
        ResourceShortageError: the job needs more GPUs (or, in CPU mode, more GPU bundles than the local Ray's
            CPUs hold) than there are; one line with needed vs available and the flags to change.
    """
    if detected > 0:
        if cfg.num_gpus_local is not None and cfg.num_gpus_local > detected:
            raise ValueError(
                f"--num-gpus-local {cfg.num_gpus_local} exceeds the {detected} CUDA GPU(s) of this machine; "
                f"give at most {detected}, or leave it unset to use them all"
            )
        local = LocalGpus(num_gpus=cfg.num_gpus_local or detected, detected=detected, logical=False)
    else:
        local = LocalGpus(num_gpus=cfg.num_gpus_local or cfg.num_gpus, detected=0, logical=True)
    if cfg.num_gpus > local.num_gpus:
        what = (
            f"--num-gpus-local {local.num_gpus} logical GPUs (CPU mode)"
            if local.logical
            else f"{local.num_gpus} CUDA GPU(s) on this machine" + (" (--num-gpus-local)" if cfg.num_gpus_local else "")
        )
        raise ResourceShortageError(
            f"not enough GPUs: this job needs {describe_need(cfg)}, available: {what}. "
            f"Fix (any one): {'; '.join(_fixes(cfg, local.num_gpus))}; or --ray-address of a cluster with more GPUs"
        )
    bundles_fit = int(cfg.num_cpus_local / cfg.num_cpus_per_bundle + 1e-9)
    if local.logical and cfg.num_gpus > bundles_fit:
        raise ResourceShortageError(
            f"not enough GPUs: this job needs {describe_need(cfg)}, available: none (no CUDA GPU detected on this "
            f"machine); CPU mode runs on logical GPUs, but a local Ray of --num-cpus-local {cfg.num_cpus_local} CPUs "
            f"holds at most {bundles_fit} GPU bundles of --num-cpus-per-bundle {cfg.num_cpus_per_bundle:g}. "
            f"Fix (any one): run on a machine with GPUs (or --ray-address of a GPU cluster); "
            f"{'; '.join(_fixes(cfg, bundles_fit))}"
        )
    return local
