"""Extension points the `train` runs of the cross-package tests load by import path (tests/ on PYTHONPATH).

Both read files named by environment variables, so that a test decides what they do and sees where they ran.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from tidal.rollout import MultiTurn, Sample

TOOL_IDS = (5, 6, 7)
"""The "tool reply" inserted between the two turns (loss mask 0)."""


def two_turns_with_a_tool(engine, prompt_ids: list[int], sampling_params: dict[str, Any], *, label) -> Sample:
    """Two generated turns around TOOL_IDS, within the response length; appends ``pid argv[0]`` to $TIDAL_TEST_CALLS."""
    with open(os.environ["TIDAL_TEST_CALLS"], "a") as f:
        f.write(f"{os.getpid()} {sys.argv[0]}\n")
    turn = MultiTurn(prompt_ids, max_response_len=sampling_params["max_new_tokens"])
    turn.generate(engine, {**sampling_params, "max_new_tokens": 2})
    turn.append(TOOL_IDS)
    turn.generate(engine, sampling_params)
    return turn.sample(label=label)


def keep_listed_prompts(group) -> bool:
    """Keep a group whose prompt ids are listed in the JSON file $TIDAL_TEST_KEEP."""
    with open(os.environ["TIDAL_TEST_KEEP"]) as f:
        keep = {tuple(ids) for ids in json.load(f)}
    return tuple(int(t) for t in group[0].prompt_ids) in keep
