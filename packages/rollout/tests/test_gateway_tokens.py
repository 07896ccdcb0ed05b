"""Token drift: what the gateway trains on is exactly what was sent and sampled, whatever the chat template does.

The chat tokenizer (conftest.py) has a Qwen3-style template and merged tokens ("an", "na", "aa", "nn"); the first
turn is biased towards single "a"/"n" tokens, so re-tokenizing its text would merge them: a re-rendering
implementation would train on tokens the model never sampled, and these tests would see it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import openai
import pytest
from tidal.rollout import SGLangClient
from tidal.rollout.gateway import Episode, Gateway


class Recording:
    def __init__(self, client: SGLangClient) -> None:
        self.client, self.url, self.calls = client, client.url, []

    def generate(self, input_ids, sampling_params):
        out = self.client.generate(input_ids, sampling_params)
        self.calls.append((list(input_ids[0]), out[0]))
        return out


@pytest.fixture
def recording(sglang_server) -> Recording:
    return Recording(SGLangClient(sglang_server.url))


@contextlib.contextmanager
def _gateway(recording: Recording, tokenizer) -> Iterator[Gateway]:
    with Gateway(recording, tokenizer, api_key="k", context_length=512) as gw:
        yield gw


def _episode(gw: Gateway, tokenizer, turns: int = 3) -> tuple[list[dict], object]:
    """A plain multi-turn chat: the first answer biased to single "a"/"n" tokens, then greedy turns."""
    sid = gw.open_session()
    client = openai.OpenAI(base_url=gw.session_url(sid), api_key="k", max_retries=0)
    a, n = tokenizer.convert_tokens_to_ids(["a", "n"])
    messages: list[dict] = [{"role": "system", "content": "be terse"}, {"role": "user", "content": "add 1 and 2"}]
    for turn in range(turns):
        bias = {str(a): 100, str(n): 100} if turn == 0 else None
        answer = client.chat.completions.create(
            model="m", messages=messages, max_tokens=6, temperature=0.0, logit_bias=bias
        )
        messages += [{"role": "assistant", "content": answer.choices[0].message.content}]
        messages += [{"role": "tool" if turn % 2 else "user", "content": "3"}]
    return messages[:-1], gw.close_session(sid)


def test_plain_multi_turn_is_one_sample_of_exactly_the_sent_and_sampled_tokens(recording, chat_tokenizer) -> None:
    with _gateway(recording, chat_tokenizer) as gw:
        messages, session = _episode(gw, chat_tokenizer)
    (sample,) = session.episode.samples(reward=0.5)
    assert session.episode.forks == 0 and len(recording.calls) == 3
    tokens, mask, log_probs = sample.tokens, sample.loss_mask, [0.0] * len(sample.prompt_ids)
    log_probs += list(sample.response_log_probs)
    sampled_positions = set()
    for sent, out in recording.calls:
        # Each call sent exactly the tokens held so far (prompt, earlier samples, template/user suffixes) ...
        assert tokens[: len(sent)] == sent
        # ... and what it sampled follows them, trained on (mask 1) with the engine's own log-probs.
        span = range(len(sent), len(sent) + len(out["output_ids"]))
        assert [tokens[i] for i in span] == out["output_ids"]
        assert [log_probs[i] for i in span] == out["output_log_probs"]
        assert all(mask[i] == 1 for i in span)
        sampled_positions.update(span)
    last_sent, last_out = recording.calls[-1]
    assert tokens == last_sent + last_out["output_ids"]
    # Everything not sampled (template, system, user and tool tokens) has loss mask 0 and log-prob 0.
    others = [i for i in range(len(tokens)) if i not in sampled_positions]
    assert all(mask[i] == 0 and log_probs[i] == 0.0 for i in others)
    assert sum(mask) == sum(len(out["output_ids"]) for _, out in recording.calls)
    assert session.episode.metrics() | {} == {
        "turns": 3.0,
        "forks": 0.0,
        "samples": 1.0,
        "sampled_tokens": float(sum(mask)),
        "tokens": float(len(tokens)),
    }

    # Re-rendering the same conversation gives the same text but other tokens: the biased first answer's single
    # "a"/"n" tokens merge when re-tokenized. An implementation that re-tokenized would train on those.
    first_answer = recording.calls[0][1]["output_ids"]
    assert len(first_answer) == 6 and set(first_answer) <= set(chat_tokenizer.convert_tokens_to_ids(["a", "n"]))
    text = chat_tokenizer.apply_chat_template(messages, tokenize=False)
    retokenized = chat_tokenizer(text, add_special_tokens=False)["input_ids"]
    assert text.startswith(chat_tokenizer.decode(tokens, skip_special_tokens=False))
    assert retokenized[: len(tokens)] != tokens
    assert len(retokenized) < len(tokens) + len(chat_tokenizer("\n")["input_ids"])  # merges made it shorter


def test_a_template_that_strips_earlier_thinking_forks(recording, stripping_chat_tokenizer) -> None:
    tokenizer = stripping_chat_tokenizer
    with _gateway(recording, tokenizer) as gw:
        _, session = _episode(gw, tokenizer, turns=2)
    episode = session.episode
    # The second call's prompt does not extend the first's tokens (its "<think>\n" is gone from the history), so
    # it starts a new sample of the same episode rather than training on a history the model never saw.
    assert episode.forks == 1
    first, second = episode.samples(reward=1.0)
    (sent1, out1), (sent2, out2) = recording.calls
    assert first.tokens == sent1 + out1["output_ids"] and first.loss_mask == [0] * len(sent1) + [1] * len(
        out1["output_ids"]
    )
    assert second.tokens == sent2 + out2["output_ids"] and list(second.prompt_ids) == sent2
    assert sent2[: len(first.tokens)] != first.tokens
    assert (
        "<think>" in tokenizer.decode(sent1)
        and "<think>" not in tokenizer.decode(sent2)[: len(tokenizer.decode(sent1))]
    )
    assert first.reward == second.reward == 1.0


def test_episode_bookkeeping_without_a_server(chat_tokenizer) -> None:
    tokenize = lambda text: chat_tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    episode = Episode(tokenize)
    first = episode.prepare("<|im_start|>user\nadd<|im_end|>\n<|im_start|>assistant\n")
    assert first.base is None and first.prompt_ids == tokenize(first.rendered)
    a, n, im_end = chat_tokenizer.convert_tokens_to_ids(["a", "n", "<|im_end|>"])
    held = episode.record(
        first,
        output_ids=[a, n, im_end],
        log_probs=[-1.0, -2.0, -0.5],
        output_text="an<|im_end|>",
        finish_reason="stop",
        weight_version="3",
    )
    # A call extending the held text sends the held ids (the sampled single "a", "n" kept) plus the suffix only.
    rendered = held.text + "\n<|im_start|>user\n1<|im_end|>\n<|im_start|>assistant\n"
    second = episode.prepare(rendered)
    assert second.base is held and second.prompt_ids == [*held.ids, *tokenize(rendered[len(held.text) :])]
    assert second.prompt_ids != tokenize(rendered)  # re-tokenizing would have merged "an"
    # A concurrent call of the same history grows it first: the later one becomes its own sample (a fork).
    concurrent = episode.prepare(rendered)
    episode.record(
        second, output_ids=[a], log_probs=[-0.1], output_text="a", finish_reason="length", weight_version="4"
    )
    forked = episode.record(
        concurrent, output_ids=[n], log_probs=[-0.2], output_text="n", finish_reason="length", weight_version="4"
    )
    assert forked is not held and forked.prompt_ids == concurrent.prompt_ids and episode.forks == 1
    one, two = episode.samples(reward=2.0)
    assert one.response_loss_mask == [1, 1, 1] + [0] * len(second.suffix_ids) + [1]
    assert one.response_weight_versions == ["3"] * 3 + [None] * len(second.suffix_ids) + ["4"]
    assert one.response_log_probs[-1] == -0.1 and one.finish_reason == "length" and one.weight_version == "4"
    assert two.response_ids == [n] and two.reward == 2.0
    # A rewritten history extends neither: a fork from its own tokens.
    rewritten = episode.prepare("<|im_start|>user\nsummary<|im_end|>\n<|im_start|>assistant\n")
    assert rewritten.base is None
