"""`train --teacher-hf-checkpoint`: accepted with the student's tokenizer, refused in one line otherwise."""

import json
import os
import re
from pathlib import Path

import pytest
from tidal.train.cli import validate

VOCAB = {"<|endoftext|>": 0, "1": 1, "+": 2, "=": 3}


def _model(folder: Path, *, vocab=VOCAB, eos="<|endoftext|>", layers: int = 4) -> str:
    """The files parse time reads of an HF folder: config.json, the tokenizer's two JSON files, a weights file."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen2", "num_hidden_layers": layers}))
    tokenizer = {"model": {"type": "BPE", "vocab": vocab, "merges": []},
                 "added_tokens": [{"id": 0, "content": "<|endoftext|>", "special": True}]}  # fmt: skip
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": eos, "pad_token": "<|endoftext|>"}))
    (folder / "model.safetensors").write_bytes(b"")
    return str(folder)


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("teacher")
    (root / "data.jsonl").write_text('{"prompt": "1+1=", "label": "2"}\n')
    return {
        "student": _model(root / "student"),
        "teacher": _model(root / "teacher", layers=8),  # deeper, same tokenizer
        "other_vocab": _model(root / "other_vocab", vocab={**VOCAB, "2": 4}),
        "other_eos": _model(root / "other_eos", eos="="),
        "data": str(root / "data.jsonl"),
        "empty": str(root),
    }


def _argv(paths, *extra: str) -> list[str]:
    base = ["--recipe", "base", "--hf-checkpoint", paths["student"], "--prompt-data", paths["data"], "--rm-type",
            "math", "--rollout-batch-size", "4", "--n-samples-per-prompt", "2"]  # fmt: skip
    return [*base, *(e.format(**paths) for e in extra)]


def test_a_teacher_with_the_students_tokenizer_is_accepted_with_an_absolute_path(paths, monkeypatch):
    monkeypatch.chdir(Path(paths["teacher"]).parent)
    job = validate(_argv(paths, "--teacher-hf-checkpoint", "teacher", "--advantage-estimator",
                         "on_policy_distillation"), detected_gpus=0)  # fmt: skip
    assert job.actor.teacher_hf_checkpoint == paths["teacher"] and os.path.isabs(job.actor.teacher_hf_checkpoint)
    assert job.actor.advantage_estimator == "on_policy_distillation" and job.actor.teacher_kl_coef == 1.0
    mixed = validate(_argv(paths, "--teacher-hf-checkpoint", "{teacher}", "--teacher-kl-coef", "0.1"), detected_gpus=0)
    assert mixed.actor.advantage_estimator == "grpo" and mixed.actor.teacher_kl_coef == 0.1


REFUSED = [
    (["--teacher-hf-checkpoint", "{other_vocab}"], r"^--teacher-hf-checkpoint \S+ has another tokenizer than "
     r"--hf-checkpoint \S+ \(its vocabulary differ\).*pick a teacher of the student's family"),
    (["--teacher-hf-checkpoint", "{other_eos}"], r"\(its special tokens \(eos_token\) differ\)"),
    (["--teacher-hf-checkpoint", "{empty}"], r"^--teacher-hf-checkpoint \S+ has no config.json"),
    (["--advantage-estimator", "on_policy_distillation"], r"on_policy_distillation needs a teacher: add --teacher-hf"),
    (["--teacher-hf-checkpoint", "{teacher}", "--pipeline-model-parallel-size", "2", "--actor-num-gpus-per-node", "2"],
     r"^--teacher-hf-checkpoint with --pipeline-model-parallel-size 2 is not supported yet"),
    (["--teacher-hf-checkpoint", "{teacher}", "--max-staleness", "1", "--rollout-num-gpus", "1"],
     r"^--teacher-hf-checkpoint with --max-staleness 1 is not supported yet"),
    (["--teacher-hf-checkpoint", "{teacher}", "--partial-rollout"],
     r"^--teacher-hf-checkpoint with --partial-rollout is not supported yet"),
    (["--teacher-hf-checkpoint", "{teacher}", "--use-kl-loss", "--kl-loss-coef", "0.1"],
     r"^--teacher-hf-checkpoint with --use-kl-loss is not supported yet"),
    (["--teacher-hf-checkpoint", "{teacher}", "--use-rollout-routing-replay"],
     r"--teacher-hf-checkpoint with --use-rollout-routing-replay is not supported yet"),
    (["--teacher-hf-checkpoint", "{teacher}", "--advantage-estimator", "ppo"],
     r"^--teacher-hf-checkpoint with --advantage-estimator ppo is not supported"),
]  # fmt: skip


@pytest.mark.parametrize(("extra", "expected"), REFUSED, ids=[str(i) for i in range(len(REFUSED))])
def test_what_distillation_does_not_take_is_refused_in_one_line_naming_both(paths, extra, expected):
    with pytest.raises(ValueError) as info:
        validate(_argv(paths, *extra), detected_gpus=0)
    lines = str(info.value).splitlines()
    assert any(re.search(expected, line) for line in lines), lines
    assert "Traceback" not in str(info.value)
