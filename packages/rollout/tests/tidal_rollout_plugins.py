"""Extension points the tests load by import path (the tests put this directory on sys.path).

The multi-turn task: the policy answers, a "calculator tool" replies with a fixed sentence, the policy
answers again. The tool's tokens are part of the response but get loss mask 0.
"""

from __future__ import annotations

import functools
from typing import Any

from tidal.rollout import MultiTurn, Sample, SGLangEngine

TOOL_REPLY = "the answer is 4"


@functools.cache
def _tool_reply_ids(model_path: str) -> tuple[int, ...]:
    from transformers import AutoTokenizer

    return tuple(AutoTokenizer.from_pretrained(model_path).encode(TOOL_REPLY))


def two_turn_tool_task(
    engine: SGLangEngine, prompt_ids: list[int], sampling_params: dict[str, Any], *, label
) -> Sample:
    tool = _tool_reply_ids(engine.model_path)
    # A response budget one token short of two full turns: the second turn is cut to fit it.
    turn = MultiTurn(prompt_ids, max_response_len=2 * sampling_params["max_new_tokens"] + len(tool) - 1)
    turn.generate(engine, sampling_params)
    turn.append(tool)
    turn.generate(engine, sampling_params)
    return turn.sample(label=label)


async def async_one_turn(engine: SGLangEngine, prompt_ids: list[int], sampling_params: dict[str, Any], *, label):
    turn = MultiTurn(prompt_ids)
    turn.generate(engine, sampling_params)
    return turn.sample(label=label)


def fails_on_boom(engine: SGLangEngine, prompt_ids: list[int], sampling_params: dict[str, Any], *, label) -> Sample:
    if label == "boom":
        raise ConnectionError("tool server unreachable")
    turn = MultiTurn(prompt_ids)
    turn.generate(engine, sampling_params)
    return turn.sample(label=label)


def returns_text(engine: SGLangEngine, prompt_ids: list[int], sampling_params: dict[str, Any], *, label) -> str:
    return "not a sample"


def parity_reward(sample: Sample) -> float:
    """Rewards that are all equal for label "const" and vary by sampled tokens otherwise."""
    if sample.label == "const":
        return 1.0
    return float(sum(sample.response_ids) % 2)


def keep_nothing(group) -> bool:
    return False
