"""Every request field the gateway accepts reaches SGLang (sampler, grammar, log-probs) or its answer; tool calls are
read in each model family's own format by SGLang's parsers. No server: what would be sent, and what is answered."""

from __future__ import annotations

import json

import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from tidal.rollout import SGLangClient
from tidal.rollout.gateway import Gateway, GatewayError, parse_request
from tidal.rollout.gateway.streaming import ContentStream

USER = [{"role": "user", "content": "add 1 and 2"}]
ADD = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
NOW = {"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}}


def _gateway(tokenizer, **kwargs) -> Gateway:
    """A gateway that is never started: its engine client points nowhere and is never called."""
    return Gateway(SGLangClient("http://127.0.0.1:9"), tokenizer, api_key="k", context_length=512, **kwargs)


def _params(gw: Gateway, **fields) -> dict:
    return gw.sampling_params(parse_request({"model": "m", "messages": USER, **fields}), 10)


def test_penalties_json_schema_and_top_logprobs_reach_sglang(family_tokenizers) -> None:
    gw = _gateway(family_tokenizers["qwen3"])
    schema = {"type": "object", "properties": {"sum": {"type": "integer"}}}
    params = _params(
        gw,
        presence_penalty=0.5,
        frequency_penalty=-1.0,
        logprobs=True,
        top_logprobs=4,
        response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": schema}},
    )
    assert (params["presence_penalty"], params["frequency_penalty"]) == (0.5, -1.0)
    assert json.loads(params["json_schema"]) == schema and params["top_logprobs_num"] == 4
    assert json.loads(_params(gw, response_format={"type": "json_object"})["json_schema"]) == {"type": "object"}
    plain = _params(gw)
    assert not {"presence_penalty", "frequency_penalty", "json_schema", "top_logprobs_num"} & set(plain)


def test_a_forced_tool_call_is_constrained_by_sglangs_grammar(family_tokenizers) -> None:
    gw = _gateway(family_tokenizers["qwen3"])
    assert gw.tool_format.name == "hermes"  # from the template's <tool_call>
    assert not {"structural_tag", "json_schema", "stop"} & set(_params(gw, tools=[ADD, NOW]))  # auto: free
    required = json.loads(_params(gw, tools=[ADD, NOW], tool_choice="required")["structural_tag"])
    assert required["at_least_one"] and {s["begin"].split('"')[3] for s in required["structures"]} == {"add", "now"}
    named = {"type": "function", "function": {"name": "now"}}
    forced = json.loads(_params(gw, tools=[ADD, NOW], tool_choice=named)["structural_tag"])
    assert [s["begin"].split('"')[3] for s in forced["structures"]] == ["now"]
    # One call at most: the answer stops at the end of the first call (kept apart from the request's stops).
    single = _params(gw, tools=[ADD], parallel_tool_calls=False, stop=["zz"])
    assert single["stop"] == ["zz", "</tool_call>"]
    assert "stop" not in _params(gw, tools=[ADD], tool_choice="none", parallel_tool_calls=False)
    llama = _gateway(family_tokenizers["llama31"])  # Llama 3.1 calls have no end marker to stop at
    with pytest.raises(GatewayError) as refused:
        _params(llama, tools=[ADD], parallel_tool_calls=False)
    assert refused.value.status == 400 and refused.value.param == "parallel_tool_calls"


def test_tools_are_refused_when_the_models_tool_call_format_is_unknown(family_tokenizers) -> None:
    import copy

    tokenizer = copy.deepcopy(family_tokenizers["qwen3"])
    tokenizer.chat_template = tokenizer.chat_template.replace("<tool_call>", "<call>")  # no known marker
    gw = _gateway(tokenizer)
    with pytest.raises(GatewayError) as refused:
        _params(gw, tools=[ADD])
    assert refused.value.param == "tools" and "--tool-call-parser" in refused.value.message
    _params(gw, tools=[ADD], tool_choice="none")  # no calls to read: answered
    assert _gateway(tokenizer, tool_call_parser="qwen25").tool_format.name == "qwen25"
    with pytest.raises(ValueError, match="--tool-call-parser must be one of"):
        _gateway(tokenizer, tool_call_parser="no-such-parser")


# (family, what the model wrote, the call's arguments, the content)
WRITTEN = [
    (
        "qwen3",
        'sum: <tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>',
        {"a": 1, "b": 2},
        "sum:",
    ),
    ("qwen3", '<tool_call>\n{"name": "add", "parameters": {"a": 1}}\n</tool_call>', {"a": 1}, None),
    ("llama31", '{"name": "add", "parameters": {"a": 1, "b": 2}}', {"a": 1, "b": 2}, None),
    ("llama31", '<|python_tag|>{"name": "add", "parameters": {"a": 5}}', {"a": 5}, None),
    (
        "qwen3_coder",
        "ok\n<tool_call>\n<function=add>\n<parameter=a>\n1\n</parameter>\n<parameter=b>\n2\n</parameter>\n"
        "</function>\n</tool_call>",
        {"a": 1, "b": 2},
        "ok",
    ),
]


@pytest.mark.parametrize(("family", "written", "arguments", "content"), WRITTEN)
def test_tool_calls_are_read_in_each_familys_own_format(family_tokenizers, family, written, arguments, content):
    tokenizer = family_tokenizers[family]
    gw = _gateway(tokenizer)
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {
        "a": {"type": "integer"}, "b": {"type": "integer"}}}}}]  # fmt: skip
    request = parse_request({"model": "m", "messages": USER, "tools": tools})
    sid = gw.open_session()
    turn = gw.sessions[sid].episode.prepare(gw.render(request))
    ids = tokenizer(written + tokenizer.eos_token, add_special_tokens=False)["input_ids"]
    out = {"output_ids": ids, "output_log_probs": [0.0] * len(ids), "finish_reason": "stop"}
    answer = ChatCompletion.model_validate(gw._answer(gw.sessions[sid], request, turn, out).body())
    (call,) = answer.choices[0].message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("add", arguments)
    assert answer.choices[0].message.content == content and answer.choices[0].finish_reason == "tool_calls"


def test_glm45_xml_calls_are_read_when_named() -> None:
    from tidal.rollout.gateway import ToolCallFormat

    request = parse_request({"model": "m", "messages": USER, "tools": [ADD]})
    text = "<tool_call>add\n<arg_key>a</arg_key>\n<arg_value>1</arg_value>\n</tool_call>"
    content, (call,) = ToolCallFormat("glm45").parse(text, request)
    assert content is None and call["function"] == {"name": "add", "arguments": json.dumps({"a": 1})}
    assert ToolCallFormat("glm45").parse("<tool_call>nope\n</tool_call>", request) == (
        "<tool_call>nope\n</tool_call>",
        [],
    )  # a call the parser cannot read stays content


@pytest.mark.parametrize(
    ("family", "written", "streamed"),
    [
        ("llama31", '{"name": "add", "parameters": {}}', ""),  # a bare JSON answer is a call: nothing streams
        ("llama31", "sum is {3}", "sum is {3}"),  # JSON later in an answer is content
        ("llama31", "3 <|python_tag|>{}", "3"),
        ("qwen3_coder", "ok <tool_call>\n<function=add>", "ok"),
        ("qwen3_coder", "ok <tool_c", "ok"),  # may still begin a call: waits
    ],
)
def test_a_stream_holds_back_from_the_formats_own_call_marker(family_tokenizers, family, written, streamed) -> None:
    tokenizer = family_tokenizers[family]
    gw = _gateway(tokenizer)
    request = parse_request({"model": "m", "messages": USER, "tools": [ADD]})
    stream = ContentStream(tokenizer.decode, stop_token_ids=[], request=request, tool_format=gw.tool_format)
    ids = tokenizer(written, add_special_tokens=False)["input_ids"]
    sent = "".join(stream.update(ids[:n]) for n in range(1, len(ids) + 1))
    assert sent == streamed


def test_logprobs_are_the_samplers_own(family_tokenizers) -> None:
    tokenizer = family_tokenizers["qwen3"]
    gw = _gateway(tokenizer)
    request = parse_request({"model": "m", "messages": USER, "logprobs": True, "top_logprobs": 2})
    sid = gw.open_session()
    turn = gw.sessions[sid].episode.prepare(gw.render(request))
    ids = [*tokenizer("ab", add_special_tokens=False)["input_ids"], tokenizer.eos_token_id]
    out = {
        "output_ids": ids,
        "output_log_probs": [-0.5, -1.5, -0.1],
        "output_top_logprobs": [[(-0.5, ids[0]), (-2.0, ids[1]), (-3.0, 7)], [(-0.2, ids[0]), (-1.5, ids[1])], []],
        "finish_reason": "stop",
    }
    done = gw._answer(gw.sessions[sid], request, turn, out)
    answer = ChatCompletion.model_validate(done.body())
    tokens = answer.choices[0].logprobs.content  # the stop token is not part of the answer
    assert [(t.token, t.logprob) for t in tokens] == [("a", -0.5), ("b", -1.5)]
    assert [[(a.token, a.logprob) for a in t.top_logprobs] for t in tokens] == [
        [("a", -0.5), ("b", -2.0)],
        [("a", -0.2), ("b", -1.5)],
    ]
    last = [ChatCompletionChunk.model_validate(c) for c in done.end_chunks(include_usage=False, content=None)][-1]
    assert [t.logprob for t in last.choices[0].logprobs.content] == [-0.5, -1.5]  # streamed: with the finish
    plain = parse_request({"model": "m", "messages": USER})
    assert gw._answer(gw.sessions[sid], plain, turn, out).body()["choices"][0]["logprobs"] is None
