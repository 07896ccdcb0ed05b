"""The embedded agent task: addition with a hidden operand, which only a second turn reveals.

An episode of row ``{"prompt": "07+45=", "label": "052"}`` runs through the OpenAI chat API (:func:`run`, the
agent ``--recipe embedded-agent`` trains with, written with the ``openai`` client as any agent would be):

1. user: ``07+?=`` (the second operand is hidden); the model should ask for it by answering ``?``;
2. user: ``45`` (the operand); the model answers the sum, ``052``.

The reward is 1 when the final answer equals the label, else 0: a model that answers at once cannot know the
operand, so an episode succeeds only through its second turn. The embedded chat model is warm-started on such
episodes (:func:`warm_start_records`) until it solves about a third of them; RL then has the arithmetic to sharpen.
"""

from __future__ import annotations

import functools
import ssl
from typing import Any

ASK = "?"
"""The model's first answer: it asks for the hidden operand."""
MAX_TOKENS = 8
"""Most tokens the agent lets the model answer with, per turn (a three-digit sum and the end of turn fit)."""


def operands(row: dict[str, Any]) -> tuple[str, str]:
    """The two operands of a ``"07+45="`` prompt, as written."""
    a, b = row["prompt"].rstrip("=").split("+")
    return a, b


def first_turn(row: dict[str, Any]) -> list[dict[str, str]]:
    """The episode's opening message: the sum with its second operand hidden."""
    a, _ = operands(row)
    return [{"role": "user", "content": f"{a}+{ASK}="}]


def second_turn(row: dict[str, Any], reply: str) -> list[dict[str, str]]:
    """The conversation after the model's first ``reply``, with the hidden operand as the user's answer."""
    _, b = operands(row)
    return [*first_turn(row), {"role": "assistant", "content": reply}, {"role": "user", "content": b}]


def warm_start_records(tokenizer, records: list[dict[str, Any]]) -> tuple[list[dict], list[dict]]:
    """Supervised records of the chat warm start (one whole episode each), and the probe.

    Each row gives ``{"turns": [[context, "?"], [context, label]]}``: the episode as ``tokenizer``'s chat template
    renders it, cut after each generation prompt (the answers are what the model learns to sample). The probe holds
    the second turns as ``{"prompt": context, "label": answer}`` (greedy accuracy on them is the warm start's
    stopping rule).
    """

    def context(messages: list[dict[str, str]]) -> str:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    episodes, probe = [], []
    for r in records:
        first = context(first_turn(r))
        second = context(second_turn(r, ASK))
        done = first + ASK + tokenizer.eos_token  # the first answer ends with the model's end of turn
        if not second.startswith(done):
            raise ValueError(f"the chat template renders earlier turns differently later: {first!r} / {second!r}")
        episodes.append({"turns": [[first, ASK], [second[len(done) :], r["label"]]]})
        probe.append({"prompt": second, "label": r["label"]})
    return episodes, probe


async def run(base_url: str, api_key: str, row: dict[str, Any]) -> float:
    """One episode through the OpenAI chat API at ``base_url``; 1.0 when the final answer is the label."""
    import openai

    # A client per episode, as a one-off agent would make it; the TLS context is built once and shared (building
    # one, which every new client does by default, costs more CPU than the episode's calls).
    http = openai.DefaultAsyncHttpxClient(verify=_tls_context())
    async with openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, http_client=http) as client:
        messages = first_turn(row)
        first = await client.chat.completions.create(
            model="tidal", messages=messages, max_tokens=MAX_TOKENS, temperature=1.0
        )
        reply = first.choices[0].message.content or ""
        if reply.strip() != ASK:
            return 0.0  # it answered without the operand
        second = await client.chat.completions.create(
            model="tidal", messages=second_turn(row, reply), max_tokens=MAX_TOKENS, temperature=1.0
        )
        answer = (second.choices[0].message.content or "").strip()
    return float(answer == row["label"])


@functools.cache
def _tls_context() -> ssl.SSLContext:
    return ssl.create_default_context()
