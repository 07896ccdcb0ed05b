"""tidal.actor: Megatron-core policy model built from an HF checkpoint, packed log-probs, RL losses, train step.

Config and errors import eagerly (standard library only); the rest loads on first access, so that
command-line validation answers before heavy dependencies are imported.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import sys
from typing import TYPE_CHECKING, Any

# Patch 1 of compat.py, here because it must precede the first megatron-core import, and every tidal.actor
# submodule import runs this file first: sglang ships a flash_mla wheel whose import raises OSError without
# libcuda, which megatron-core does not catch; None makes it an ImportError.
sys.modules.setdefault("flash_mla", None)
# Patch 6 of compat.py, here for the same reason: megatron-core imports flashinfer (sglang's dependency) at import
# time, ~8 s per process, for MoE / inference kernels tidal-actor never calls; every such import is guarded by
# `except ImportError`. Without an NVIDIA driver those kernels cannot run, so the import is skipped there.
if not (os.path.exists("/proc/driver/nvidia") or os.path.exists("/dev/nvidia0")):
    sys.modules.setdefault("flashinfer", None)

from tidal.actor.auto_plan import MemoryChoice, choose_memory_config, fix_for_longest_sample  # noqa: E402
from tidal.actor.config import ActorConfig  # noqa: E402
from tidal.actor.errors import ActorError, ActorOutOfMemoryError  # noqa: E402
from tidal.actor.families import FAMILIES, Family, family_of, known_families  # noqa: E402
from tidal.actor.memory_plan import (  # noqa: E402
    MemoryInputs,
    MemoryPlan,
    ModelShape,
    largest_fitting_tokens,
    plan_memory,
)

if TYPE_CHECKING:
    from tidal.actor.actor import Actor
    from tidal.actor.bridge import build_gpt_model, load_hf_weights, named_hf_tensors
    from tidal.actor.critic import Critic
    from tidal.actor.distributed import (
        data_parallel_rank_and_size,
        destroy_distributed,
        init_distributed,
        stage_export_role,
    )
    from tidal.actor.hf_config import read_hf_config, to_transformer_config
    from tidal.actor.hf_export import HFTensorBucket
    from tidal.actor.lora import BaseReference
    from tidal.actor.lora_checkpoint import check_adapter_checkpoint
    from tidal.actor.lora_peft import gather_adapter_tensors, merged_hf_tensors, peft_adapter_config, write_peft_adapter
    from tidal.actor.lora_targets import resolve_target_modules
    from tidal.actor.reference import ReferenceModel
    from tidal.actor.trainer import train_on_rollout

_LAZY = {
    "Actor": "actor",
    "Critic": "critic",
    "build_gpt_model": "bridge",
    "load_hf_weights": "bridge",
    "named_hf_tensors": "bridge",
    "data_parallel_rank_and_size": "distributed",
    "destroy_distributed": "distributed",
    "init_distributed": "distributed",
    "stage_export_role": "distributed",
    "read_hf_config": "hf_config",
    "to_transformer_config": "hf_config",
    "HFTensorBucket": "hf_export",
    "BaseReference": "lora",
    "check_adapter_checkpoint": "lora_checkpoint",
    "gather_adapter_tensors": "lora_peft",
    "merged_hf_tensors": "lora_peft",
    "peft_adapter_config": "lora_peft",
    "write_peft_adapter": "lora_peft",
    "resolve_target_modules": "lora_targets",
    "ReferenceModel": "reference",
    "train_on_rollout": "trainer",
}

# The installed distribution's version (pyproject.toml's), e.g. "0.1.0".
__version__ = importlib.metadata.version("tidal-actor")


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


__all__ = [
    "FAMILIES",
    "Actor",
    "ActorConfig",
    "ActorError",
    "ActorOutOfMemoryError",
    "BaseReference",
    "Critic",
    "Family",
    "HFTensorBucket",
    "MemoryChoice",
    "MemoryInputs",
    "MemoryPlan",
    "ModelShape",
    "ReferenceModel",
    "build_gpt_model",
    "check_adapter_checkpoint",
    "choose_memory_config",
    "data_parallel_rank_and_size",
    "destroy_distributed",
    "family_of",
    "fix_for_longest_sample",
    "gather_adapter_tensors",
    "init_distributed",
    "known_families",
    "largest_fitting_tokens",
    "load_hf_weights",
    "merged_hf_tensors",
    "named_hf_tensors",
    "peft_adapter_config",
    "plan_memory",
    "read_hf_config",
    "resolve_target_modules",
    "stage_export_role",
    "to_transformer_config",
    "train_on_rollout",
    "write_peft_adapter",
]
