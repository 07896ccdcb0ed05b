"""--prompt-data as people store it: formats, nested keys, chat rows with tools, mixes, and one line per bad input."""

from __future__ import annotations

import collections
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tidal.train.data import PromptDataset
from tidal.train.embedded_model import build_tokenizer

TEMPLATE = (
    "{% if tools %}[tools:{% for t in tools %}{{ t['function']['name'] }},{% endfor %}]{% endif %}"
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% if m['tool_calls'] is defined %}!{% endif %}"
    "{% endfor %}<assistant>"
)


@pytest.fixture(scope="module")
def tok():
    tokenizer = build_tokenizer(["0123456789+=<>[]:,!abcdefghijklmnopqrstuvwxyz"])
    tokenizer.chat_template = TEMPLATE
    return tokenizer


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _verl_rows(n: int, start: int = 0) -> list[dict]:
    """verl's layout: chat messages under prompt, the answer under reward_model.ground_truth."""
    return [
        {"prompt": [{"role": "system", "content": "add"}, {"role": "user", "content": f"{i}+1="}],
         "reward_model": {"ground_truth": str(i + 1), "style": "rule"}, "extra_info": {"index": i}}
        for i in range(start, start + n)
    ]  # fmt: skip


def test_parquet_with_nested_keys_chat_rows_tools_and_metadata_through_train(tmp_path, tok):
    """The user's path: flags -> the datasets `train` opens; a chat row is rendered with its own tools."""
    from tidal.train.cli import parse_job
    from tidal.train.loop import _datasets

    rows = _verl_rows(6)
    rows[0]["tools"] = [{"type": "function", "function": {"name": "calc", "parameters": {"a": {"type": "int"}}}}]
    rows[1]["tools"] = [{"type": "function", "function": {"name": "look", "parameters": {"q": {"type": "str"}}}}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "verl.parquet")
    model = tmp_path / "model"
    _save_chat_model(model, tok)
    job = parse_job(["--recipe", "base", "--hf-checkpoint", str(model), "--prompt-data", str(tmp_path / "verl.parquet"),
                     "--input-key", "prompt", "--label-key", "reward_model.ground_truth", "--metadata-key",
                     "extra_info", "--rollout-batch-size", "2", "--output-dir", str(tmp_path / "run")])  # fmt: skip
    train, held_out = _datasets(job)
    first = train.head(3)
    assert first[0].text == "[tools:calc,]<system>add<user>0+1=<assistant>"  # Arrow's union of fields is dropped
    assert first[1].text == "[tools:look,]<system>add<user>1+1=<assistant>"
    assert first[2].text == "<system>add<user>2+1=<assistant>"  # a row without tools: none
    assert "tools" not in first[2].row and "tools" in first[0].row  # a row as written: no other row's keys
    assert [p.label for p in first] == ["1", "2", "3"] and [p.metadata for p in first] == [
        {"index": i} for i in range(3)
    ]
    assert tok.decode(list(first[2].ids)) == first[2].text
    assert list(held_out) == ["verl"] and held_out["verl"].head(1)[0].label == "1"
    epoch = [p.label for k in range(3) for p in train.batch(k, 2)]
    assert sorted(epoch) == [str(i + 1) for i in range(6)]  # each prompt once per epoch


def _save_chat_model(path, tok):
    """A model folder as `train` checks it before start-up: config, the chat tokenizer, a (weightless) shard."""
    from safetensors.numpy import save_file
    from transformers import Qwen2Config

    Qwen2Config(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, eos_token_id=tok.eos_token_id).save_pretrained(path)  # fmt: skip
    tok.save_pretrained(path)
    save_file({}, str(path / "model.safetensors"))


def test_every_format_and_a_glob_read_each_row_once_per_epoch(tmp_path, tok):
    import datasets

    _jsonl(tmp_path / "a.jsonl", [{"prompt": f"{i}+2=", "label": str(i + 2)} for i in range(4)])
    (tmp_path / "b.json").write_text(json.dumps([{"prompt": f"{i}+3=", "label": str(i + 3)} for i in range(3)]))
    (tmp_path / "shards").mkdir()
    for k in range(2):
        pq.write_table(pa.Table.from_pylist([{"prompt": f"{k}{i}+4=", "label": "x"} for i in range(2)]),
                       tmp_path / "shards" / f"part-{k}.parquet")  # fmt: skip
    datasets.Dataset.from_list([{"prompt": f"{i}+5=", "label": "y"} for i in range(5)]).save_to_disk(tmp_path / "disk")
    splits = {s: datasets.Dataset.from_list([{"prompt": s, "label": "z"}]) for s in ("train", "test")}
    datasets.DatasetDict(splits).save_to_disk(tmp_path / "dict")
    specs = [str(tmp_path / p) for p in ("a.jsonl", "b.json", "shards/*.parquet", "disk", "dict/test")]
    data = PromptDataset(specs, tok, input_key="prompt", label_key="label", seed=5)
    assert len(data) == 4 + 3 + 4 + 5 + 1
    every = sorted(p.text for p in data.head(len(data)))
    for epoch in range(2):
        assert sorted(p.text for k in range(len(data)) for p in data.batch(epoch * len(data) + k, 1)) == every
    assert data.tables[2].paths == tuple(str(tmp_path / f"shards/part-{k}.parquet") for k in range(2))
    assert all(t.cache_files for table in data.tables for t in table.tables)  # Arrow files on disk, mapped


def test_a_weighted_mix_gives_each_source_its_share_and_resumes_the_same(tmp_path, tok):
    small = _jsonl(tmp_path / "small.jsonl", [{"prompt": f"s{i}", "label": "s"} for i in range(5)])
    big = _jsonl(tmp_path / "big.jsonl", [{"prompt": f"b{i}", "label": "b"} for i in range(45)])
    data = PromptDataset([f"{small}:0.5", f"{big}:0.5"], tok, input_key="prompt", label_key="label", seed=1)
    drawn = [p.text for k in range(20) for p in data.batch(k, 10)]  # 200 draws, 4 epochs of 50 slots
    assert collections.Counter(t[0] for t in drawn) == {"s": 100, "b": 100}
    small_draws = collections.Counter(t for t in drawn if t[0] == "s")
    assert small_draws == {f"s{i}": 20 for i in range(5)}  # each small prompt once per pass over it
    big_draws = collections.Counter(t for t in drawn if t[0] == "b")  # 100 draws: two passes and 10 of a third
    assert len(big_draws) == 45 and sorted(big_draws.values()) == [2] * 35 + [3] * 10
    again = PromptDataset([f"{small}:0.5", f"{big}:0.5"], tok, input_key="prompt", label_key="label", seed=1)
    assert [p.text for p in again.batch(17, 10)] == drawn[170:180]  # a resumed run: the same batch
    assert [p.text for p in again.more_batch(3, 2, 4, max_rounds=2)] != [p.text for p in again.batch(3, 4)]


def _bad_inputs(tmp_path) -> dict[str, tuple[list, dict, str]]:
    missing = _jsonl(tmp_path / "missing.jsonl", [{"prompt": "a", "label": "1"}, {"prompt": "b"}])
    pq.write_table(pa.Table.from_pylist(_verl_rows(3)), tmp_path / "verl.parquet")
    verl = str(tmp_path / "verl.parquet")
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "rows.csv").write_text("prompt,label\n")
    (tmp_path / "broken.jsonl").write_text('{"prompt": "a", "label": "1"}\n{"prompt": \n')
    keys = {"input_key": "prompt", "label_key": "label"}
    verl_keys = {"input_key": "prompt.1.content", "label_key": "reward_model.ground_truth"}
    return {
        "row without the label": ([missing], keys, f"--prompt-data {missing}: row 1 has no value at 'label'"),
        "list index past the end": ([verl], verl_keys | {"input_key": "prompt.2.content"},
                                    f"{verl}: row 0: prompt.2 is past the end of its list; --input-key"),
        "no such field": ([verl], verl_keys | {"label_key": "reward_model.answer"},
                          "no key 'reward_model.answer': reward_model has the fields \\['ground_truth', 'style'\\]"),
        "no such column": ([verl], verl_keys | {"metadata_key": "meta"}, "no key 'meta'.*set --metadata-key"),
        "empty file": ([str(tmp_path / "empty.jsonl")], keys, "empty.jsonl holds no rows"),
        "unknown suffix": ([str(tmp_path / "rows.csv")], keys, "files ending \\['.csv'\\] are not read"),
        "broken JSON": ([str(tmp_path / "broken.jsonl")], keys, "broken.jsonl cannot be read as a table"),
        "glob without files": ([str(tmp_path / "none-*.parquet")], keys, "the pattern matches no file"),
        "some weights": ([f"{missing}:0.5", verl], keys, "give every source a weight"),
        "zero weight": ([f"{missing}:0"], keys, "the weight after ':' must be > 0"),
    }  # fmt: skip


@pytest.mark.parametrize(
    "case",
    ["row without the label", "list index past the end", "no such field", "no such column", "empty file",
     "unknown suffix", "broken JSON", "glob without files", "some weights", "zero weight"],
)  # fmt: skip
def test_bad_data_is_one_line_naming_the_file_the_row_and_the_key(tmp_path, tok, case):
    specs, keys, message = _bad_inputs(tmp_path)[case]
    with pytest.raises(ValueError, match=message) as error:
        PromptDataset(specs, tok, seed=0, **keys)
    assert "\n" not in str(error.value)


def test_the_start_up_check_reads_nested_keys_of_the_first_row_before_anything_opens(tmp_path):
    from tidal.train.cli import parse_job
    from tidal.train.config import held_out_sets

    pq.write_table(pa.Table.from_pylist(_verl_rows(2)), tmp_path / "verl.parquet")
    verl = str(tmp_path / "verl.parquet")
    base = ["--prompt-data", verl, "--eval-prompt-data", verl, "--output-dir", str(tmp_path / "run")]
    with pytest.raises(ValueError, match=r"--prompt-data .*verl.parquet: row 0 has no key 'label'.*set --label-key"):
        parse_job(base)
    job = parse_job([*base, "--input-key", "prompt.1.content", "--label-key", "reward_model.ground_truth"])
    assert job.train.prompt_data == (str(tmp_path / "verl.parquet"),)
    mix = ("a/x.parquet:0.7", "b/x.jsonl:0.3", "c/*.parquet")
    assert held_out_sets(None, mix) == [("x", "a/x.parquet"), ("x_1", "b/x.jsonl"), ("_", "c/*.parquet")]


def test_the_math_reward_flags_reach_the_rollout_manager(tmp_path, tok):
    from tidal.rollout import MathVerifier
    from tidal.train.cli import parse_job
    from tidal.train.cluster import rollout_manager_of

    path = _jsonl(tmp_path / "p.jsonl", [{"prompt": "1+1=", "label": "2"}])
    job = parse_job(["--prompt-data", path, "--rm-type", "math", "--rm-math-timeout-s", "0.5",
                     "--output-dir", str(tmp_path / "run")])  # fmt: skip
    data = PromptDataset(path, tok, input_key="prompt", label_key="label", seed=0)
    manager = rollout_manager_of(job, data, tmp_path / "run")
    assert isinstance(manager.reward_fn, MathVerifier) and manager.reward_fn.timeout_s == 0.5
