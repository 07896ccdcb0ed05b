"""The gateway's answers as plain data (no server): tool-call parsing, bodies the openai client's types accept, and
what of an answer in the making is streamed as content."""

from __future__ import annotations

import json

import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from tidal.rollout.gateway import Completion, ToolCallFormat, parse_request
from tidal.rollout.gateway.chat import chunk
from tidal.rollout.gateway.streaming import ContentStream

HERMES = ToolCallFormat("hermes")
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
TOOLS += [{"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}}]


def parse_tool_calls(text: str):
    """What the gateway answers for ``text`` written by a Hermes/Qwen-format model given TOOLS."""
    return HERMES.parse(
        text, parse_request({"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS})
    )


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
        '<tool_call>{"name": "absent", "arguments": {}}</tool_call>',  # not one of the tools
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
    sent = [chunk(done, {"role": "assistant", "content": ""}), *done.end_chunks(include_usage=True, content="sum")]
    chunks = [ChatCompletionChunk.model_validate(c) for c in sent]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "sum"
    (call,) = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
    assert (call.index, call.function.name) == (0, "add")
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    assert chunks[-1].usage.completion_tokens == 3 and not chunks[-1].choices


def _streamed(stream: ContentStream, ids: list[int]) -> list[str]:
    """The deltas ``stream`` sends as ``ids`` arrive one by one."""
    return [delta for n in range(1, len(ids) + 1) if (delta := stream.update(ids[:n]))]


def _request(**fields) -> object:
    return parse_request({"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields})


def test_a_tool_call_is_never_streamed_as_content(chat_tokenizer) -> None:
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    text = 'sum is 3 <tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call><|im_end|>'
    ids = chat_tokenizer(text, add_special_tokens=False)["input_ids"]
    im_end = chat_tokenizer.convert_tokens_to_ids("<|im_end|>")
    stream = ContentStream(
        chat_tokenizer.decode, stop_token_ids=[im_end], request=_request(tools=tools), tool_format=HERMES
    )
    deltas = _streamed(stream, ids)
    assert len(deltas) > 1 and "".join(deltas) == stream.sent == "sum is 3"  # the space before the call waits
    content, calls = parse_tool_calls(text.removesuffix("<|im_end|>"))
    assert calls and stream.rest(content) == ""
    # A "<" that turns out not to open a call is sent once it cannot; leading whitespace waits for the end.
    for written, sent in [("1 <t2 3", "1 <t2 3"), ("1 <tool_c", "1"), ("  3 a", "")]:
        chars = ContentStream(
            lambda ids, t=written: "".join(t[i] for i in ids),
            stop_token_ids=[],
            request=_request(tools=tools),
            tool_format=HERMES,
        )
        assert "".join(_streamed(chars, list(range(len(written))))) == sent  # one character a token
        assert sent + chars.rest(written) == written  # no tool call: the rest follows at the end
    # Without tools, all of it streams.
    stream = ContentStream(chat_tokenizer.decode, stop_token_ids=[im_end], request=_request())
    assert "".join(_streamed(stream, ids)) == text.removesuffix("<|im_end|>")


def test_a_stop_string_and_its_beginning_are_not_streamed(chat_tokenizer) -> None:
    ids = chat_tokenizer("sum is 3 ba more", add_special_tokens=False)["input_ids"]
    stream = ContentStream(chat_tokenizer.decode, stop_token_ids=[], request=_request(stop=["bad", " ba"]))
    held = [stream.safe_text(ids[:n]) for n in range(1, len(ids) + 1)]
    assert held[len("sum is 3 b") - 1] == "sum is 3"  # " b" may begin " ba"
    assert "".join(_streamed(stream, ids)) == "sum is 3"  # cut at the first stop string, as the answer is


def test_a_character_split_over_byte_tokens_is_sent_whole() -> None:
    """Byte-level tokens: a prefix that ends inside a character decodes to U+FFFD, which waits for the rest."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tokenizer = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(sorted(alphabet))}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    text = "é€ ok 🙂"
    ids = tokenizer.encode(text).ids
    assert len(ids) == len(text.encode())  # one token per byte
    assert "\ufffd" in tokenizer.decode(ids[:1])
    stream = ContentStream(tokenizer.decode, stop_token_ids=[], request=_request())
    deltas = _streamed(stream, ids)
    assert "".join(deltas) == text and all("\ufffd" not in d for d in deltas)
    assert deltas[:3] == ["é", "€", " "]
