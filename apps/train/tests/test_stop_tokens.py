"""``train`` checks the model's stop tokens on its start-up path, before any process starts."""

import json
from pathlib import Path

import pytest
from tidal.train.cli import main

WORDS = ["1", "2", "+", "=", "<unk>", "<eos>"]


def _model(folder: Path, *, eos: int | None) -> Path:
    """A model folder whose tokenizer is real (6 tokens) and whose weights are never read by the check."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>").save_pretrained(folder)
    config = {"model_type": "qwen2", "num_hidden_layers": 2, "vocab_size": 64}
    if eos is not None:
        config["eos_token_id"] = eos
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "model.safetensors").write_bytes(b"")
    return folder


class Started(BaseException):  # main() reports any Exception; this one passes through
    """Raised where the cluster would start: the start-up checks let the run through."""


@pytest.fixture
def run(tmp_path, monkeypatch, capsys):
    import tidal.train.loop

    def start_cluster(*args, **kwargs):
        raise Started

    monkeypatch.setattr(tidal.train.loop, "start_cluster", start_cluster)
    data = tmp_path / "data.jsonl"
    data.write_text('{"prompt": "1 + 1 =", "label": "2"}\n')

    def train(model: Path, *flags: str) -> tuple[int, list[str]]:
        argv = ["--recipe", "base", "--hf-checkpoint", str(model), "--prompt-data", str(data)]
        code = main([*argv, "--rollout-batch-size", "4", "--output-dir", str(tmp_path / "run"), *flags])
        return code, [e for e in capsys.readouterr().err.splitlines() if e.startswith("train: error: ")]

    return train


def test_an_eos_the_tokenizer_cannot_produce_stops_train_before_anything_starts(run, tmp_path):
    from transformers import AutoTokenizer

    model = _model(tmp_path / "m", eos=40)  # inside config.json's 64-token vocabulary, outside the tokenizer's
    size = len(AutoTokenizer.from_pretrained(model))
    assert size < 40
    code, errors = run(model)
    assert code == 1 and len(errors) == 1, errors
    assert f"token id(s) [40], which its {size}-token vocabulary cannot produce" in errors[0]
    assert "--rollout-stop-token-ids" in errors[0] and "--rollout-max-response-len" in errors[0]


def test_no_eos_and_no_stop_stops_train_before_anything_starts(run, tmp_path):
    code, errors = run(_model(tmp_path / "m", eos=None))
    assert code == 1 and len(errors) == 1, errors
    assert "declares no eos_token_id" in errors[0] and "set --rollout-stop-token-ids" in errors[0]


def test_a_stop_token_or_string_lets_train_start_and_the_unreachable_eos_is_a_warning(run, tmp_path, capsys):
    model = _model(tmp_path / "m", eos=40)
    for flags, ends in ((["--rollout-stop-token-ids", "5"], "end on 5 or"), (["--rollout-stop", "="], "end on '=' or")):
        with pytest.raises(Started):  # past the check: the cluster would start now
            run(model, *flags, "--overwrite-output-dir")
        warnings = [line for line in capsys.readouterr().err.splitlines() if " WARNING " in line]
        assert [w for w in warnings if "stop token id(s) [40]" in w and ends in w], warnings
