"""Repository-wide pytest hooks: hardware markers skip themselves when the hardware is absent.

With ``TIDAL_OPTION_MUTANT`` set (only tools/option_mutation.py sets it), every config this test process builds
carries that option mutant (:mod:`tidal.train.option_mutant`); unset, nothing changes.

Also registers the hypothesis profile ``mutation`` (``--hypothesis-profile=mutation``, which tools/mutation.py's
mutmut runs pass): fixed examples (the same verdict for a mutant on every run), no per-example deadline (mutmut's
trampolines slow every call) and fewer examples per property.
"""

import importlib.util
import os

import pytest

if importlib.util.find_spec("hypothesis") is not None:
    from hypothesis import HealthCheck, settings

    settings.register_profile(
        "mutation", max_examples=50, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow]
    )


def pytest_configure(config):
    """Install the option mutant TIDAL_OPTION_MUTANT names, if any, before any test module is imported."""
    if os.environ.get("TIDAL_OPTION_MUTANT"):
        from tidal.train.option_mutant import patch_configs

        patch_configs()


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
