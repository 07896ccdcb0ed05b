"""The OpenAI chat-completions request, validated: every field is honoured or refused with a 400 naming it.

:func:`parse_request` turns a decoded JSON body into a :class:`ChatRequest` or raises :class:`~.chat.GatewayError`.
The fields the gateway honours are :data:`HONOURED`; :data:`HARMLESS` ones are accepted and change nothing that is
sampled (labels for the caller's own bookkeeping); any other field is refused by name, so that no option an agent
sets is silently ignored.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tidal.rollout.gateway.chat import GatewayError

ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
TOOL_CHOICES = frozenset({"none", "auto", "required"})
MAX_STOP_SEQUENCES = 4
MAX_TOP_LOGPROBS = 20
HONOURED = frozenset(
    {
        *("model", "messages", "tools", "tool_choice", "parallel_tool_calls", "response_format"),
        *("temperature", "top_p", "presence_penalty", "frequency_penalty", "logit_bias", "seed", "stop"),
        *("max_tokens", "max_completion_tokens", "n", "stream", "stream_options", "logprobs", "top_logprobs"),
    }
)
"""Fields that shape what is sampled or answered (``n`` only as 1)."""
HARMLESS = frozenset({"user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier"})
"""Fields accepted and ignored: labels and billing or storage hints of OpenAI's service, none of which changes
what a model samples (nothing is stored or billed here; the gateway records every call anyway)."""
_STREAM_OPTIONS = frozenset({"include_usage", "include_obfuscation"})
_RENAMED = {"functions": "tools", "function_call": "tool_choice"}


@dataclass(frozen=True, kw_only=True, slots=True)
class ChatRequest:
    """A validated ``POST /v1/chat/completions`` body."""

    model: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] = "auto"
    parallel_tool_calls: bool = True
    """False: at most one tool call per answer."""
    json_schema: str | None = None
    """The JSON schema the answer is constrained to (``response_format`` json_schema or json_object)."""
    temperature: float | None = None
    """None: the request gives none (the gateway's default applies, else 1.0)."""
    top_p: float | None = None
    """None: the request gives none (the gateway's default applies, else 1.0)."""
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    max_tokens: int | None = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    seed: int | None = None
    logit_bias: dict[str, float] | None = None
    logprobs: bool = False
    """Answer each sampled token's log-prob (``choices[].logprobs``)."""
    top_logprobs: int = 0
    """With ``logprobs``, the most likely alternatives to give at each position."""

    @property
    def parse_tools(self) -> bool:
        """Whether the answer's text is searched for tool calls (tools given and not ``tool_choice="none"``)."""
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def forces_tool_call(self) -> bool:
        """Whether ``tool_choice`` demands a call: "required" or a named function."""
        return self.parse_tools and self.tool_choice != "auto"


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


def _optional_number(body: Mapping[str, Any], name: str, low: float, high: float) -> float | None:
    return None if body.get(name) is None else _number(body, name, 0.0, low, high)


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
    if raw == "required" and not tools:
        raise _bad(
            "'tool_choice' \"required\" needs 'tools': give the functions the model must choose from", "tool_choice"
        )
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


def _response_format(raw: Any) -> str | None:
    """The JSON schema of ``response_format`` as SGLang's ``json_schema`` sampling parameter (None: free text)."""
    if raw is None:
        return None
    kind = raw.get("type") if isinstance(raw, Mapping) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return json.dumps({"type": "object"})
    spec = raw.get("json_schema") if isinstance(raw, Mapping) else None
    if kind == "json_schema" and isinstance(spec, Mapping) and isinstance(spec.get("schema", {}), Mapping):
        return json.dumps(spec.get("schema") or {})
    raise _bad(
        "'response_format' must be {'type': 'text'}, {'type': 'json_object'} or {'type': 'json_schema', "
        f"'json_schema': {{'name': ..., 'schema': <JSON schema object>}}}}, got {json.dumps(raw)[:200]}",
        "response_format",
    )


def _logprobs(body: Mapping[str, Any]) -> tuple[bool, int]:
    wanted = body.get("logprobs")
    if wanted is not None and not isinstance(wanted, bool):
        raise _bad(f"'logprobs' must be a boolean, got {type(wanted).__name__}", "logprobs", "invalid_type")
    top = _integer(body, "top_logprobs")
    if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
        raise _bad(f"'top_logprobs' must be between 0 and {MAX_TOP_LOGPROBS}, got {top}", "top_logprobs")
    if top and not wanted:
        raise _bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    return bool(wanted), top or 0


def _refuse_unknown(body: Mapping[str, Any]) -> None:
    unknown = sorted(set(body) - HONOURED - HARMLESS)
    if not unknown:
        return
    renamed = [f"'{old}' (use '{_RENAMED[old]}')" for old in unknown if old in _RENAMED]
    hint = f"; deprecated: {', '.join(renamed)}" if renamed else ""
    raise _bad(
        f"unsupported field(s) {', '.join(repr(k) for k in unknown)}: the gateway does not honour them, drop them"
        f"{hint} (it honours {sorted(HONOURED)}; ignores {sorted(HARMLESS)})",
        unknown[0],
        "unsupported_parameter",
    )


def _stream_options(body: Mapping[str, Any]) -> tuple[bool, bool]:
    stream = body.get("stream", False)
    options = body.get("stream_options") or {}
    if not isinstance(stream, bool) or not isinstance(options, Mapping):
        raise _bad("'stream' must be a boolean and 'stream_options' an object", "stream", "invalid_type")
    unknown = sorted(set(options) - _STREAM_OPTIONS)
    if unknown:
        raise _bad(f"unsupported 'stream_options' {unknown}: only {sorted(_STREAM_OPTIONS)}", "stream_options")
    return stream, bool(options.get("include_usage", False))


def parse_request(body: Any) -> ChatRequest:
    """Validate a decoded JSON body as the OpenAI API does.

    Raises:
        GatewayError: 400 naming the field (an unsupported one, wrong type, out of range, ``n`` other than 1, a
            malformed tool, a forced tool call together with a JSON ``response_format``).
    """
    if not isinstance(body, Mapping):
        raise _bad("the request body must be a JSON object", "body", "invalid_type")
    _refuse_unknown(body)
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
    stream, include_usage = _stream_options(body)
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise _bad("'parallel_tool_calls' must be a boolean", "parallel_tool_calls", "invalid_type")
    logprobs, top_logprobs = _logprobs(body)
    tools = _tools(body.get("tools"))
    request = ChatRequest(
        model=model,
        messages=_messages(body.get("messages")),
        tools=tools,
        tool_choice=_tool_choice(body.get("tool_choice"), tools),
        parallel_tool_calls=parallel,
        json_schema=_response_format(body.get("response_format")),
        temperature=None if body.get("temperature") is None else _number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=None if body.get("top_p") is None else max(_number(body, "top_p", 1.0, 0.0, 1.0), 1e-6),  # 0: top token
        presence_penalty=_optional_number(body, "presence_penalty", -2.0, 2.0),
        frequency_penalty=_optional_number(body, "frequency_penalty", -2.0, 2.0),
        max_tokens=max_tokens,
        stop=_stop(body.get("stop")),
        stream=stream,
        include_usage=include_usage,
        seed=_integer(body, "seed"),
        logit_bias=_logit_bias(body.get("logit_bias")),
        logprobs=logprobs,
        top_logprobs=top_logprobs,
    )
    if request.forces_tool_call and request.json_schema is not None:
        raise _bad(
            "'tool_choice' forcing a tool call and a JSON 'response_format' cannot both be enforced: drop one",
            "response_format",
        )
    return request
