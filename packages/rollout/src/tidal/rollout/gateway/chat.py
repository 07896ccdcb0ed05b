"""The OpenAI chat-completions request and answer, as plain data: validation, tool-call parsing, answer bodies.

Nothing here talks to a server: :func:`parse_request` turns a JSON body into a :class:`ChatRequest` or raises
:class:`GatewayError` (an OpenAI-style 4xx answer), and :class:`Completion`, :func:`chunk` and :func:`sse` build
what the gateway sends back.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
TOOL_CHOICES = frozenset({"none", "auto", "required"})
MAX_STOP_SEQUENCES = 4
_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


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
class ChatRequest:
    """A validated ``POST /v1/chat/completions`` body (fields the gateway does not use are ignored)."""

    model: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] = "auto"
    temperature: float | None = None
    """None: the request gives none (the gateway's default applies, else 1.0)."""
    top_p: float | None = None
    """None: the request gives none (the gateway's default applies, else 1.0)."""
    max_tokens: int | None = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    seed: int | None = None
    logit_bias: dict[str, float] | None = None

    @property
    def parse_tools(self) -> bool:
        """Whether the answer's text is searched for tool calls (tools given and not ``tool_choice="none"``)."""
        return bool(self.tools) and self.tool_choice != "none"


def _bad(message: str, param: str, code: str = "invalid_value") -> GatewayError:
    return GatewayError(400, message, param=param, code=code)


def _number(body: Mapping[str, Any], name: str, default: float, low: float, high: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _bad(f"'{name}' must be a number, got {type(value).__name__}", name, "invalid_type")
    if not low <= value <= high:
        raise _bad(f"'{name}' must be between {low} and {high}, got {value}", name)
    return float(value)


def _integer(body: Mapping[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(f"'{name}' must be an integer, got {type(value).__name__}", name, "invalid_type")
    return value


def _content_text(content: Any, where: str) -> str | None:
    """A message's ``content``: a string, None, or a list of ``{"type": "text", "text": ...}`` parts (joined)."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not (isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise _bad(f"{where}.content: only text parts are supported, got {str(part)[:80]}", where)
            parts.append(part["text"])
        return "".join(parts)
    raise _bad(f"{where}.content must be a string or a list of text parts", where, "invalid_type")


def _messages(raw: Any) -> list[dict[str, Any]]:
    if not isinstance(raw, list) or not raw:
        raise _bad("'messages' must be a non-empty array of message objects", "messages", "invalid_type")
    out = []
    for i, message in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(message, Mapping):
            raise _bad(f"{where} must be an object, got {type(message).__name__}", where, "invalid_type")
        role = message.get("role")
        if role not in ROLES:
            raise _bad(f"{where}.role must be one of {sorted(ROLES)}, got {role!r}", where)
        clean = dict(message)
        clean["content"] = _content_text(message.get("content"), where)
        calls = message.get("tool_calls")
        if calls is not None:
            if role != "assistant" or not isinstance(calls, list):
                raise _bad(f"{where}.tool_calls must be an array on an assistant message", where, "invalid_type")
            clean["tool_calls"] = [_history_tool_call(call, f"{where}.tool_calls[{j}]") for j, call in enumerate(calls)]
        out.append(clean)
    return out


def _history_tool_call(call: Any, where: str) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
        raise _bad(f"{where} must be {{'type': 'function', 'function': {{'name': ..., 'arguments': ...}}}}", where)
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, str):  # chat templates render arguments as a mapping
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as e:
            raise _bad(f"{where}.function.arguments is not valid JSON: {e}", where) from e
    return {**call, "function": {"name": function["name"], "arguments": arguments}}


def _tools(raw: Any) -> list[dict[str, Any]] | None:
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise _bad("'tools' must be an array of tool objects", "tools", "invalid_type")
    for i, tool in enumerate(raw):
        function = tool.get("function") if isinstance(tool, Mapping) else None
        ok = (
            isinstance(tool, Mapping)
            and tool.get("type") == "function"
            and isinstance(function, Mapping)
            and isinstance(function.get("name"), str)
            and re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", function["name"]) is not None
            and isinstance(function.get("parameters", {}), Mapping)
        )
        if not ok:
            raise _bad(
                f"tools[{i}] must be {{'type': 'function', 'function': {{'name': <1-64 of a-z A-Z 0-9 _ . ->, "
                f"'parameters': <JSON schema object>}}}}, got {json.dumps(tool)[:200]}",
                f"tools[{i}]",
            )
    return list(raw)


def _tool_choice(raw: Any, tools: list[dict[str, Any]] | None) -> str | dict[str, Any]:
    if raw is None:
        return "auto"
    if isinstance(raw, str) and raw in TOOL_CHOICES:
        return raw
    name = raw.get("function", {}).get("name") if isinstance(raw, Mapping) else None
    if not isinstance(name, str):
        raise _bad(f"'tool_choice' must be one of {sorted(TOOL_CHOICES)} or a named function", "tool_choice")
    if name not in {t["function"]["name"] for t in tools or []}:
        raise _bad(f"'tool_choice' names function {name!r}, which is not in 'tools'", "tool_choice")
    return dict(raw)


def _stop(raw: Any) -> list[str]:
    stops = [raw] if isinstance(raw, str) else raw
    if stops is None:
        return []
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise _bad("'stop' must be a non-empty string or an array of them", "stop", "invalid_type")
    if len(stops) > MAX_STOP_SEQUENCES:
        raise _bad(f"'stop' holds at most {MAX_STOP_SEQUENCES} sequences, got {len(stops)}", "stop")
    return stops


def _logit_bias(raw: Any) -> dict[str, float] | None:
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        raise _bad("'logit_bias' must map token ids to numbers", "logit_bias", "invalid_type")
    for key, value in raw.items():
        if not str(key).isdigit() or isinstance(value, bool) or not isinstance(value, int | float):
            raise _bad(f"'logit_bias' must map token ids to numbers, got {key!r}: {value!r}", "logit_bias")
        if not -100 <= value <= 100:
            raise _bad(f"'logit_bias' values must be between -100 and 100, got {value}", "logit_bias")
    return {str(k): float(v) for k, v in raw.items()}


def parse_request(body: Any) -> ChatRequest:
    """Validate a decoded JSON body as the OpenAI API does.

    Raises:
        GatewayError: 400 naming the field (wrong type, out of range, ``n`` other than 1, a malformed tool).
    """
    if not isinstance(body, Mapping):
        raise _bad("the request body must be a JSON object", "body", "invalid_type")
    model = body.get("model")
    if not isinstance(model, str):
        raise _bad("'model' must be a string", "model", "invalid_type")
    n = _integer(body, "n")
    if n not in (None, 1):
        raise _bad(f"only n=1 is supported (one episode is one sample stream), got n={n}", "n")
    max_tokens = _integer(body, "max_completion_tokens")
    if max_tokens is None:
        max_tokens = _integer(body, "max_tokens")
    if max_tokens is not None and max_tokens < 1:
        raise _bad(f"'max_tokens' must be >= 1, got {max_tokens}", "max_tokens")
    stream = body.get("stream", False)
    options = body.get("stream_options") or {}
    if not isinstance(stream, bool) or not isinstance(options, Mapping):
        raise _bad("'stream' must be a boolean and 'stream_options' an object", "stream", "invalid_type")
    seed = _integer(body, "seed")
    tools = _tools(body.get("tools"))
    return ChatRequest(
        model=model,
        messages=_messages(body.get("messages")),
        tools=tools,
        tool_choice=_tool_choice(body.get("tool_choice"), tools),
        temperature=None if body.get("temperature") is None else _number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=None if body.get("top_p") is None else max(_number(body, "top_p", 1.0, 0.0, 1.0), 1e-6),  # 0: top token
        max_tokens=max_tokens,
        stop=_stop(body.get("stop")),
        stream=stream,
        include_usage=bool(options.get("include_usage", False)),
        seed=seed,
        logit_bias=_logit_bias(body.get("logit_bias")),
    )


def parse_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """Split Qwen-style ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks out of ``text``.

    Returns:
        ``(content, tool_calls)``: the text outside the blocks (None when only whitespace) and OpenAI tool calls
        (``arguments`` as a JSON string). A block that is not such JSON leaves the whole text as content and no
        tool calls, as a model that wrote a broken call gets no call made.
    """
    calls = []
    for block in _TOOL_CALL.findall(text):
        try:
            call = json.loads(block)
        except json.JSONDecodeError:
            return text, []
        if not (isinstance(call, dict) and isinstance(call.get("name"), str)):
            return text, []
        arguments = call.get("arguments", {})
        calls.append(
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {
                    "name": call["name"],
                    "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments),
                },
            }
        )
    if not calls:
        return text, []
    rest = _TOOL_CALL.sub("", text).strip()
    return rest or None, calls


@dataclass(frozen=True, kw_only=True, slots=True)
class Completion:
    """One answer, ready to send: the message's parts, why it ended, and the token counts."""

    model: str
    content: str | None
    tool_calls: list[dict[str, Any]]
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    id: str = field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex}")
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def usage(self) -> dict[str, int]:
        """OpenAI ``usage``."""
        total = self.prompt_tokens + self.completion_tokens
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens, "total_tokens": total}

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
            "choices": [{"index": 0, "message": message, "finish_reason": self.finish_reason, "logprobs": None}],
            "usage": self.usage,
        }

    def end_chunks(self, *, include_usage: bool, content: str | None) -> Iterator[dict[str, Any]]:
        """The last ``chat.completion.chunk`` objects of a stream of this answer.

        ``content`` (what of the content is not sent yet), each tool call, the finish reason, and the usage when
        ``include_usage``.
        """
        if content:
            yield chunk(self, {"content": content})
        for index, call in enumerate(self.tool_calls):
            yield chunk(self, {"tool_calls": [{"index": index, **call}]})
        yield chunk(self, {}, self.finish_reason)
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
