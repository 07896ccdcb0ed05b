"""tidal.rollout: SGLang engines, batched generation with log-probs, rewards, weight updates."""

from tidal.rollout.config import RolloutConfig, sglang_server_args
from tidal.rollout.engine import CPU_SERVER_ARGS, SGLangEngine
from tidal.rollout.errors import RolloutError
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

# Weight sync needs torch; loaded on first use so that `import tidal.rollout` (and the config) stays light.
_WEIGHT_SYNC = (
    "destroy_weights_update_group",
    "init_weights_update_group",
    "update_weights_from_distributed",
    "update_weights_from_tensor",
)


def __getattr__(name: str) -> object:
    if name in _WEIGHT_SYNC:
        from tidal.rollout import weight_sync

        return getattr(weight_sync, name)
    raise AttributeError(f"module 'tidal.rollout' has no attribute {name!r}")


__all__ = [
    "BUILTIN_REWARDS",
    "CPU_SERVER_ARGS",
    "RewardFn",
    "RolloutConfig",
    "RolloutError",
    "SGLangEngine",
    "Sample",
    "check_stop_tokens",
    "exact_match",
    "extract_boxed",
    "filter_uniform_groups",
    "generate_samples",
    "last_number",
    "load_reward_fn",
    "math_answer",
    "model_stop_token_ids",
    "numeric_match",
    "resolve_reward_fn",
    "rollout_metrics",
    "score_samples",
    "sglang_server_args",
    *_WEIGHT_SYNC,
]
