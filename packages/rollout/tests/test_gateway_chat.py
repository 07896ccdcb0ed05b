"""The gateway's answers as plain data (no server): tool-call parsing, and bodies the openai client's types accept."""

from __future__ import annotations

import json

import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from tidal.rollout.gateway import Completion, parse_request, parse_tool_calls


def test_qwen_tool_calls_are_parsed_out_of_the_text() -> None:
    text = 'let me add <tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    text += '<tool_call>{"name": "now", "arguments": "{}"}</tool_call>'
    content, calls = parse_tool_calls(text)
    assert content == "let me add"
    assert [c["function"] for c in calls] == [
        {"name": "add", "arguments": json.dumps({"a": 1, "b": 2})},
        {"name": "now", "arguments": "{}"},
    ]
    assert len({c["id"] for c in calls}) == 2 and all(c["type"] == "function" for c in calls)


@pytest.mark.parametrize(
    "text",
    [
        "no call here",
        "<tool_call>{not json}</tool_call>",
        '<tool_call>{"arguments": {}}</tool_call>',  # no name
        '<tool_call>["add"]</tool_call>',
    ],
)
def test_text_without_a_well_formed_call_stays_content(text: str) -> None:
    assert parse_tool_calls(text) == (text, [])


def test_tools_are_parsed_only_when_given_and_not_refused() -> None:
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    base = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    assert not parse_request(base).parse_tools
    assert parse_request({**base, "tools": tools}).parse_tools
    assert not parse_request({**base, "tools": tools, "tool_choice": "none"}).parse_tools
    named = {"type": "function", "function": {"name": "add"}}
    assert parse_request({**base, "tools": tools, "tool_choice": named}).tool_choice == named
    request = parse_request({**base, "max_tokens": 5, "max_completion_tokens": 7, "stop": "x", "top_p": 0})
    assert (request.max_tokens, request.stop, request.top_p > 0) == (7, ["x"], True)


def test_answers_and_chunks_are_what_the_openai_client_reads() -> None:
    _, calls = parse_tool_calls('<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>')
    done = Completion(
        model="m", content="sum", tool_calls=calls, finish_reason="tool_calls", prompt_tokens=5, completion_tokens=3
    )
    answer = ChatCompletion.model_validate(done.body())
    assert answer.choices[0].message.tool_calls[0].function.arguments == '{"a": 1}'
    assert answer.usage.total_tokens == 8
    chunks = [ChatCompletionChunk.model_validate(c) for c in done.chunks(include_usage=True)]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "sum"
    (call,) = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
    assert (call.index, call.function.name) == (0, "add")
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    assert chunks[-1].usage.completion_tokens == 3 and not chunks[-1].choices
