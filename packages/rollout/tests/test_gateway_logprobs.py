"""``logprobs`` / ``top_logprobs`` on the real SGLang server: the answer's values are the sampler's own, streamed or
not (the same values the session records for training)."""

from __future__ import annotations

import openai
import pytest
from tidal.rollout import SGLangClient
from tidal.rollout.gateway import Gateway

USER = [{"role": "user", "content": "add 1 and 2"}]


@pytest.mark.parametrize("stream", [False, True])
def test_logprobs_are_the_samplers_own(sglang_server, chat_tokenizer, stream) -> None:
    with Gateway(SGLangClient(sglang_server.url), chat_tokenizer, api_key="k", context_length=512) as gw:
        sid = gw.open_session()
        client = openai.OpenAI(base_url=gw.session_url(sid), api_key="k", max_retries=0)
        asked = {"max_tokens": 6, "logprobs": True, "top_logprobs": 3, "presence_penalty": 0.5}
        if stream:
            chunks = list(client.chat.completions.create(model="m", messages=USER, stream=True, **asked))
            assert all(c.choices[0].logprobs is None for c in chunks[:-1])  # all of them come with the finish
            logprobs = chunks[-1].choices[0].logprobs.content
        else:
            logprobs = client.chat.completions.create(model="m", messages=USER, **asked).choices[0].logprobs.content
        (trajectory,) = gw.close_session(sid).episode.trajectories
    n = len(logprobs)  # every sampled token but a stop token
    assert n == len(trajectory.response_ids) - (trajectory.response_ids[-1] in gw.stop_token_ids) and n > 0
    assert [t.logprob for t in logprobs] == pytest.approx(trajectory.log_probs[:n])  # what training gets
    assert [t.token for t in logprobs] == [chat_tokenizer.decode([i]) for i in trajectory.response_ids[:n]]
    for token in logprobs:  # SGLang's 3 most likely tokens at each position, best first
        alternatives = [a.logprob for a in token.top_logprobs]
        assert len(alternatives) == 3 and alternatives == sorted(alternatives, reverse=True)
        assert all(a <= 0 for a in alternatives) and len({a.token for a in token.top_logprobs}) == 3
