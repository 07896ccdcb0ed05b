"""tidal.rollout: SGLang engines, batched generation with log-probs, rewards, weight updates.

Config and errors import eagerly (standard library only); the rest loads on first access, so that
command-line validation answers before heavy dependencies are imported.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from tidal.rollout.config import ROUTER_POLICIES, RolloutConfig, sglang_router_args, sglang_server_args
from tidal.rollout.errors import EngineUnavailableError, RolloutError

if TYPE_CHECKING:
    from tidal.rollout.client import SGLangClient
    from tidal.rollout.custom_generate import GenerateFn, MultiTurn, load_generate_fn
    from tidal.rollout.debug_data import (
        load_rollout_data,
        rollout_data_path,
        sample_records,
        samples_from_records,
        save_rollout_data,
    )
    from tidal.rollout.dynamic_sampling import (
        BUILTIN_GROUP_FILTERS,
        DynamicSamplingResult,
        GroupFilter,
        resolve_group_filter,
        reward_variance,
        sample_with_dynamic_filter,
    )
    from tidal.rollout.engine import CPU_SERVER_ARGS, MEMORY_TAGS, SGLangEngine
    from tidal.rollout.generation import (
        check_chat_template,
        check_stop_tokens,
        filter_uniform_groups,
        generate_samples,
        model_stop_token_ids,
        rollout_metrics,
    )
    from tidal.rollout.health import Heartbeat
    from tidal.rollout.partial_rollout import (
        PartialRolloutResult,
        generate_partial_rollout,
        mask_offpolicy_tokens,
        resume_samples,
    )
    from tidal.rollout.progress import GenerationProgress
    from tidal.rollout.rewards import (
        BUILTIN_REWARDS,
        RewardFn,
        exact_match,
        extract_boxed,
        last_number,
        load_reward_fn,
        math_answer,
        numeric_match,
        resolve_reward_fn,
        score_samples,
    )
    from tidal.rollout.router import RolloutRouter, start_router
    from tidal.rollout.types import Sample
    from tidal.rollout.weight_sync import (
        destroy_weights_update_group,
        init_weights_update_group,
        update_weights_from_distributed,
        update_weights_from_tensor,
    )

_LAZY = {
    "SGLangClient": "client",
    "MEMORY_TAGS": "engine",
    "GenerationProgress": "progress",
    "Heartbeat": "health",
    "RolloutRouter": "router",
    "start_router": "router",
    "PartialRolloutResult": "partial_rollout",
    "generate_partial_rollout": "partial_rollout",
    "mask_offpolicy_tokens": "partial_rollout",
    "resume_samples": "partial_rollout",
    "GenerateFn": "custom_generate",
    "MultiTurn": "custom_generate",
    "load_generate_fn": "custom_generate",
    "load_rollout_data": "debug_data",
    "rollout_data_path": "debug_data",
    "save_rollout_data": "debug_data",
    "sample_records": "debug_data",
    "samples_from_records": "debug_data",
    "BUILTIN_GROUP_FILTERS": "dynamic_sampling",
    "DynamicSamplingResult": "dynamic_sampling",
    "GroupFilter": "dynamic_sampling",
    "resolve_group_filter": "dynamic_sampling",
    "reward_variance": "dynamic_sampling",
    "sample_with_dynamic_filter": "dynamic_sampling",
    "check_chat_template": "generation",
    "destroy_weights_update_group": "weight_sync",
    "init_weights_update_group": "weight_sync",
    "update_weights_from_distributed": "weight_sync",
    "update_weights_from_tensor": "weight_sync",
    "CPU_SERVER_ARGS": "engine",
    "SGLangEngine": "engine",
    "check_stop_tokens": "generation",
    "filter_uniform_groups": "generation",
    "generate_samples": "generation",
    "model_stop_token_ids": "generation",
    "rollout_metrics": "generation",
    "BUILTIN_REWARDS": "rewards",
    "RewardFn": "rewards",
    "exact_match": "rewards",
    "extract_boxed": "rewards",
    "last_number": "rewards",
    "load_reward_fn": "rewards",
    "math_answer": "rewards",
    "numeric_match": "rewards",
    "resolve_reward_fn": "rewards",
    "score_samples": "rewards",
    "Sample": "types",
}


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
    "BUILTIN_GROUP_FILTERS",
    "BUILTIN_REWARDS",
    "CPU_SERVER_ARGS",
    "MEMORY_TAGS",
    "ROUTER_POLICIES",
    "DynamicSamplingResult",
    "EngineUnavailableError",
    "GenerateFn",
    "GenerationProgress",
    "GroupFilter",
    "Heartbeat",
    "MultiTurn",
    "PartialRolloutResult",
    "RewardFn",
    "RolloutConfig",
    "RolloutError",
    "RolloutRouter",
    "SGLangClient",
    "SGLangEngine",
    "Sample",
    "check_chat_template",
    "check_stop_tokens",
    "destroy_weights_update_group",
    "exact_match",
    "extract_boxed",
    "filter_uniform_groups",
    "generate_partial_rollout",
    "generate_samples",
    "init_weights_update_group",
    "last_number",
    "load_generate_fn",
    "load_reward_fn",
    "load_rollout_data",
    "mask_offpolicy_tokens",
    "math_answer",
    "model_stop_token_ids",
    "numeric_match",
    "resolve_group_filter",
    "resolve_reward_fn",
    "resume_samples",
    "reward_variance",
    "rollout_data_path",
    "rollout_metrics",
    "sample_records",
    "sample_with_dynamic_filter",
    "samples_from_records",
    "save_rollout_data",
    "score_samples",
    "sglang_router_args",
    "sglang_server_args",
    "start_router",
    "update_weights_from_distributed",
    "update_weights_from_tensor",
]
