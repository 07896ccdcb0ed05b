"""`train --stage sft` at parse time: what the job becomes, and one line per RL option it would ignore."""

from __future__ import annotations

import json
import re

import pytest
from tidal.train.checks import ConfigErrors
from tidal.train.cli import parse_job
from tidal.train.task_data import TRAIN_FILE, shipped_path


@pytest.fixture
def rows(tmp_path):
    path = tmp_path / "sft.jsonl"
    path.write_text(json.dumps({"prompt": "1+1=", "label": "2"}) + "\n")
    return str(path)


def _problems(argv: list[str]) -> list[str]:
    with pytest.raises(ValueError) as info:
        parse_job(argv)
    return info.value.problems if isinstance(info.value, ConfigErrors) else [str(info.value)]


def test_the_sft_job_trains_the_actor_on_sft_loss_alone_without_the_recipes_rl_values(rows, tmp_path):
    job = parse_job(["--stage", "sft", "--sft-data", rows, "--global-batch-size", "8", "--output-dir", str(tmp_path)])
    assert job.sft.stage == "sft" and job.sft.sft_data == (rows,) and job.sft.num_epoch == 1
    assert job.actor.loss_type == "sft_loss" and job.actor.calculate_per_token_loss  # a mean over loss tokens
    assert (job.batching.rollout_batch_size, job.batching.global_batch_size, job.batching.n_samples_per_prompt) == (
        8,
        8,
        1,
    )
    assert job.actor.temperature == 1.0 and job.actor.lr == 4e-4  # the recipe's optimizer values stay
    assert job.placement.colocate and job.offload.offload is False and job.train.prompt_data is None


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        (["--n-samples-per-prompt", "4"], "--stage sft would ignore RL option --n-samples-per-prompt .*: drop them"),
        (["--rm-type", "math", "--no-colocate"], "--stage sft would ignore RL options --no-colocate, --rm-type"),
        (["--kl-loss-coef", "0.1", "--use-kl-loss"], "RL options --kl-loss-coef, --use-kl-loss"),
        (["--update-weight-delta"], "--stage sft would ignore RL option --update-weight-delta"),
        (["--loss-type", "policy_loss"], "--stage sft trains on --loss-type sft_loss, got --loss-type policy_loss"),
        (["--lora-rank", "8"], "--lora-rank with --stage sft is not supported yet"),
        (["--load", "ckpt"], "--load with --stage sft is not supported .*--save-hf folder"),
        (["--num-epoch", "0"], "--num-epoch must be >= 1, got 0"),
        (["--rollout-batch-size", "8"], "--stage sft takes --global-batch-size"),
    ],
)
def test_an_rl_option_given_with_the_sft_stage_is_refused_in_one_line(rows, tmp_path, extra, expected):
    argv = ["--stage", "sft", "--sft-data", rows, "--global-batch-size", "8", "--output-dir", str(tmp_path), *extra]
    problems = _problems(argv)
    assert any(re.search(expected, p) for p in problems), problems
    assert len(problems) == 1, problems
    assert all("\n" not in p and "Traceback" not in p for p in problems)


def test_sft_options_need_the_sft_stage_and_the_stage_needs_its_data(rows, tmp_path):
    out = ["--output-dir", str(tmp_path)]
    assert _problems(["--sft-data", rows, *out]) == [
        "--sft-data is read by --stage sft only; add --stage sft or drop it"
    ]
    assert "--stage sft needs --sft-data FILE" in _problems(["--stage", "sft", *out])[0]
    assert "--stage must be one of rl, sft, got 'dpo'" in _problems(["--stage", "dpo", *out])[0]
    missing = _problems(["--stage", "sft", "--sft-data", str(tmp_path / "none.jsonl"), *out])
    assert any("none.jsonl" in p for p in missing), missing
    base = ["--recipe", "base", "--hf-checkpoint", str(shipped_path(TRAIN_FILE).parent), "--stage", "sft"]
    assert any("--global-batch-size N" in p for p in _problems([*base, "--sft-data", rows, *out]))


def test_an_rl_run_given_an_sft_checkpoint_hands_its_weights_to_the_engines_before_rollout_0():
    from types import SimpleNamespace

    from tidal.train.loop import _serve_first_weights

    synced: list[int] = []
    weights = SimpleNamespace(sync=lambda rollouts, version: synced.append(version) or "weights/0")
    rollouts = SimpleNamespace(has_engines=True, external=False)
    sft_checkpoint = SimpleNamespace(ckpt=SimpleNamespace(load="sft/ckpt"))  # its trainer state: version 0
    assert _serve_first_weights(sft_checkpoint, rollouts, weights, 0) == "weights/0" and synced == [0]
    assert _serve_first_weights(SimpleNamespace(ckpt=SimpleNamespace(load=None)), rollouts, weights, 0) is None
    assert synced == [0]  # a fresh run's engines already serve --hf-checkpoint
