"""SFT rows: loss masks of chat templates as models ship them (ChatML/Qwen3-like, Llama-3.1-like), pairs, bad rows."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tidal.train.embedded_model import build_chat_tokenizer, build_tokenizer
from tidal.train.sft_data import SftDataset, assistant_mask, pair_sample

# Qwen3's template without its reasoning branch: a system turn when given, ChatML turns, a generation prompt.
CHATML = (
    "{%- for m in messages %}"
    "{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Llama 3.1's layout: BOS, a system header always (dated), then a header and <|eot_id|> per turn, contents trimmed.
LLAMA31 = (
    "{{- bos_token }}"
    "{%- if messages[0]['role'] == 'system' %}{%- set system = messages[0]['content'] | trim %}"
    "{%- set messages = messages[1:] %}{%- else %}{%- set system = '' %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}"
    "{{- 'Cutting Knowledge Date: December 2023\\nToday Date: 26 Jul 2024\\n\\n' }}"
    "{{- system }}{{- '<|eot_id|>' }}"
    "{%- for m in messages %}"
    "{{- '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' + m['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
# Qwen3's reasoning rule, reduced: only the last assistant turn keeps its <think> block.
DROPS_REASONING = (
    "{%- for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{%- if m['role'] == 'assistant' and loop.last %}<think>\n\n</think>\n\n{%- endif %}"
    "{{ m['content'] }}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)
CONVERSATION = [
    {"role": "system", "content": "You add numbers."},
    {"role": "user", "content": "12+30="},
    {"role": "assistant", "content": "42"},
    {"role": "user", "content": "and 1+1?"},
    {"role": "assistant", "content": "2, of course"},
]


@pytest.fixture(scope="module")
def chatml():
    return build_chat_tokenizer()  # Qwen2's tokenizer class, ChatML special tokens


@pytest.fixture(scope="module")
def llama():
    tok = build_chat_tokenizer()
    tok.add_tokens(["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"], special_tokens=True)
    tok.bos_token, tok.eos_token, tok.chat_template = "<|begin_of_text|>", "<|eot_id|>", LLAMA31
    return tok


def _learned_spans(tok, sample) -> list[str]:
    """The decoded runs of loss tokens, in order."""
    spans, run = [], []
    for token, m in zip(sample.tokens, [*sample.loss_mask], strict=True):
        if m:
            run.append(token)
        elif run:
            spans.append(tok.decode(run))
            run = []
    return [*spans, tok.decode(run)] if run else spans


def test_chatml_masks_cover_each_assistant_turn_and_its_end_token_only(chatml):
    chatml.chat_template = CHATML
    sample = assistant_mask(chatml, CONVERSATION)
    assert _learned_spans(chatml, sample) == ["42<|im_end|>\n", "2, of course<|im_end|>\n"]
    assert sample.tokens == chatml.encode(chatml.apply_chat_template(CONVERSATION, tokenize=False))
    context = chatml.decode([t for t, m in zip(sample.tokens, sample.loss_mask, strict=True) if not m])
    assert "You add numbers." in context and "and 1+1?" in context and "<|im_start|>assistant\n" in context
    assert "42" not in context


def test_llama31_masks_skip_the_dated_system_header_and_user_turns(llama):
    sample = assistant_mask(llama, CONVERSATION)
    assert _learned_spans(llama, sample) == ["42<|eot_id|>", "2, of course<|eot_id|>"]
    text = llama.decode(sample.tokens)
    assert text.startswith("<|begin_of_text|><|start_header_id|>system") and "Cutting Knowledge" in text
    assert sample.loss_mask[0] == 0 and len(sample.tokens) == len(sample.loss_mask)


def test_a_template_that_rewrites_earlier_turns_is_refused_naming_the_row(chatml):
    chatml.chat_template = DROPS_REASONING
    with pytest.raises(ValueError, match=r"rows\.jsonl row 3: the chat template renders turn 2 differently"):
        assistant_mask(chatml, CONVERSATION, where="rows.jsonl row 3")
    single = assistant_mask(chatml, CONVERSATION[:3])  # one assistant turn, last: its rendering is the whole's
    assert _learned_spans(chatml, single) == ["<think>\n\n</think>42<|im_end|>"]


def test_a_conversation_without_an_assistant_turn_is_refused(chatml):
    chatml.chat_template = CHATML
    with pytest.raises(ValueError, match="no assistant turn"):
        assistant_mask(chatml, CONVERSATION[:2], where="x")


def test_pairs_learn_the_response_and_eos_only():
    tok = build_tokenizer(["0123456789+="])
    sample = pair_sample(tok, "12+30=", "042", chat=False)
    assert tok.decode(sample.tokens[:6]) == "12+30=" and sample.loss_mask == [0] * 6 + [1] * 4
    assert sample.tokens[-1] == tok.eos_token_id


def test_dataset_reads_chat_parquet_and_pairs_jsonl_and_names_a_row_without_its_response(tmp_path, chatml):
    chatml.chat_template = CHATML
    pq.write_table(pa.Table.from_pylist([{"messages": CONVERSATION}] * 3), tmp_path / "chat.parquet")
    chat = SftDataset([str(tmp_path / "chat.parquet")], chatml, input_key="messages", label_key="label", seed=1)
    assert len(chat) == 3 and sum(chat.sample(2).loss_mask) == sum(assistant_mask(chatml, CONVERSATION).loss_mask)
    assert sorted(chat.order(0).tolist()) == [0, 1, 2] and chat.order(0).tolist() == chat.order(0).tolist()
    rows = tmp_path / "pairs.jsonl"
    rows.write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n" + json.dumps({"prompt": "2+2="}) + "\n")
    pairs = SftDataset([str(rows)], chatml, input_key="prompt", label_key="answer", seed=1, apply_chat_template=True)
    assert _learned_spans(chatml, pairs.sample(0)) == ["2<|im_end|>\n"]
    with pytest.raises(ValueError, match=r"pairs\.jsonl row 1: .* no --label-key 'answer' response"):
        pairs.sample(1)


def test_epochs_are_seeded_orders_and_a_weighted_mix_draws_by_its_weights(tmp_path):
    tok = build_tokenizer(["0123456789+="])
    for name, n in (("a", 300), ("b", 100)):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps({"prompt": f"{i}=", "label": "1"}) + "\n"
                                                        for i in range(n)))  # fmt: skip
    plain = SftDataset([str(tmp_path / "a.jsonl")], tok, input_key="prompt", label_key="label", seed=3)
    first, second = plain.order(0).tolist(), plain.order(1).tolist()
    assert sorted(first) == sorted(second) == list(range(300)) and first != second
    assert (
        SftDataset([str(tmp_path / "a.jsonl")], tok, input_key="prompt", label_key="label", seed=3).order(0).tolist()
        == first
    )
    mix = SftDataset([f"{tmp_path / 'a.jsonl'}:0.2", f"{tmp_path / 'b.jsonl'}:0.8"], tok, input_key="prompt",
                     label_key="label", seed=3)  # fmt: skip
    order = mix.order(0)
    assert len(order) == 400 and 0.7 < float((order >= 300).mean()) < 0.9  # rows of b: 80 % of the draws
