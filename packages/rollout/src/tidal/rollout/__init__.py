"""tidal.rollout: SGLang engines, batched generation with log-probs, rewards, weight updates.

Config and errors import eagerly (standard library only); the rest loads on first access, so that
command-line validation answers before heavy dependencies are imported.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from tidal.rollout.config import RolloutConfig, sglang_server_args
from tidal.rollout.errors import RolloutError

if TYPE_CHECKING:
    from tidal.rollout.engine import CPU_SERVER_ARGS, SGLangEngine
    from tidal.rollout.generation import (
        check_stop_tokens,
        filter_uniform_groups,
        generate_samples,
        model_stop_token_ids,
        rollout_metrics,
    )
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
    from tidal.rollout.types import Sample
    from tidal.rollout.weight_sync import (
        destroy_weights_update_group,
        init_weights_update_group,
        update_weights_from_distributed,
        update_weights_from_tensor,
    )

_LAZY = {
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
    "BUILTIN_REWARDS",
    "CPU_SERVER_ARGS",
    "RewardFn",
    "RolloutConfig",
    "RolloutError",
    "SGLangEngine",
    "Sample",
    "check_stop_tokens",
    "destroy_weights_update_group",
    "exact_match",
    "extract_boxed",
    "filter_uniform_groups",
    "generate_samples",
    "init_weights_update_group",
    "last_number",
    "load_reward_fn",
    "math_answer",
    "model_stop_token_ids",
    "numeric_match",
    "resolve_reward_fn",
    "rollout_metrics",
    "score_samples",
    "sglang_server_args",
    "update_weights_from_distributed",
    "update_weights_from_tensor",
]
