"""Agent functions the tests load by import path (``--agent-function-path`` style), written with the openai client.

Each runs a short chat against its gateway session; the row says what to do (``mode``): answer in two turns, raise,
stall past the timeout, pause between its turns, or return without calling the model.
"""

from __future__ import annotations

import asyncio

import openai

LOOPS: list[asyncio.AbstractEventLoop] = []
"""The event loop each ``two_turns`` episode ran on, in order."""


async def two_turns(base_url: str, api_key: str, row: dict) -> float:
    """Ask, then ask again with the answer in the history; the reward is the second answer's length parity."""
    mode = row.get("mode", "ok")
    LOOPS.append(asyncio.get_running_loop())
    if mode == "raise":
        raise ValueError(f"no tool for {row['prompt']!r}")
    if mode == "stall":
        await asyncio.sleep(60)
    if mode == "silent":
        return 1.0
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{"role": "user", "content": row["prompt"]}]
    first = await client.chat.completions.create(model="tidal", messages=messages, max_tokens=4)
    messages += [{"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": "1"}]
    if mode == "rewrite":  # a compacted history that extends no earlier call's tokens: a fork
        messages = [{"role": "user", "content": f"{row['prompt']}, then 1"}]
    if mode == "pause":  # a slow tool between the two calls
        await asyncio.sleep(row.get("pause_s", 2.0))
    second = await client.chat.completions.create(model="tidal", messages=messages, max_tokens=4)
    return float(len(second.choices[0].message.content or "") % 2)


def not_async(base_url: str, api_key: str, row: dict) -> float:
    return 0.0
