"""The OpenAI chat-completions answer, as plain data: the error, the answer bodies, the stream's chunks.

Nothing here talks to a server: :class:`GatewayError` is an OpenAI-style 4xx answer, and :class:`Completion`,
:func:`chunk` and :func:`sse` build what the gateway sends back (the request is read in ``request``).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any


class GatewayError(Exception):
    """A request the gateway refuses, answered as the OpenAI API answers: ``{"error": {...}}`` with a 4xx status."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
    ) -> None:
        """``status`` is the HTTP status, ``param`` the offending field, ``code`` a machine-readable reason."""
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict[str, Any]:
        """The JSON answer."""
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True, kw_only=True, slots=True)
class Completion:
    """One answer, ready to send: the message's parts, why it ended, and the token counts."""

    model: str
    content: str | None
    tool_calls: list[dict[str, Any]]
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    logprobs: list[dict[str, Any]] | None = None
    """OpenAI ``logprobs.content``: each answered token's sampler log-prob (and top alternatives); None: not asked."""
    id: str = field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex}")
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def usage(self) -> dict[str, int]:
        """OpenAI ``usage``."""
        total = self.prompt_tokens + self.completion_tokens
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens, "total_tokens": total}

    @property
    def choice_logprobs(self) -> dict[str, Any] | None:
        """A choice's ``logprobs`` object (None when not asked for)."""
        return None if self.logprobs is None else {"content": self.logprobs, "refusal": None}

    def body(self) -> dict[str, Any]:
        """The non-streaming answer (``object: chat.completion``)."""
        message: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.tool_calls:
            message["tool_calls"] = self.tool_calls
        return {
            "id": self.id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": [
                {"index": 0, "message": message, "finish_reason": self.finish_reason, "logprobs": self.choice_logprobs}
            ],
            "usage": self.usage,
        }

    def end_chunks(self, *, include_usage: bool, content: str | None) -> Iterator[dict[str, Any]]:
        """The last ``chat.completion.chunk`` objects of a stream of this answer.

        ``content`` (what of the content is not sent yet), each tool call, the finish reason (with every token's
        log-probs, when asked for), and the usage when ``include_usage``.
        """
        if content:
            yield chunk(self, {"content": content})
        for index, call in enumerate(self.tool_calls):
            yield chunk(self, {"tool_calls": [{"index": index, **call}]})
        last = chunk(self, {}, self.finish_reason)
        last["choices"][0]["logprobs"] = self.choice_logprobs
        yield last
        if include_usage:
            yield {**chunk(self, {}), "choices": [], "usage": self.usage}


def chunk(answer: Any, delta: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
    """One ``chat.completion.chunk`` of ``answer`` (anything with ``id``, ``created`` and ``model``)."""
    return {
        "id": answer.id,
        "object": "chat.completion.chunk",
        "created": answer.created,
        "model": answer.model,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}],
    }


def sse(data: dict[str, Any] | str) -> str:
    """One server-sent event (``data: [DONE]`` for the string ``"[DONE]"``)."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


def token_logprobs(
    token_text: Callable[[int], str], out: dict[str, Any], n: int, top_logprobs: int
) -> list[dict[str, Any]]:
    """OpenAI ``logprobs.content`` of the first ``n`` tokens of an engine answer ``out``.

    Each token's sampler log-prob and, up to ``top_logprobs``, SGLang's most likely alternatives
    (``output_top_logprobs``).
    """

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        token = token_text(token_id)
        return {"token": token, "logprob": float(logprob), "bytes": list(token.encode())}

    tops = out.get("output_top_logprobs") or [[]] * n
    return [
        {**entry(token_id, logprob), "top_logprobs": [entry(int(t[1]), t[0]) for t in (top or [])[:top_logprobs]]}
        for token_id, logprob, top in zip(out["output_ids"][:n], out["output_log_probs"][:n], tops, strict=False)
    ]
