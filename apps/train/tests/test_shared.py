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
    assert job.batching.rollout_batch_size == 16
    assert job.rollout.rollout_temperature == job.actor.temperature == 0.7
    assert job.parallel.context_parallel_size == job.batching.context_parallel_size == 2
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
    # did not learn (bench/RESULTS.md), so it is on by default there and off in the synchronous loop.
    from tidal.train.async_plan import resolve_async_plan

    def plan(*flags):
        job = parse_job([*flags, *out])
        return resolve_async_plan(job.train, job.rollout, job.actor)

    decoupled = ["--no-colocate", "--rollout-num-gpus", "1"]
    sync = plan()
    assert (sync.overlapped, sync.off_policy_correction, sync.flush_after_update) == (False, False, True)
    stale = plan("--max-staleness", "2", *decoupled)
    assert (stale.max_staleness, stale.off_policy_correction, stale.interruptible_updates) == (2, True, True)
    assert stale.resume_interrupted and not stale.flush_after_update
    assert plan("--max-staleness", "2", "--no-use-tis", *decoupled).off_policy_correction is False
    assert plan("--use-tis").off_policy_correction is True
    # a server run elsewhere is never interrupted (an abort would cut other clients' requests too)
    external = plan("--max-staleness", "1", "--rollout-external-engine-addrs", "h:1")
    assert not external.interruptible_updates and not external.resume_interrupted and external.overlapped
    custom = plan("--max-staleness", "1", *decoupled, "--custom-generate-function-path", "json:loads")
    assert not custom.interruptible_updates and custom.resume_interrupted
    # an agent's call cut by an update resumes in the gateway (test_gateway.py): its updates interrupt too
    agents = plan("--max-staleness", "1", *decoupled, "--agent-function-path", "asyncio:sleep")
    assert agents.interruptible_updates and agents.resume_interrupted
