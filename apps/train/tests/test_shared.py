"""Values that cross packages are given once and reach every package that needs them (tidal.train.shared)."""

import pytest
from tidal.train.cli import parse_job


@pytest.fixture
def out(tmp_path) -> list[str]:
    return ["--output-dir", str(tmp_path / "run")]


def test_each_shared_value_reaches_every_section_that_needs_it(out):
    job = parse_job(["--n-samples-per-prompt", "4", "--rollout-batch-size", "16", "--rollout-temperature", "0.7",
                     "--context-parallel-size", "2", "--actor-num-gpus-per-node", "2", *out])  # fmt: skip
    assert job.rollout.n_samples_per_prompt == job.batching.n_samples_per_prompt == 4
    assert job.batching.rollout_batch_size == job.rollout.rollout_batch_size == 16
    assert job.rollout.rollout_temperature == job.actor.temperature == 0.7
    assert job.train.context_parallel_size == job.batching.context_parallel_size == 2
    assert job.actor.hf_checkpoint == job.ckpt.hf_checkpoint  # the embedded model's folder
    assert job.train.hf_checkpoint is None


def test_greedy_sampling_gives_the_actor_untempered_log_probs(out):
    job = parse_job(["--rollout-temperature", "0", *out])
    assert job.rollout.rollout_temperature == 0 and job.actor.temperature == 1.0


def test_the_token_budget_is_scaled_by_the_context_parallel_size(out):
    argv = ["--use-dynamic-batch-size", "--max-tokens-per-gpu", "200", "--rollout-max-response-len", "256", *out]
    with pytest.raises(ValueError, match="--max-tokens-per-gpu 200 cannot hold one sample"):
        parse_job(argv)
    job = parse_job([*argv, "--context-parallel-size", "2", "--actor-num-gpus-per-node", "2"])
    assert job.batching.micro_batch_token_budget == 400  # what the planner packs: 200 tokens per GPU x CP 2


def test_stale_samples_turn_the_off_policy_correction_on_unless_no_use_tis(out):
    # --max-staleness K >= 1 trains on samples up to K versions old: without the correction its K = 2 benchmark run
    # did not learn (bench/RESULTS.md, issue 20), so it is on by default there and off in the synchronous loop.
    decoupled = ["--no-colocate", "--rollout-num-gpus", "1", *out]
    assert parse_job(out).actor.off_policy_correction is False
    job = parse_job(["--max-staleness", "2", *decoupled])
    assert job.actor.max_staleness == job.train.max_staleness == 2
    assert job.actor.off_policy_correction is True
    assert parse_job(["--max-staleness", "2", "--no-use-tis", *decoupled]).actor.off_policy_correction is False
    assert parse_job(["--use-tis", *out]).actor.off_policy_correction is True
