"""`--config FILE` (YAML or TOML) gives the same job as the flags; flags override it; the run's config reloads."""

import pytest
from tidal.train.cli import parse_job
from tidal.train.config_file import write_effective_config

FLAGS = [
    "--rollout-batch-size", "8",
    "--n-samples-per-prompt", "4",
    "--lr", "3e-4",
    "--rollout-stop", "\n", "END",
    "--use-dynamic-batch-size",
    "--no-colocate",
    "--ray-env", "A=1",
    "--sglang-mem-fraction-static", "0.5",
    "--use-tis",
]  # fmt: skip

YAML = """
rollout-batch-size: 8
n_samples_per_prompt: 4
lr: 3.0e-4
rollout-stop: ["\\n", "END"]
use-dynamic-batch-size: true
colocate: false
ray-env: ["A=1"]
sglang-mem-fraction-static: 0.5
use-tis: true
"""

TOML = """
rollout-batch-size = 8
n_samples_per_prompt = 4
lr = 3e-4
rollout-stop = ["\\n", "END"]
use-dynamic-batch-size = true
colocate = false
ray-env = ["A=1"]
sglang-mem-fraction-static = 0.5
use-tis = true
"""


@pytest.mark.parametrize(("name", "text"), [("job.yaml", YAML), ("job.toml", TOML)])
def test_config_file_equals_flags(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    out = ["--output-dir", str(tmp_path / "run")]  # the default run folder is named by the second it is parsed in
    assert parse_job(["--config", str(path), *out]) == parse_job([*FLAGS, *out])


def test_flags_override_the_file(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(YAML)
    job = parse_job(["--config", str(path), "--lr", "1e-5", "--colocate"])
    assert job.actor.lr == 1e-5
    assert job.placement.colocate is True
    assert job.batching.rollout_batch_size == 8


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("no-such-option: 1\n", "no-such-option"),
        ("use-tis: maybe\n", "use-tis"),
        ("- a\n- b\n", "mapping"),
        ("lr: [1, 2\n", "could not be parsed"),
    ],
)
def test_bad_config_file_names_the_file_and_the_key(tmp_path, text, needle):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match="--config") as info:
        parse_job(["--config", str(path)])
    assert needle in str(info.value)
    assert str(path) in str(info.value)


@pytest.mark.parametrize("extra", [[], ["--no-recompute-lm-head"]])
def test_effective_config_reloads_to_the_same_job(tmp_path, extra):
    job = parse_job([*FLAGS, *extra, "--output-dir", str(tmp_path / "run")])
    assert job.actor.recompute_lm_head is not bool(extra)
    written = write_effective_config(job, tmp_path / "run")
    assert parse_job(["--config", str(written)]) == job


def test_a_negative_flag_in_a_config_file_means_what_it_says(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("no-recompute-lm-head: true\n")
    assert not parse_job(["--config", str(path)]).actor.recompute_lm_head
    path.write_text("no-recompute-lm-head: false\n")
    assert parse_job(["--config", str(path)]).actor.recompute_lm_head
    path.write_text("recompute_lm_head: false\ncheck-for-nan-in-loss-and-grad: false\n")  # the fields' names
    job = parse_job(["--config", str(path)])
    assert not job.actor.recompute_lm_head and not job.actor.check_for_nan_in_loss_and_grad
    path.write_text("recompute-lm-head: true\n")
    assert parse_job(["--config", str(path)]).actor.recompute_lm_head


@pytest.mark.parametrize(
    "argv",
    [
        [],  # the embedded recipe
        ["--recipe", "embedded", "--rollout-temperature", "0", "--no-colocate", "--context-parallel-size", "2",
         "--actor-num-gpus-per-node", "2", "--use-router", "--sglang-router-cache-threshold", "0.5"],
        ["--no-use-dynamic-batch-size", "--micro-batch-size", "2", "--no-check-for-nan-in-loss-and-grad",
         "--rollout-stop-token-ids", "1", "2", "--rollout-external-engine-addrs", "h:1", "h:2"],
    ],
)  # fmt: skip
def test_the_dumped_job_loads_back_as_the_same_job(tmp_path, argv):
    job = parse_job([*argv, "--output-dir", str(tmp_path / "run")])
    written = write_effective_config(job, tmp_path / "run")
    assert parse_job(["--config", str(written)]) == job


def test_a_config_file_may_name_the_recipe(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text(f'recipe = "base"\nprompt-data = "{tmp_path / "d.jsonl"}"\n')
    tmp_path.joinpath("d.jsonl").write_text('{"prompt": "1+1=", "label": "2"}\n')
    with pytest.raises(ValueError, match="--rollout-batch-size is required"):
        parse_job(["--config", str(path)])  # the base recipe sets no batch size
    job = parse_job(["--config", str(path), "--rollout-batch-size", "4"])
    assert job.actor.lr == 1e-6 and job.batching.rollout_batch_size == 4
