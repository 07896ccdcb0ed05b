"""Repository-wide pytest hooks: hardware markers skip themselves when the hardware is absent."""

import importlib.util

import pytest


def _cuda_device_count() -> int:
    if importlib.util.find_spec("torch") is None:
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def pytest_collection_modifyitems(config, items):
    """Skip `gpu` / `multi_gpu` tests when the machine lacks the GPUs they need."""
    gpu_marked = [item for item in items if "gpu" in item.keywords or "multi_gpu" in item.keywords]
    if not gpu_marked:
        return
    count = _cuda_device_count()
    for item in gpu_marked:
        if "multi_gpu" in item.keywords and count < 2:
            item.add_marker(pytest.mark.skip(reason=f"needs >= 2 CUDA GPUs, found {count}"))
        elif "gpu" in item.keywords and count < 1:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU, found none"))
