"""The agent gateway against the real SGLang server, through the official openai client (sync, async, streaming)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
from tidal.rollout import SGLangClient
from tidal.rollout.gateway import Gateway

USER = [{"role": "user", "content": "add 1 and 2"}]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "sum",
            "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}},
        },
    }
]


class Recording:
    """The real client of the session's server, keeping every ``/generate`` call's ids and answer."""

    def __init__(self, client: SGLangClient) -> None:
        self.client, self.url, self.calls = client, client.url, []

    def generate(self, input_ids, sampling_params):
        sent = time.monotonic()
        out = self.client.generate(input_ids, sampling_params)
        call = {"input_ids": [list(i) for i in input_ids], "params": dict(sampling_params), "out": out, "sent": sent}
        self.calls.append(call)
        return out

    def generate_stream(self, input_ids, sampling_params):
        """The client's stream, passed on; the call is kept once its answer is in (``chunks``: those before)."""
        sent, chunks = time.monotonic(), 0
        for out in self.client.generate_stream(input_ids, sampling_params):
            if out["finish_reason"] is None:
                chunks += 1
            else:
                call = {"input_ids": [list(input_ids)], "params": dict(sampling_params), "out": [out], "sent": sent}
                self.calls.append({**call, "chunks": chunks})
            yield out


@pytest.fixture
def recording(sglang_server) -> Recording:
    return Recording(SGLangClient(sglang_server.url))


@pytest.fixture
def gateway(recording: Recording, chat_tokenizer) -> Iterator[Gateway]:
    with Gateway(recording, chat_tokenizer, api_key="job-key", context_length=512) as gw:
        yield gw


def test_sync_client_answers_and_records_exact_tokens(gateway: Gateway, recording: Recording) -> None:
    sid = gateway.open_session()
    client = openai.OpenAI(base_url=gateway.session_url(sid), api_key="job-key", max_retries=0)
    assert [m.id for m in client.models.list()] == ["tidal"]
    answer = client.chat.completions.create(model="tidal", messages=USER, max_tokens=6, temperature=0.0)
    choice = answer.choices[0]
    (call,) = recording.calls
    out = call["out"][0]
    assert choice.finish_reason in ("stop", "length")
    assert answer.usage.prompt_tokens == len(call["input_ids"][0])
    assert answer.usage.completion_tokens == len(out["output_ids"]) <= 6
    assert call["params"]["max_new_tokens"] == 6 and call["params"]["temperature"] == 0.0
    text = gateway.tokenizer.apply_chat_template(USER, add_generation_prompt=True, tokenize=False)
    assert call["input_ids"][0] == gateway.tokenizer(text, add_special_tokens=False)["input_ids"]
    (sample,) = gateway.close_session(sid).episode.samples(reward=1.0)
    assert sample.prompt_ids == call["input_ids"][0]
    assert list(sample.response_ids) == out["output_ids"]
    assert list(sample.response_log_probs) == out["output_log_probs"]
    assert list(sample.response_loss_mask) == [1] * len(out["output_ids"])
    assert sample.reward == 1.0 and sample.weight_version == out["weight_version"]
    stops = gateway.stop_token_ids
    visible = out["output_ids"][:-1] if out["output_ids"][-1] in stops else out["output_ids"]
    assert choice.message.content == gateway.tokenizer.decode(visible, skip_special_tokens=False)


def test_async_and_streaming_clients(gateway: Gateway, recording: Recording) -> None:
    sid = gateway.open_session()

    async def run() -> tuple[str | None, str, list]:
        client = openai.AsyncOpenAI(base_url=gateway.session_url(sid), api_key="job-key", max_retries=0)
        plain = await client.chat.completions.create(model="m", messages=USER, max_tokens=5, temperature=0.0)
        stream = await client.chat.completions.create(
            model="m",
            messages=USER,
            max_tokens=5,
            temperature=0.0,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [chunk async for chunk in stream]
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        return plain.choices[0].message.content, text, chunks

    content, streamed, chunks = asyncio.run(run())
    assert streamed == (content or "")  # greedy: the same answer either way
    assert chunks[-1].usage.completion_tokens == len(recording.calls[1]["out"][0]["output_ids"])
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
    # Same messages twice: the second call does not extend the first's tokens, so it is a second sample (a fork).
    episode = gateway.close_session(sid).episode
    assert len(episode.samples()) == 2 and episode.forks == 1

    sid = gateway.open_session()
    client = openai.OpenAI(base_url=gateway.session_url(sid), api_key="job-key", max_retries=0)
    with client.chat.completions.create(model="m", messages=USER, max_tokens=4, temperature=0.0, stream=True) as s:
        sync_text = "".join(c.choices[0].delta.content or "" for c in s)
    assert sync_text == (content or "")[: len(sync_text)] and len(recording.calls) == 3


def test_tools_reach_the_template_and_sampling_options_reach_sglang(gateway: Gateway, recording: Recording) -> None:
    sid = gateway.open_session()
    client = openai.OpenAI(base_url=gateway.session_url(sid), api_key="job-key", max_retries=0)
    answer = client.chat.completions.create(
        model="m",
        messages=USER,
        tools=TOOLS,
        tool_choice="auto",
        max_completion_tokens=3,
        temperature=0.7,
        top_p=0.9,
        stop=["zz"],
        seed=3,
        n=1,
    )
    params = recording.calls[0]["params"]
    assert (params["max_new_tokens"], params["temperature"], params["top_p"]) == (3, 0.7, 0.9)
    assert params["stop"] == ["zz"] and params["sampling_seed"] == 3
    prompt = gateway.tokenizer.decode(recording.calls[0]["input_ids"][0])
    assert '"name": "add"' in prompt  # the tools were rendered into the system turn
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_a_sampling_override_wins_over_the_request(recording: Recording, chat_tokenizer, caplog) -> None:
    # what evaluation's gateway does: every call greedy, whatever temperature the agent asks for; and the run's
    # stop strings and stop tokens beside the call's own
    forced = {"temperature": 0.0, "top_p": 1.0}
    run = {"stop": ["zz"], "extra_stop_token_ids": [7]}
    with (
        caplog.at_level(logging.WARNING, logger="tidal.rollout.gateway.server"),
        Gateway(recording, chat_tokenizer, api_key="k", sampling_override=forced, **run) as gw,
    ):
        client = openai.OpenAI(base_url=gw.session_url(gw.open_session()), api_key="k", max_retries=0)
        answers = [
            client.chat.completions.create(model="m", messages=USER, max_tokens=4, temperature=1.5, top_p=0.5)
            for _ in range(2)
        ]
        client.chat.completions.create(model="m", messages=USER, max_tokens=4, stop="yy")
    sent = [call["params"] for call in recording.calls]
    assert [(p["temperature"], p["top_p"], p["max_new_tokens"]) for p in sent] == [(0.0, 1.0, 4)] * 3
    assert [p["stop"] for p in sent] == [["zz"], ["zz"], ["yy", "zz"]]
    assert all(7 in p["stop_token_ids"] and chat_tokenizer.eos_token_id in p["stop_token_ids"] for p in sent)
    assert caplog.text.count("an agent call asked for {'temperature': 1.5, 'top_p': 0.5}") == 1  # logged once
    assert answers[0].choices[0].message.content == answers[1].choices[0].message.content  # greedy: the same


def test_a_tool_call_the_model_wrote_is_parsed(gateway: Gateway, chat_tokenizer) -> None:
    """An answer whose sampled text holds a ``<tool_call>`` comes back as ``message.tool_calls``."""
    from tidal.rollout.gateway import parse_request

    sid = gateway.open_session()
    request = parse_request({"model": "m", "messages": USER, "tools": TOOLS})
    turn = gateway.sessions[sid].episode.prepare(gateway.render(request))
    written = chat_tokenizer('<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call><|im_end|>')["input_ids"]
    out = {"output_ids": written, "output_log_probs": [0.0] * len(written), "finish_reason": "stop"}
    answer = gateway._answer(gateway.sessions[sid], request, turn, out).body()
    (call,) = answer["choices"][0]["message"]["tool_calls"]
    assert call["function"] == {"name": "add", "arguments": json.dumps({"a": 1})}
    assert answer["choices"][0]["finish_reason"] == "tool_calls" and answer["choices"][0]["message"]["content"] is None


def test_the_job_key_is_required(gateway: Gateway) -> None:
    sid = gateway.open_session()
    url = gateway.session_url(sid)
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "job-key"}):
        response = httpx.post(f"{url}/chat/completions", json={"model": "m", "messages": USER}, headers=headers)
        assert response.status_code == 401, headers
        assert response.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(f"{url}/models", headers=headers).status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url, api_key="wrong", max_retries=0).models.list()
    assert gateway.sessions[sid].calls == 0


def test_a_call_cut_by_an_abort_resumes_into_one_answer(sglang_server, slowed_generation, gateway, recording) -> None:
    """An abort (what a weight update does to requests in flight) does not reach the agent: the call resumes."""
    sid = gateway.open_session()
    client = openai.OpenAI(base_url=gateway.session_url(sid), api_key="job-key", max_retries=0)
    no_stop = {str(t): -100 for t in gateway.stop_token_ids}

    def call():
        return client.chat.completions.create(
            model="m", messages=USER, max_tokens=120, temperature=0.0, logit_bias=no_stop
        )

    with slowed_generation(sglang_server, call) as (thread, box):
        sglang_server.abort()
        thread.join(timeout=120)
    answer = box["result"]
    assert answer.choices[0].finish_reason == "length" and answer.usage.completion_tokens == 120
    (first, second) = recording.calls
    cut = first["out"][0]
    assert cut["finish_reason"] == "abort" and 0 < len(cut["output_ids"]) < 120
    assert second["input_ids"][0] == first["input_ids"][0] + cut["output_ids"]
    assert second["params"]["max_new_tokens"] == 120 - len(cut["output_ids"])
    session = gateway.close_session(sid)
    (sample,) = session.episode.samples()
    assert list(sample.response_ids) == cut["output_ids"] + second["out"][0]["output_ids"]
    assert list(sample.response_loss_mask) == [1] * 120 and session.resumes == 1
    assert sample.response_weight_versions == [cut["weight_version"]] * len(cut["output_ids"]) + [
        second["out"][0]["weight_version"]
    ] * len(second["out"][0]["output_ids"])


def test_a_call_cut_by_a_weight_update_resumes_under_the_new_weights(
    sglang_server, tiny_model_dir, slowed_generation, recording, chat_tokenizer
) -> None:
    """--max-staleness: an update aborts the agent's call, which waits for it and resumes under the new weights.

    The agent gets one answer; the stored sample's tokens say which weights sampled each (old first, then new).
    Without the gate the cut call is sent again at once and races the update (here it would be sent before the
    update is in: the last assertion).
    """
    from tidal.rollout import InterruptibleUpdates

    sglang_server.update_weights_from_disk(tiny_model_dir, weight_version="old")
    gate = InterruptibleUpdates(sglang_server, timeout_s=60)  # begin() aborts, as each engine's worker does
    with Gateway(recording, chat_tokenizer, api_key="job-key", context_length=512, update_gate=gate) as gw:
        sid = gw.open_session()
        client = openai.OpenAI(base_url=gw.session_url(sid), api_key="job-key", max_retries=0)
        no_stop = {str(t): -100 for t in gw.stop_token_ids}

        def call():
            return client.chat.completions.create(
                model="m", messages=USER, max_tokens=120, temperature=0.0, logit_bias=no_stop
            )

        with slowed_generation(sglang_server, call) as (thread, box):
            gate.begin()
            try:  # the update itself (after the trainer's export: the gateway has seen the abort by then)
                deadline = time.monotonic() + 30
                while gw.sessions[sid].resumes == 0 and time.monotonic() < deadline:
                    time.sleep(0.01)
                sglang_server.call("/slow_down", {"forward_sleep_time": None})
                sglang_server.update_weights_from_disk(tiny_model_dir, weight_version="new")
                updated = time.monotonic()
            finally:
                gate.end()
            thread.join(timeout=120)
        assert not thread.is_alive() and "error" not in box, box.get("error")
        session = gw.close_session(sid)
    answer = box["result"]
    assert answer.choices[0].finish_reason == "length" and answer.usage.completion_tokens == 120
    (first, second) = recording.calls
    cut = first["out"][0]
    k = len(cut["output_ids"])
    assert cut["finish_reason"] == "abort" and 0 < k < 120 and session.resumes == 1
    assert second["input_ids"][0] == first["input_ids"][0] + cut["output_ids"]
    (sample,) = session.episode.samples()
    assert list(sample.response_ids) == cut["output_ids"] + second["out"][0]["output_ids"]
    assert sample.response_weight_versions == ["old"] * k + ["new"] * (120 - k)
    assert sample.weight_version == "new" and list(sample.response_loss_mask) == [1] * 120
    assert answer.choices[0].message.content == chat_tokenizer.decode(sample.response_ids, skip_special_tokens=False)
    assert second["sent"] > updated  # the resumed request waited for the update


def test_a_call_whose_update_never_ends_answers_503(sglang_server, slowed_generation, recording, chat_tokenizer):
    """A cut call waits for the update at most the gate's timeout, then answers 503 (the client may retry)."""
    from tidal.rollout import InterruptibleUpdates

    gate = InterruptibleUpdates(sglang_server, timeout_s=1)
    with Gateway(recording, chat_tokenizer, api_key="job-key", context_length=512, update_gate=gate) as gw:
        sid = gw.open_session()
        client = openai.OpenAI(base_url=gw.session_url(sid), api_key="job-key", max_retries=0)
        no_stop = {str(t): -100 for t in gw.stop_token_ids}

        def call():
            return client.chat.completions.create(
                model="m", messages=USER, max_tokens=120, temperature=0.0, logit_bias=no_stop
            )

        with slowed_generation(sglang_server, call) as (thread, box):
            gate.begin()  # and no end: the update hangs
            thread.join(timeout=60)
        gate.end()
        assert not thread.is_alive()
        error = box["error"]
        assert isinstance(error, openai.APIStatusError) and error.status_code == 503
        assert "a weight update did not finish in 1 s" in str(error)
        assert len(recording.calls) == 1 and gw.sessions[sid].calls == 0  # nothing resent, nothing recorded


@contextlib.contextmanager
def _slow(server, forward_s: float) -> Iterator[None]:
    """Every forward of ``server`` takes ``forward_s`` more (an answer then spans time that chunks arrive in)."""
    server.call("/slow_down", {"forward_sleep_time": forward_s})
    try:
        yield
    finally:
        server.call("/slow_down", {"forward_sleep_time": None})


def _content(chunks) -> list[str]:
    return [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]


def test_a_streamed_answer_arrives_token_by_token_and_records_what_a_plain_call_does(
    sglang_server, gateway: Gateway, recording: Recording
) -> None:
    """Greedy, the same call three ways (plain, streamed sync, streamed async): one answer, one recorded sample."""
    ask = {"model": "m", "messages": USER, "max_tokens": 24, "temperature": 0.0}
    ask["logit_bias"] = {str(t): -100 for t in gateway.stop_token_ids}

    def session() -> tuple[str, openai.OpenAI, openai.AsyncOpenAI]:
        sglang_server.flush_cache()  # each call computes its prompt afresh, so the numbers can be compared exactly
        sid = gateway.open_session()
        url = gateway.session_url(sid)
        return sid, openai.OpenAI(base_url=url, api_key="job-key"), openai.AsyncOpenAI(base_url=url, api_key="job-key")

    sid, client, _ = session()
    plain = client.chat.completions.create(**ask).choices[0].message.content
    plain_session = gateway.close_session(sid)
    (plain_sample,) = plain_session.episode.samples()
    assert len(plain_sample.response_ids) == 24 and len(recording.calls) == 1

    sid, client, _ = session()
    chunks, engine_calls_at_first = [], None
    with _slow(sglang_server, 0.02), client.chat.completions.create(**ask, stream=True) as stream:
        for c in stream:
            if _content([c]) and engine_calls_at_first is None:
                engine_calls_at_first = len(recording.calls)
            chunks.append(c)
    assert engine_calls_at_first == 1  # the first content came while the engine was still generating
    assert len(_content(chunks)) > 1 and "".join(_content(chunks)) == plain
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[-1].choices[0].finish_reason == "length"
    assert len({c.id for c in chunks}) == 1 and recording.calls[1]["chunks"] > 1
    streamed = gateway.close_session(sid)
    assert streamed.episode.samples() == [plain_sample]
    assert streamed.episode.trajectories[0].text == plain_session.episode.trajectories[0].text

    sid, _, async_client = session()

    async def run() -> tuple[list, int | None]:
        got, at_first = [], None
        stream = await async_client.chat.completions.create(**ask, stream=True, stream_options={"include_usage": True})
        async for c in stream:
            if _content([c]) and at_first is None:
                at_first = len(recording.calls)
            got.append(c)
        return got, at_first

    with _slow(sglang_server, 0.02):
        chunks, engine_calls_at_first = asyncio.run(run())
    assert engine_calls_at_first == 2 and len(_content(chunks)) > 1 and "".join(_content(chunks)) == plain
    assert chunks[-1].usage.completion_tokens == 24
    assert gateway.close_session(sid).episode.samples() == [plain_sample]


def test_a_client_that_leaves_mid_stream_leaves_its_session_whole(sglang_server, gateway, recording) -> None:
    """The generation goes on without the client and is recorded whole; the session and the gateway serve on."""
    sid = gateway.open_session()
    no_stop = {str(t): -100 for t in gateway.stop_token_ids}
    body = {"model": "m", "messages": USER, "max_tokens": 40, "temperature": 0.0, "logit_bias": no_stop}
    url, auth = f"{gateway.session_url(sid)}/chat/completions", {"Authorization": "Bearer job-key"}
    with _slow(sglang_server, 0.02):
        with httpx.stream("POST", url, json={**body, "stream": True}, headers=auth, timeout=60) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("data: ") and json.loads(line[6:])["choices"][0]["delta"].get("content"):
                    break  # the first content: leave
        assert not recording.calls  # it left while the engine was generating
        deadline = time.monotonic() + 60
        while gateway.sessions[sid].calls == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
    (sample,) = gateway.sessions[sid].episode.samples()
    assert list(sample.response_ids) == recording.calls[0]["out"][0]["output_ids"] and len(sample.response_ids) == 40
    client = openai.OpenAI(base_url=gateway.session_url(sid), api_key="job-key", max_retries=0)
    with client.chat.completions.create(**body, stream=True) as stream:
        assert "".join(_content(stream)) == gateway.tokenizer.decode(sample.response_ids, skip_special_tokens=False)
    assert gateway.sessions[sid].calls == 2


def test_a_streamed_call_cut_by_an_abort_resumes_into_one_continuous_answer(
    sglang_server, slowed_generation, gateway, recording
) -> None:
    sid = gateway.open_session()
    client = openai.OpenAI(base_url=gateway.session_url(sid), api_key="job-key", max_retries=0)
    no_stop = {str(t): -100 for t in gateway.stop_token_ids}

    def call():
        ask = {"model": "m", "messages": USER, "max_tokens": 120, "temperature": 0.0, "logit_bias": no_stop}
        with client.chat.completions.create(**ask, stream=True, stream_options={"include_usage": True}) as stream:
            return list(stream)

    with slowed_generation(sglang_server, call) as (thread, box):
        sglang_server.abort()
        thread.join(timeout=120)
    chunks = box["result"]
    (first, second) = recording.calls
    cut = first["out"][0]
    assert cut["finish_reason"] == "abort" and 0 < len(cut["output_ids"]) < 120 and first["chunks"] > 0
    assert second["input_ids"][0] == first["input_ids"][0] + cut["output_ids"]
    session = gateway.close_session(sid)
    (sample,) = session.episode.samples()
    assert list(sample.response_ids) == cut["output_ids"] + second["out"][0]["output_ids"] and session.resumes == 1
    assert list(sample.response_log_probs) == cut["output_log_probs"] + second["out"][0]["output_log_probs"]
    text = "".join(_content(chunks))
    assert len(_content(chunks)) > 1 and text == gateway.tokenizer.decode(
        sample.response_ids, skip_special_tokens=False
    )
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 120
