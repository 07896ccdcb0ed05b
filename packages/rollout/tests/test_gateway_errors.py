"""Bad input gets the OpenAI API's 4xx JSON error, never a 500 or a dead gateway; the session loses nothing."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest
from tidal.rollout import SGLangClient
from tidal.rollout.gateway import Gateway, GatewayError, parse_request

USER = [{"role": "user", "content": "add 1 and 2"}]
GOOD = {"model": "m", "messages": USER, "max_tokens": 2, "temperature": 0.0}
BAD_TOOL = {"type": "function", "function": {"name": "no spaces allowed", "parameters": {}}}

# (body, the field the error names); each is refused before anything reaches the engine.
BAD_BODIES = [
    ([1, 2], "body"),
    ({"messages": USER}, "model"),
    ({**GOOD, "messages": []}, "messages"),
    ({**GOOD, "messages": "hello"}, "messages"),
    ({**GOOD, "messages": [{"role": "wizard", "content": "x"}]}, "messages[0]"),
    ({**GOOD, "messages": [{"role": "user", "content": 5}]}, "messages[0]"),
    ({**GOOD, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "messages[0]"),
    ({**GOOD, "temperature": "hot"}, "temperature"),
    ({**GOOD, "temperature": 3}, "temperature"),
    ({**GOOD, "top_p": 1.5}, "top_p"),
    ({**GOOD, "max_tokens": "ten"}, "max_tokens"),
    ({**GOOD, "max_tokens": 0}, "max_tokens"),
    ({**GOOD, "max_completion_tokens": 2.5}, "max_completion_tokens"),
    ({**GOOD, "n": 2}, "n"),
    ({**GOOD, "n": True}, "n"),
    ({**GOOD, "stop": 7}, "stop"),
    ({**GOOD, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({**GOOD, "stream": "yes"}, "stream"),
    ({**GOOD, "tools": {"name": "add"}}, "tools"),
    ({**GOOD, "tools": [BAD_TOOL]}, "tools[0]"),
    ({**GOOD, "tools": [{"type": "function", "function": {"name": "f", "parameters": "{oops"}}]}, "tools[0]"),
    ({**GOOD, "tool_choice": "sometimes"}, "tool_choice"),
    ({**GOOD, "tool_choice": {"type": "function", "function": {"name": "absent"}}}, "tool_choice"),
    ({**GOOD, "logit_bias": {"x": 1}}, "logit_bias"),
    ({**GOOD, "logit_bias": {"3": 500}}, "logit_bias"),
    (
        {
            **GOOD,
            "messages": [
                {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}
            ],
        },
        "messages[0].tool_calls[0]",
    ),
    # Fields the gateway would not honour are refused by name, never silently ignored.
    ({**GOOD, "frobnicate": 1}, "frobnicate"),
    ({**GOOD, "functions": [{"name": "f"}]}, "functions"),
    ({**GOOD, "modalities": ["text", "audio"]}, "modalities"),
    ({**GOOD, "stream": True, "stream_options": {"chunk_size": 3}}, "stream_options"),
    ({**GOOD, "presence_penalty": 2.5}, "presence_penalty"),
    ({**GOOD, "frequency_penalty": "high"}, "frequency_penalty"),
    ({**GOOD, "logprobs": "yes"}, "logprobs"),
    ({**GOOD, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({**GOOD, "top_logprobs": 2}, "top_logprobs"),  # without logprobs: true
    ({**GOOD, "parallel_tool_calls": "no"}, "parallel_tool_calls"),
    ({**GOOD, "response_format": {"type": "xml"}}, "response_format"),
    ({**GOOD, "response_format": {"type": "json_schema", "json_schema": {"schema": "{"}}}, "response_format"),
    ({**GOOD, "tool_choice": "required"}, "tool_choice"),  # no tools to choose from
    (
        {
            **GOOD,
            "tools": [{"type": "function", "function": {"name": "add", "parameters": {}}}],
            "tool_choice": "required",
            "response_format": {"type": "json_object"},
        },
        "response_format",
    ),
]


@pytest.mark.parametrize(("body", "param"), BAD_BODIES)
def test_bad_bodies_are_refused_naming_the_field(body, param) -> None:
    with pytest.raises(GatewayError) as refused:
        parse_request(body)
    assert refused.value.status == 400 and refused.value.param == param
    assert refused.value.body()["error"]["message"]


def test_harmless_fields_are_accepted_and_honoured_ones_kept() -> None:
    request = parse_request(
        {
            **GOOD,
            **{"user": "u1", "metadata": {"run": "a"}, "store": False, "service_tier": "auto", "n": 1},
            **{"presence_penalty": 0.5, "frequency_penalty": -0.25, "logprobs": True, "top_logprobs": 3},
            "parallel_tool_calls": False,
            "response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": {"type": "array"}}},
        }
    )
    assert (request.presence_penalty, request.frequency_penalty) == (0.5, -0.25)
    assert (request.logprobs, request.top_logprobs, request.parallel_tool_calls) == (True, 3, False)
    assert request.json_schema == '{"type": "array"}'
    assert parse_request({**GOOD, "response_format": {"type": "json_object"}}).json_schema == '{"type": "object"}'
    assert parse_request({**GOOD, "response_format": {"type": "text"}}).json_schema is None


@pytest.fixture
def gateway(sglang_server, chat_tokenizer) -> Iterator[Gateway]:
    # No context_length: the engine's own limit (512 positions) is what an over-long prompt meets.
    with Gateway(SGLangClient(sglang_server.url), chat_tokenizer, api_key="k") as gw:
        yield gw


def _post(gw: Gateway, sid: str, content: bytes | dict, key: str = "k") -> httpx.Response:
    url = f"{gw.session_url(sid)}/chat/completions"
    headers = {"Authorization": f"Bearer {key}"}
    if isinstance(content, bytes):
        return httpx.post(url, content=content, headers={**headers, "Content-Type": "application/json"})
    return httpx.post(url, json=content, headers=headers, timeout=60)


def test_every_bad_request_is_a_4xx_json_error_and_the_gateway_serves_on(gateway: Gateway) -> None:
    sid = gateway.open_session()
    cases = [
        (_post(gateway, sid, b'{"model": "m", "messages": ['), 400, "invalid_json"),
        (_post(gateway, sid, b"\xff\xfe not utf-8"), 400, "invalid_json"),
        (_post(gateway, sid, {**GOOD, "n": 3}), 400, "invalid_value"),
        (_post(gateway, sid, {**GOOD, "temperature": "hot"}), 400, "invalid_type"),
        (_post(gateway, sid, {**GOOD, "tools": [BAD_TOOL]}), 400, "invalid_value"),
        (_post(gateway, "no-such-session", GOOD), 404, "not_found"),
        (httpx.get(f"{gateway.session_url(sid)}/nowhere", headers={"Authorization": "Bearer k"}), 404, None),
    ]
    for response, status, code in cases:
        assert response.status_code == status, response.text
        error = response.json()["error"]
        assert error["code"] == code and error["message"] and error["type"] == "invalid_request_error"
    assert gateway.sessions[sid].calls == 0 and not gateway.sessions[sid].episode.trajectories
    assert _post(gateway, sid, GOOD).status_code == 200  # still serving, and the session still works


def test_a_context_longer_than_the_engine_allows_is_a_400_with_the_limit(gateway: Gateway, chat_tokenizer) -> None:
    sid = gateway.open_session()
    client = openai.OpenAI(base_url=gateway.session_url(sid), api_key="k", max_retries=0)
    long = [{"role": "user", "content": "1 2 " * 400}]
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="m", messages=long, max_tokens=4)
    assert "512" in str(refused.value) and refused.value.status_code == 400
    with pytest.raises(openai.BadRequestError) as refused:  # streamed: refused before the stream begins
        client.chat.completions.create(model="m", messages=long, max_tokens=4, stream=True)
    assert "512" in str(refused.value) and refused.value.code == "engine_refused"
    # With the limit known to the gateway, it refuses by itself, naming the limit and the prompt's size.
    gateway.context_length = 512
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="m", messages=long, max_tokens=4)
    assert refused.value.code == "context_length_exceeded" and "512" in str(refused.value)
    # A prompt that fits with room for fewer tokens than asked is answered, cut by length at the limit.
    fits = [{"role": "user", "content": "1 " * 200}]
    answer = client.chat.completions.create(model="m", messages=fits, max_tokens=400, temperature=0.0)
    assert answer.usage.total_tokens <= 512
    assert answer.choices[0].finish_reason in ("length", "stop")
    assert gateway.sessions[sid].calls == 1
