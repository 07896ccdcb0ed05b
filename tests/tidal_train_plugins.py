"""Extension points the `train` runs of the cross-package tests load by import path (tests/ on PYTHONPATH).

Some read files named by environment variables, so that a test decides what they do and sees where they ran;
``counting_agent`` counts in this module (it runs in the test's own process).
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import time
from collections import defaultdict
from typing import Any

from tidal.rollout import Sample

TOOL_IDS = (5, 6, 7)
"""The "tool reply" inserted between the two turns (loss mask 0)."""


def two_turns_with_a_tool(engine, prompt_ids: list[int], sampling_params: dict[str, Any], *, label) -> Sample:
    """Two generated turns around TOOL_IDS, within the response length; appends ``pid argv[0]`` to $TIDAL_TEST_CALLS."""
    with open(os.environ["TIDAL_TEST_CALLS"], "a") as f:
        f.write(f"{os.getpid()} {sys.argv[0]}\n")
    limit = sampling_params["max_new_tokens"]
    params = {k: v for k, v in sampling_params.items() if k != "n"}
    (first,) = engine.generate([prompt_ids], {**params, "max_new_tokens": 2})
    response = [*first["output_ids"], *TOOL_IDS]
    (second,) = engine.generate([[*prompt_ids, *response]], {**params, "max_new_tokens": limit - len(response)})
    return Sample(
        prompt_ids=prompt_ids,
        response_ids=[*response, *second["output_ids"]],
        response_log_probs=[*first["output_log_probs"], *[0.0] * len(TOOL_IDS), *second["output_log_probs"]],
        response_loss_mask=[1] * len(first["output_ids"]) + [0] * len(TOOL_IDS) + [1] * len(second["output_ids"]),
        finish_reason=second["finish_reason"],
        label=label,
        weight_version=second["weight_version"],
    )


def _plain_sample(engine, prompt_ids: list[int], sampling_params: dict[str, Any], label) -> Sample:
    (out,) = engine.generate([prompt_ids], {k: v for k, v in sampling_params.items() if k != "n"})
    return Sample(prompt_ids=prompt_ids, response_ids=out["output_ids"], response_log_probs=out["output_log_probs"],
                  response_loss_mask=[1] * len(out["output_ids"]), finish_reason=out["finish_reason"], label=label,
                  weight_version=out["weight_version"])  # fmt: skip


def held_at_a_version(engine, prompt_ids: list[int], sampling_params: dict[str, Any], *, label) -> Sample:
    """One plain sample; one sampled at version $TIDAL_TEST_HOLD_AT creates the file $TIDAL_TEST_HELD and returns
    only once the file $TIDAL_TEST_RELEASE exists (at most 300 s): a test interrupts the run in that generation."""
    sample = _plain_sample(engine, prompt_ids, sampling_params, label)
    if sample.weight_version == os.environ["TIDAL_TEST_HOLD_AT"]:
        with open(os.environ["TIDAL_TEST_HELD"], "a"):
            pass
        deadline = time.monotonic() + 300
        while not os.path.exists(os.environ["TIDAL_TEST_RELEASE"]) and time.monotonic() < deadline:
            time.sleep(0.05)
    return sample


def reload_the_server_once(engine, prompt_ids: list[int], sampling_params: dict[str, Any], *, label) -> Sample:
    """One plain sample; the first call to see the server at version $TIDAL_TEST_RELOAD_AT then reloads the
    embedded model's initial weights into the server at $TIDAL_TEST_SERVER as version "0" (what a server restarted
    under the run serves), once: it creates the file $TIDAL_TEST_RELOADED."""
    from tidal.rollout import SGLangClient
    from tidal.train.embedded_model import ensure_embedded_model

    sample = _plain_sample(engine, prompt_ids, sampling_params, label)
    out = {"weight_version": sample.weight_version}
    if out["weight_version"] == os.environ["TIDAL_TEST_RELOAD_AT"]:
        try:
            os.close(os.open(os.environ["TIDAL_TEST_RELOADED"], os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:  # another sample's call reloaded it
            return sample
        server = SGLangClient(f"http://{os.environ['TIDAL_TEST_SERVER']}")
        server.update_weights_from_disk(ensure_embedded_model(), weight_version="0")
    return sample


def reward_by_length(sample: Sample) -> float:
    """The response's length / 10: a reward above 0 whatever the policy answers, so a critic has returns to fit."""
    return len(sample.response_ids) / 10


def reward_by_length_of_its_row(sample: Sample) -> float:
    """As reward_by_length, for a sample whose --metadata-key value names its own label (else it raises)."""
    if not isinstance(sample.metadata, dict) or sample.metadata.get("answer") != sample.label:
        raise ValueError(f"sample.metadata {sample.metadata!r} is not its row's (label {sample.label!r})")
    return len(sample.response_ids) / 10


def keep_listed_prompts(group) -> bool:
    """Keep a group whose prompt ids are listed in the JSON file $TIDAL_TEST_KEEP."""
    with open(os.environ["TIDAL_TEST_KEEP"]) as f:
        keep = {tuple(ids) for ids in json.load(f)}
    return tuple(int(t) for t in group[0].prompt_ids) in keep


_GROUPS_SEEN = itertools.count(1)


def keep_every_second_group(group) -> bool:
    """Keep the 2nd, 4th, ... group this process is asked about, drop the others: whatever the policy answers, a
    round of 2k groups keeps k, so a batch fills in a known number of rounds."""
    return next(_GROUPS_SEEN) % 2 == 0


# A chat template for the embedded (character-level) model: "role: text" lines, each assistant turn closed by EOS.
AGENT_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m.role + ': ' + (m.content or '') }}{% if m.role == 'assistant' %}{{ eos_token }}"
    "{% endif %}{{ '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
)


_EPISODES: defaultdict[str, itertools.count] = defaultdict(itertools.count)


async def arithmetic_agent(base_url: str, api_key: str, row: dict, *, graded: bool = False) -> float:
    """Two turns with the openai client: answer, get "check" feedback, answer again; reward 1 when right.

    Rows whose label ends in an even digit raise (a broken agent), so the run must replace their groups. Every
    other episode of a row rewrites its history before the second turn (the first answer folded into the user's
    message), so its second call extends nothing: a fork, and the episode gives two samples (of a group of two
    episodes, exactly one forks).
    """
    if int(row["label"][-1]) % 2 == 0:
        raise RuntimeError(f"broken agent on {row['prompt']}")
    rewrite = next(_EPISODES[row["prompt"]]) % 2 == 1
    return await steady_arithmetic_agent(base_url, api_key, row, rewrite=rewrite, graded=graded)


async def graded_arithmetic_agent(base_url: str, api_key: str, row: dict) -> float:
    """``arithmetic_agent`` with partial credit: 1 when right, else 0.1 per character of the answer (at most 0.5).

    A reward above 0 whatever the policy answers (unless it answers nothing), so a critic has returns to fit.
    """
    return await arithmetic_agent(base_url, api_key, row, graded=True)


async def steady_arithmetic_agent(
    base_url: str, api_key: str, row: dict, *, rewrite: bool = False, graded: bool = False
) -> float:
    """``arithmetic_agent`` on every row (none raises, none rewrites): each rollout's groups are its own prompts."""
    import openai

    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{"role": "user", "content": row["prompt"]}]
    first = await client.chat.completions.create(model="tidal", messages=messages)
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "check"},
    ]
    if rewrite:  # a compacted history: the rendered prompt no longer starts with the first call's tokens
        messages = [{"role": "user", "content": f"{row['prompt']} ({first.choices[0].message.content}) check"}]
    second = await client.chat.completions.create(model="tidal", messages=messages)
    answer = (second.choices[0].message.content or "").strip()
    if graded and answer != row["label"]:
        return min(len(answer), 5) / 10
    return float(answer == row["label"])


IN_FLIGHT = {"now": 0, "max": 0}
"""Episodes of ``counting_agent`` running at this moment, and the most seen at once (the test resets it)."""


async def counting_agent(base_url: str, api_key: str, row: dict) -> float:
    """One model call, then 0.2 s more of "tool time"; counts in IN_FLIGHT how many episodes run at once."""
    import asyncio

    import openai

    IN_FLIGHT["now"] += 1
    IN_FLIGHT["max"] = max(IN_FLIGHT["max"], IN_FLIGHT["now"])
    try:
        client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        await client.chat.completions.create(model="tidal", messages=[{"role": "user", "content": row["prompt"]}])
        await asyncio.sleep(0.2)  # every episode overlaps the others started with it
        return 0.0
    finally:
        IN_FLIGHT["now"] -= 1
