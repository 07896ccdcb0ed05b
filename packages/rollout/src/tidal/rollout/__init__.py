"""tidal.rollout: SGLang engines, batched generation with log-probs, rewards, weight updates.

Config and errors import eagerly (standard library only); the rest loads on first access, so that
command-line validation answers before heavy dependencies are imported.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from typing import TYPE_CHECKING, Any

from tidal.rollout.config import WILDCARD_HOSTS, RolloutConfig
from tidal.rollout.errors import EngineUnavailableError, RolloutError
from tidal.rollout.pass_through import (
    server_arg_value,
    sglang_arg_problems,
    sglang_router_args,
    sglang_server_args,
    sglang_value_problems,
    with_engine_tp,
)

if TYPE_CHECKING:
    from tidal.rollout.client import SGLangClient
    from tidal.rollout.custom_generate import GenerateFn, MultiTurn, load_generate_fn
    from tidal.rollout.debug_data import load_rollout_data, sample_records, samples_from_records, save_rollout_data
    from tidal.rollout.dynamic_sampling import (
        GroupFilter,
        resolve_group_filter,
        reward_variance,
        sample_with_dynamic_filter,
    )
    from tidal.rollout.engine import DELTA_LOADER, SGLangEngine
    from tidal.rollout.engine_delta import DELTA_FILE, DELTA_REPORT, DELTA_ROUTE, delta_checksum, encode_delta
    from tidal.rollout.gateway.agents import AgentRunner, agent_rollout, load_agent_fn
    from tidal.rollout.gateway.partial_agents import AgentGroupPool, CallHold, partial_agent_rollout
    from tidal.rollout.gateway.request import parse_request
    from tidal.rollout.gateway.server import Gateway
    from tidal.rollout.generation import (
        check_chat_template,
        check_stop_tokens,
        filter_uniform_groups,
        generate_samples,
        rollout_metrics,
    )
    from tidal.rollout.health import Heartbeat
    from tidal.rollout.import_path import load_callable
    from tidal.rollout.lora_adapters import ServedAdapters, adapter_name, load_adapter_from_tensors, lora_server_args
    from tidal.rollout.partial_rollout import InterruptibleUpdates, UpdateGate, generate_partial_rollout
    from tidal.rollout.rewards import RewardFn, RewardResult, resolve_reward_fn, score_samples
    from tidal.rollout.router import RolloutRouter
    from tidal.rollout.sandbox import check_sandbox
    from tidal.rollout.staleness import mask_stale_tokens, staleness_metrics, version_number
    from tidal.rollout.types import Sample, episode_ids, num_episodes
    from tidal.rollout.verified_math import MathVerifier
    from tidal.rollout.weight_sync import (
        destroy_weights_update_group,
        init_weights_update_group,
        update_weights_from_distributed,
        update_weights_from_tensor,
    )

_LAZY = {
    "DELTA_LOADER": "engine",
    "DELTA_FILE": "engine_delta",
    "DELTA_REPORT": "engine_delta",
    "DELTA_ROUTE": "engine_delta",
    "delta_checksum": "engine_delta",
    "encode_delta": "engine_delta",
    "SGLangClient": "client",
    "RolloutRouter": "router",
    "GenerateFn": "custom_generate",
    "MultiTurn": "custom_generate",
    "load_generate_fn": "custom_generate",
    "load_rollout_data": "debug_data",
    "sample_records": "debug_data",
    "samples_from_records": "debug_data",
    "save_rollout_data": "debug_data",
    "GroupFilter": "dynamic_sampling",
    "resolve_group_filter": "dynamic_sampling",
    "reward_variance": "dynamic_sampling",
    "sample_with_dynamic_filter": "dynamic_sampling",
    "SGLangEngine": "engine",
    "Gateway": "gateway.server",
    "parse_request": "gateway.request",
    "AgentRunner": "gateway.agents",
    "agent_rollout": "gateway.agents",
    "load_agent_fn": "gateway.agents",
    "AgentGroupPool": "gateway.partial_agents",
    "CallHold": "gateway.partial_agents",
    "partial_agent_rollout": "gateway.partial_agents",
    "check_chat_template": "generation",
    "check_stop_tokens": "generation",
    "filter_uniform_groups": "generation",
    "generate_samples": "generation",
    "rollout_metrics": "generation",
    "Heartbeat": "health",
    "load_callable": "import_path",
    "ServedAdapters": "lora_adapters",
    "adapter_name": "lora_adapters",
    "load_adapter_from_tensors": "lora_adapters",
    "lora_server_args": "lora_adapters",
    "generate_partial_rollout": "partial_rollout",
    "InterruptibleUpdates": "partial_rollout",
    "UpdateGate": "partial_rollout",
    "RewardFn": "rewards",
    "RewardResult": "rewards",
    "check_sandbox": "sandbox",
    "resolve_reward_fn": "rewards",
    "score_samples": "rewards",
    "mask_stale_tokens": "staleness",
    "staleness_metrics": "staleness",
    "version_number": "staleness",
    "Sample": "types",
    "MathVerifier": "verified_math",
    "episode_ids": "types",
    "num_episodes": "types",
    "destroy_weights_update_group": "weight_sync",
    "init_weights_update_group": "weight_sync",
    "update_weights_from_distributed": "weight_sync",
    "update_weights_from_tensor": "weight_sync",
}

# The installed distribution's version (pyproject.toml's), e.g. "0.1.0".
__version__ = importlib.metadata.version("tidal-rollout")


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
    "DELTA_FILE",
    "DELTA_LOADER",
    "DELTA_REPORT",
    "DELTA_ROUTE",
    "WILDCARD_HOSTS",
    "AgentGroupPool",
    "AgentRunner",
    "CallHold",
    "EngineUnavailableError",
    "Gateway",
    "GenerateFn",
    "GroupFilter",
    "Heartbeat",
    "InterruptibleUpdates",
    "MathVerifier",
    "MultiTurn",
    "RewardFn",
    "RewardResult",
    "RolloutConfig",
    "RolloutError",
    "RolloutRouter",
    "SGLangClient",
    "SGLangEngine",
    "Sample",
    "ServedAdapters",
    "UpdateGate",
    "adapter_name",
    "agent_rollout",
    "check_chat_template",
    "check_sandbox",
    "check_stop_tokens",
    "delta_checksum",
    "destroy_weights_update_group",
    "encode_delta",
    "episode_ids",
    "filter_uniform_groups",
    "generate_partial_rollout",
    "generate_samples",
    "init_weights_update_group",
    "load_adapter_from_tensors",
    "load_agent_fn",
    "load_callable",
    "load_generate_fn",
    "load_rollout_data",
    "lora_server_args",
    "mask_stale_tokens",
    "num_episodes",
    "parse_request",
    "partial_agent_rollout",
    "resolve_group_filter",
    "resolve_reward_fn",
    "reward_variance",
    "rollout_metrics",
    "sample_records",
    "sample_with_dynamic_filter",
    "samples_from_records",
    "save_rollout_data",
    "score_samples",
    "server_arg_value",
    "sglang_arg_problems",
    "sglang_router_args",
    "sglang_server_args",
    "sglang_value_problems",
    "staleness_metrics",
    "update_weights_from_distributed",
    "update_weights_from_tensor",
    "version_number",
    "with_engine_tp",
]
