"""Host-to-GPU copies that never make the host wait for the GPU's queue.

``tensor.to("cuda")`` from ordinary (pageable) host memory synchronizes the stream: the host stops until every
kernel queued before it has run, and the GPU then idles while the host launches the next ones. Inside a training
step that happened at every micro-batch's inputs and at each of its loss fields. Copied through pinned memory with
``non_blocking=True`` instead, the copy is queued like a kernel;
PyTorch's pinned-memory cache keeps the staging block until the copy has run.
"""

from __future__ import annotations

import torch


def to_device(tensor: torch.Tensor, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``tensor`` (as ``dtype``, if given) on ``device``, queued without a host wait when it goes host → GPU."""
    if dtype is not None and tensor.device.type == "cpu":
        tensor = tensor.to(dtype)  # convert on the host: the device gets the final bytes in one copy
    if device.type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device=device, dtype=dtype)
    if not tensor.is_pinned():
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)


def to_host_async(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` copied to (pinned) host memory without a wait: read it only after the stream is synchronized."""
    if tensor.device.type != "cuda":
        return tensor.cpu()
    return tensor.to("cpu", non_blocking=True)
