import json

from tidal.train.data import PromptDataset
from tidal.train.embedded_model import EmbeddedModelSpec, build_tokenizer, greedy_accuracy, new_model, warm_start
from tidal.train.task_data import EVAL_FILE, TRAIN_FILE, make_records, read_jsonl, shipped_path


def test_shipped_data_is_what_the_generator_makes():
    train, held_out = make_records()
    assert read_jsonl(shipped_path(TRAIN_FILE)) == train
    assert read_jsonl(shipped_path(EVAL_FILE)) == held_out
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held_out}
    for r in train[:50]:
        a, b = r["prompt"].rstrip("=").split("+")
        assert int(a) + int(b) == int(r["label"])
    import pyarrow.parquet as pq
    from tidal.train.task_data import CHAT_EVAL_FILE, CHAT_TRAIN_FILE, chat_row

    for name, records in ((CHAT_TRAIN_FILE, train), (CHAT_EVAL_FILE, held_out)):  # --recipe embedded-math's rows
        assert pq.read_table(shipped_path(name)).to_pylist() == [chat_row(r) for r in records]


def test_tokenizer_round_trips_and_never_encodes_to_nothing():
    tok = build_tokenizer(["12+34=46"])
    ids = tok.encode("12+34=46")
    assert len(ids) == len("12+34=46") and tok.decode(ids) == "12+34=46"
    assert tok.encode("The capital city of France is")  # SGLang's warm-up prompt
    assert tok.eos_token_id is not None


def test_prompt_batches_are_deterministic_and_wrap_epochs(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"q": f"{i}+1=", "a": str(i + 1)}) + "\n" for i in range(10)))
    tok = build_tokenizer(["0123456789+="])
    one = PromptDataset(path, tok, input_key="q", label_key="a", seed=3)
    two = PromptDataset(path, tok, input_key="q", label_key="a", seed=3)
    assert [p.text for p in one.batch(4, 3)] == [p.text for p in two.batch(4, 3)]
    first_epoch = [p.text for k in range(5) for p in one.batch(k, 2)]
    assert sorted(first_epoch) == sorted(f"{i}+1=" for i in range(10))


def test_missing_key_names_the_flag(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"question": "1+1="}) + "\n")
    try:
        PromptDataset(path, build_tokenizer(["1+="]), input_key="prompt", label_key="label", seed=0)
    except ValueError as e:
        assert "--input-key" in str(e)
    else:
        raise AssertionError("expected a ValueError")


def test_apply_chat_template_renders_each_prompt_as_a_user_turn(tmp_path):
    """--apply-chat-template renders each prompt with the tokenizer's chat template."""
    from tidal.train.data import PromptDataset
    from tidal.train.embedded_model import build_tokenizer

    tok = build_tokenizer(["12+34=046"])
    tok.chat_template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>"
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "12+34=", "label": "046"}\n')
    plain = PromptDataset(path, tok, input_key="prompt", label_key="label", seed=0)
    chat = PromptDataset(path, tok, input_key="prompt", label_key="label", seed=0, apply_chat_template=True)
    assert plain.head(1)[0].text == "12+34="
    assert chat.head(1)[0].text == "<user>12+34=<assistant>"
    assert tok.decode(list(chat.head(1)[0].ids)) == "<user>12+34=<assistant>"


def test_the_apply_chat_template_flag_renders_the_training_and_held_out_prompts_train_reads(tmp_path):
    """--apply-chat-template, through the datasets `train` builds from its config: the prompts are user turns."""
    from tidal.train.cli import parse_job
    from tidal.train.embedded_model import ensure_embedded_model
    from tidal.train.loop import _datasets

    model = tmp_path / "model"  # the embedded checkpoint, its tokenizer given a chat template
    model.mkdir()
    for f in ensure_embedded_model().iterdir():
        if f.name != "tokenizer_config.json":
            (model / f.name).symlink_to(f)
    config = json.loads((ensure_embedded_model() / "tokenizer_config.json").read_text())
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>"
    (model / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "12+34=", "label": "046"}\n')
    base = ["--recipe", "embedded", "--hf-checkpoint", str(model), "--prompt-data", str(path)]
    base += ["--eval-prompt-data", "held", str(path)]
    for flags, text in (([], "12+34="), (["--apply-chat-template"], "<user>12+34=<assistant>")):
        train, held_out = _datasets(parse_job([*base, *flags, "--output-dir", str(tmp_path / str(len(flags)))]))
        assert [p.text for p in train.head(len(train))] == [text] == [p.text for p in held_out["held"].head(1)]
        assert train.tokenizer.decode(list(train.head(1)[0].ids)) == text


def test_warm_start_lowers_the_loss_and_greedy_accuracy_is_a_share():
    import torch

    records = read_jsonl(shipped_path(TRAIN_FILE))[:64]
    tok = build_tokenizer([r["prompt"] + r["label"] for r in records])
    spec = EmbeddedModelSpec(hidden_size=32, intermediate_size=64, num_hidden_layers=1, sft_steps=30, sft_batch_size=16,
                             sft_check_every=1000)  # fmt: skip
    model = new_model(tok, spec)
    assert [p.shape for p in new_model(tok, spec).parameters()] == [p.shape for p in model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(new_model(tok, spec).parameters(), model.parameters(), strict=True))

    def answer_loss():
        ids = torch.tensor([tok.encode(r["prompt"] + r["label"]) for r in records[:16]])
        with torch.no_grad():
            return model(input_ids=ids, labels=ids).loss.item()

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the builder does: more threads thrash on a busy 2-core box
    try:
        before = answer_loss()
        warm_start(model, tok, records, spec)
        assert answer_loss() < before
        assert 0.0 <= greedy_accuracy(model, tok, records[:8]) <= 1.0
    finally:
        torch.set_num_threads(threads)


def test_the_moe_spec_builds_a_qwen3_moe_whose_every_layer_is_moe_and_it_warm_starts():
    import torch

    records = read_jsonl(shipped_path(TRAIN_FILE))[:64]
    tok = build_tokenizer([r["prompt"] + r["label"] for r in records])
    spec = EmbeddedModelSpec(hidden_size=32, num_hidden_layers=2, num_experts=4, moe_intermediate_size=16,
                             sft_steps=30, sft_batch_size=16, sft_check_every=1000)  # fmt: skip
    model = new_model(tok, spec)
    config = model.config
    assert config.model_type == "qwen3_moe" and config.num_experts == 4 and config.num_experts_per_tok == 2
    assert config.mlp_only_layers == [] and config.decoder_sparse_step == 1 and config.norm_topk_prob
    assert not config.tie_word_embeddings and config.head_dim == 8  # SGLang's qwen3_moe unties it

    def answer_loss():
        ids = torch.tensor([tok.encode(r["prompt"] + r["label"]) for r in records[:16]])
        with torch.no_grad():
            return model(input_ids=ids, labels=ids).loss.item()

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        before = answer_loss()
        warm_start(model, tok, records, spec)
        assert answer_loss() < before
    finally:
        torch.set_num_threads(threads)


def test_the_data_flags_pick_the_keys_and_the_order_train_reads(tmp_path):
    """--input-key and --label-key name the JSONL keys `train` reads prompts and labels from (training and held-out
    sets); --seed sets the order of the prompts: the same seed, the same batches; another, others."""
    from tidal.train.cli import parse_job
    from tidal.train.loop import _datasets

    path = tmp_path / "qa.jsonl"
    path.write_text("".join(json.dumps({"question": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(40)))

    def datasets(seed: int, name: str):
        argv = [
            "--prompt-data",
            str(path),
            "--eval-prompt-data",
            str(path),
            "--input-key",
            "question",
            "--label-key",
            "answer",
            "--seed",
            str(seed),
        ]
        return _datasets(parse_job([*argv, "--output-dir", str(tmp_path / name)]))

    (train, held_out), (again, _), (other, _) = datasets(7, "a"), datasets(7, "b"), datasets(8, "c")
    assert {(p.text, p.label) for p in train.head(40)} == {(f"{i}+1=", str(i + 1)) for i in range(40)}
    assert [p.label for p in held_out["qa"].head(40)] == [str(i + 1) for i in range(40)]
    order = [p.text for k in range(4) for p in train.batch(k, 10)]
    assert order == [p.text for k in range(4) for p in again.batch(k, 10)]
    assert order != [p.text for k in range(4) for p in other.batch(k, 10)]
    assert sorted(order) == sorted(p.text for p in train.head(40))


def test_the_chat_tokenizer_round_trips_a_rendered_conversation_and_ends_turns_with_im_end(tmp_path):
    from tidal.train.agent_task import second_turn, warm_start_records
    from tidal.train.embedded_model import IM_END, IM_START, _supervised, build_chat_tokenizer
    from transformers import AutoTokenizer

    built = build_chat_tokenizer()
    built.save_pretrained(tmp_path)  # loaded back as `train`, the gateway and SGLang load it: by the model type
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    tok = AutoTokenizer.from_pretrained(tmp_path)
    row = {"prompt": "07+45=", "label": "052"}
    messages = [{"role": "system", "content": "Add.\n  Two lines, tabs\t and ünïcode."}, *second_turn(row, "?")]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tok.encode(text, add_special_tokens=False)
    assert ids == built.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text  # newlines, spaces and the specials survive
    assert text.count(IM_END + "\n") == len(messages) and text.endswith(IM_START + "assistant\n")
    assert ids.count(tok.convert_tokens_to_ids(IM_END)) == len(messages)  # each one token
    assert tok.eos_token == IM_END and tok.unk_token_id not in ids
    # each turn rendered by itself ends with <|im_end|>: the model's EOS is where the template ends a turn
    for message in messages:
        one = tok.apply_chat_template([message], tokenize=False)
        assert one == f"{IM_START}{message['role']}\n{message['content']}{IM_END}\n"
    # the warm start trains the two answers of a whole episode, each with its EOS, and nothing of the template
    (episode,), (probe,) = warm_start_records(tok, [row])
    seq, labels = _supervised(tok, episode)
    trained = [t for t, label in zip(seq, labels, strict=True) if label != -100]
    assert tok.decode(trained) == "?" + IM_END + "052" + IM_END
    assert tok.decode(seq) + "\n" == tok.apply_chat_template(
        [*second_turn(row, "?"), {"role": "assistant", "content": "052"}], tokenize=False
    )
    assert probe == {"prompt": tok.decode(seq[: -len("052") - 1]), "label": "052"}
