"""The model writes a tool call, the agent answers it with a tool result, and the next call extends the same
trajectory: on the real SGLang server, under chat templates shaped like Qwen3's, Llama 3.1's and Qwen3-Coder's.

The tiny random model is steered by SGLang's own constrained decoding: a ``regex`` sampling parameter (forced on
the gateway's calls) spells the family's call. The server knows its own tokenizer (words of the test corpus), not
the test's chat tokenizer, so the regex is written in the server's words: each chat token id stands for the
server's word of the same id.
"""

from __future__ import annotations

import json
import re

import openai
import pytest
from tidal.rollout import SGLangClient
from tidal.rollout.gateway import Gateway

ADD = {
    "type": "function",
    "function": {"name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}},
}
# What each family's model writes to call add(a=1), exactly as its template renders the call back.
CALLS = {
    "qwen3": ("hermes", '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'),
    "llama31": ("llama3", '{"name": "add", "parameters": {"a": 1}}'),
    "qwen3_coder": (
        "qwen3_coder",
        "\n<tool_call>\n<function=add>\n<parameter=a>\n1\n</parameter>\n</function>\n</tool_call>",
    ),
}
# Server vocabulary ids whose word begins with another word ("is", "answer", "four", "plus"): a regex spelling one
# would let the model start the shorter word and dead-end, so the chat tokenizers put fillers there.
_PREFIXED_IDS = frozenset({3, 17, 23, 34})
_FILLERS = "QXZWVJKYUHBCDEFGILMNOPRST"


def _chat_tokenizer(template: str, eos: str, text: str, vocab_size: int):
    """A tokenizer of exactly ``vocab_size`` ids with ``template``: specials whole, every other character of
    ``text`` (and "3") one token, ``eos`` at id 2 (the server's EOS, which ends a finished grammar)."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    specials = [s for s in ("<|im_start|>", "<tool_call>", "</tool_call>", "<|start_header_id|>",
                            "<|end_header_id|>", "<|python_tag|>") if s in template]  # fmt: skip
    plain = text
    for special in specials:
        plain = plain.replace(special, "")
    rest, fillers = [*specials, *sorted(set(plain + "3"))], iter(_FILLERS)
    pieces = ["<unk>", "<pad>", eos]
    while len(pieces) < vocab_size:
        pieces.append(next(fillers) if len(pieces) in _PREFIXED_IDS or not rest else rest.pop(0))
    assert not rest, f"{len(pieces)} ids cannot hold the family's pieces"
    tok = Tokenizer(models.BPE(vocab={p: i for i, p in enumerate(pieces)}, merges=[], unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", eos_token=eos, additional_special_tokens=specials
    )
    fast.chat_template = template
    return fast


def _regex(server_words: list[str], chat_tokenizer, text: str) -> str:
    """A regex over the server's words that only the chat tokens of ``text`` spell."""
    ids = chat_tokenizer(text, add_special_tokens=False)["input_ids"]
    assert chat_tokenizer.unk_token_id not in ids and chat_tokenizer.decode(ids) == text
    return "".join(re.escape(server_words[i]) for i in ids)


@pytest.mark.parametrize("family", sorted(CALLS))
def test_a_tool_call_the_model_writes_is_answered_and_the_next_call_extends_its_trajectory(
    sglang_server, tiny_model_dir, family_templates, family
) -> None:
    from transformers import AutoTokenizer

    words = AutoTokenizer.from_pretrained(tiny_model_dir)
    server_words = words.convert_ids_to_tokens(list(range(len(words))))
    template, eos = family_templates[family]
    parser, call = CALLS[family]
    tokenizer = _chat_tokenizer(template, eos, call, len(server_words))
    with Gateway(SGLangClient(sglang_server.url), tokenizer, api_key="k", context_length=512) as gw:
        assert gw.tool_format.name == parser  # chosen from the template's own tool-call markers
        sid = gw.open_session()
        client = openai.OpenAI(base_url=gw.session_url(sid), api_key="k", max_retries=0)
        messages: list = [{"role": "user", "content": "add 1"}]
        gw.sampling_override = {"regex": _regex(server_words, tokenizer, call)}
        first = client.chat.completions.create(model="m", messages=messages, tools=[ADD], temperature=0.0)
        (tool_call,) = first.choices[0].message.tool_calls
        assert first.choices[0].finish_reason == "tool_calls"
        assert (tool_call.function.name, json.loads(tool_call.function.arguments)) == ("add", {"a": 1})
        messages.append(first.choices[0].message.model_dump(exclude_none=True))
        messages.append({"role": "tool", "tool_call_id": tool_call.id, "content": "1"})
        gw.sampling_override = {"regex": _regex(server_words, tokenizer, "3")}
        second = client.chat.completions.create(model="m", messages=messages, tools=[ADD], temperature=0.0)
        assert second.choices[0].message.content == "3" and not second.choices[0].message.tool_calls
        episode = gw.close_session(sid).episode
    (trajectory,) = episode.trajectories  # no fork: the tool turn extended the trajectory of the call
    assert episode.forks == 0 and trajectory.turns == 2
    sampled = [t for t, m in zip(trajectory.response_ids, trajectory.loss_mask, strict=True) if m]
    eos_id = tokenizer.eos_token_id
    expected = [*tokenizer(call, add_special_tokens=False)["input_ids"], eos_id, tokenizer.convert_tokens_to_ids("3")]
    assert sampled == [*expected, eos_id]  # the call and the answer, each ended by the family's EOS
    first_len = len(expected) - 1  # the call's tokens with its EOS, then the tool turn's template tokens
    assert trajectory.loss_mask[:first_len] == [1] * first_len and trajectory.loss_mask[first_len] == 0
