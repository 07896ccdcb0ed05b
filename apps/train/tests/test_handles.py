"""The loop's two handles without a cluster: the rollout manager's replay path and the actor group's training data."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import ray
from tidal.rollout import Sample, save_rollout_data
from tidal.train.actor_group import rollout_data
from tidal.train.cli import parse_job
from tidal.train.cluster import rollout_manager_of


def _sample(prompt: list[int], response: list[int], reward: float) -> Sample:
    return Sample(
        prompt_ids=prompt,
        response_ids=response,
        response_log_probs=[-0.5] * len(response),
        finish_reason="stop",
        reward=reward,
        weight_version="1",
    )


def test_training_data_puts_zero_log_probs_on_prompt_tokens():
    data = rollout_data([_sample([1, 2, 3], [4, 5], 1.0), _sample([1], [6], 0.0)], group_size=2)
    assert data.tokens == [[1, 2, 3, 4, 5], [1, 6]]
    assert data.loss_masks == [[0, 0, 0, 1, 1], [0, 1]]
    assert data.rollout_log_probs == [[0.0, 0.0, 0.0, -0.5, -0.5], [0.0, -0.5]]
    assert data.rewards == [1.0, 0.0]
    assert data.group_size == 2


def test_replayed_rollouts_come_from_disk_without_engines(tmp_path: Path):
    saved = [_sample([1, 2], [3], 1.0), _sample([1, 2], [4], 0.0)]
    save_rollout_data(tmp_path, 5, saved)
    job = parse_job(
        ["--debug-train-only", "--load-debug-rollout-data", str(tmp_path), "--output-dir", str(tmp_path / "o")]
    )
    rollouts = rollout_manager_of(job, SimpleNamespace(tokenizer=None), tmp_path)
    ray_before = ray.is_initialized()  # the suite's session cluster may be up already
    rollouts.wait_ready()  # nothing was started: no engine, no router, no Ray (a stale cluster file could hang it)
    assert ray.is_initialized() == ray_before
    assert not rollouts.has_engines and not rollouts.external
    samples, times = rollouts.generate(5)
    assert samples == saved
    assert list(times) == ["time/generate"]  # no engine time: nothing was generated
    assert rollouts.http_retries() == 0
    assert rollouts.carry_state() is None


def test_sync_plan_defaults_follow_the_placement():
    """The plan both handles follow: --offload-train and --offload-rollout each override --offload for their side,
    --update-weight-buffer-size is the bucket (or shard) size, --check-weight-update-tolerance the probe's bound."""
    from tidal.train.weight_sync import resolve_sync_plan

    def plan(*flags):
        job = parse_job(["--output-dir", "/tmp/unused-tidal-run", *flags])
        return resolve_sync_plan(job.sync, job.offload, job.placement, job.rollout)

    colocated = plan()  # the embedded recipe: co-located on one (logical) GPU
    assert (colocated.transport, colocated.offload_train, colocated.offload_rollout) == ("tensor", True, True)
    external = plan("--rollout-external-engine-addrs", "h:1")
    assert (external.transport, external.offload_train, external.offload_rollout) == ("nccl", False, False)
    assert plan("--no-offload-rollout").offload_train and not plan("--no-offload-rollout").offload_rollout
    assert plan("--no-offload").transport == "tensor" and not plan("--no-offload").offload_train
    assert plan("--update-weight-transport", "disk", "--update-weight-buffer-size", "1024").bucket_bytes == 1024
    train_only = plan("--no-offload", "--offload-train")
    assert (train_only.offload_train, train_only.offload_rollout) == (True, False)
    rollout_only = plan("--no-offload", "--offload-rollout")
    assert (rollout_only.offload_train, rollout_only.offload_rollout) == (False, True)
    checked = plan("--check-weight-update-equal", "--check-weight-update-tolerance", "0.01")
    assert checked.check_equal and checked.tolerance == 0.01


def test_engines_that_free_their_weights_between_syncs_are_refused_before_start():
    """--update-weights-interval 2 with the co-located default (--offload-rollout) and SGLang's memory saver: the
    engines free their weights after each generation and only a sync writes them back, so a rollout after a rollout
    without a sync would sample from freed memory. A host copy (--sglang-enable-weights-cpu-backup), engines that
    keep their memory (--no-offload-rollout) or a sync every rollout are accepted."""
    import pytest
    from tidal.train.checks import ConfigErrors

    out = ["--output-dir", "/tmp/unused-tidal-run"]
    argv = [*out, "--update-weights-interval", "2", "--sglang-enable-memory-saver"]
    with pytest.raises(ConfigErrors) as refused:
        parse_job(argv)
    (line,) = refused.value.problems
    assert line.startswith(
        "--update-weights-interval 2 with --offload-rollout and --sglang-enable-memory-saver: the engines free"
    ), line
    assert "--sglang-enable-weights-cpu-backup" in line and "--no-offload-rollout" in line
    for fix in (["--sglang-enable-weights-cpu-backup"], ["--no-offload-rollout"], ["--update-weights-interval", "1"]):
        assert parse_job([*argv, *fix]).sync.update_weights_interval in (1, 2)
    assert parse_job([*out, "--update-weights-interval", "2"]).sync.update_weights_interval == 2  # nothing freed


def test_a_probe_gap_above_the_tolerance_stops_the_sync_with_one_line(tmp_path: Path):
    """--check-weight-update-tolerance bounds the mean probe gap after each sync: 0.05 nats passes at 0.1 and
    stops the run, naming both flags, at 0.01."""
    import pytest
    from tidal.rollout import RolloutError
    from tidal.train.handoff import HandOffLog
    from tidal.train.weight_sync import WeightExport, WeightSync, resolve_sync_plan

    # the engine's response log-probs and the actor's of the same tokens: gaps 0.1 and 0.0, mean 0.05
    engines = SimpleNamespace(probe=lambda: [[([1, 2, 3, 4], [-0.5, -1.0])]])
    actors = SimpleNamespace(call_all=lambda name, tokens: [[[0.0, -9.0, -0.4, -1.0]] * len(tokens)])

    def check(tolerance: str) -> dict:
        job = parse_job(["--output-dir", str(tmp_path / tolerance), "--check-weight-update-equal",
                         "--check-weight-update-tolerance", tolerance])  # fmt: skip
        plan = resolve_sync_plan(job.sync, job.offload, job.placement, job.rollout)
        export = WeightExport(root=tmp_path / "weights", max_shard_bytes=plan.bucket_bytes)
        sync = WeightSync(plan, export, actors, HandOffLog(None), pipeline_stages=1)
        return sync._check_equal(engines, 1)

    assert check("0.1")["weight_sync/probe_logprob_abs_diff/mean"] == pytest.approx(0.05)
    with pytest.raises(RolloutError, match=r"differ .* by 0\.05 nats .*above --check-weight-update-tolerance 0\.01"):
        check("0.01")


def test_with_lora_the_sync_plan_sends_the_adapter_by_tensors_or_disk_and_refuses_nccl():
    import pytest
    from tidal.train.weight_sync import resolve_sync_plan

    def plan(*flags):
        job = parse_job(["--output-dir", "/tmp/unused-tidal-run", *flags])
        return resolve_sync_plan(job.sync, job.offload, job.placement, job.rollout, job.actor)

    assert plan().adapter is None  # full fine-tuning: the merged weights, as before
    colocated = plan("--lora-rank", "16", "--lora-target-modules", "q_proj", "v")
    assert colocated.transport == "tensor"
    assert (colocated.adapter.rank, colocated.adapter.target_modules) == (16, ("q_proj", "v_proj"))
    assert colocated.adapter.server_args(("--max-lora-rank", "64")) == (
        "--enable-lora", "--lora-target-modules", "q_proj", "v_proj",
    )  # fmt: skip
    external = plan("--lora-rank", "8", "--rollout-external-engine-addrs", "h:1")
    assert external.transport == "disk" and external.adapter.rank == 8  # nccl is the default there: disk instead
    assert plan("--lora-rank", "8", "--update-weight-transport", "disk").transport == "disk"
    with pytest.raises(ValueError, match=r"^--update-weight-transport nccl with --lora-rank 8: SGLang loads LoRA"):
        plan("--lora-rank", "8", "--update-weight-transport", "nccl", "--rollout-external-engine-addrs", "h:1")


def test_hand_off_log_writes_one_line_per_call(tmp_path: Path):
    import json

    from tidal.train.handoff import HandOffLog
    from tidal.train.weight_sync import probe_gap

    log = HandOffLog(tmp_path / "handoff.jsonl")
    log.add("engines.release")
    log.rollout = 3
    log.add("sync.tensor", version=4)
    lines = [json.loads(line) for line in (tmp_path / "handoff.jsonl").read_text().splitlines()]
    assert [(e["rollout"], e["event"]) for e in lines] == [(None, "engines.release"), (3, "sync.tensor")]
    assert lines[1]["version"] == 4
    # the probe compares the engine's response log-probs with the actor's at the response positions
    gap = probe_gap([[([1, 2, 3, 4], [-0.5, -1.0])]], [[0.0, -9.0, -0.4, -1.0]])
    assert abs(gap["weight_sync/probe_logprob_abs_diff/max"] - 0.1) < 1e-12
    assert abs(gap["weight_sync/probe_logprob_abs_diff/mean"] - 0.05) < 1e-12


def test_the_engine_sides_offer_what_the_weight_sync_calls():
    """Both engine sets the weight sync drives have every method of their protocol, with the same parameters."""
    import inspect

    from tidal.train.rollout_manager import RestartedEngines, RolloutManager
    from tidal.train.weight_sync import EngineWeights, ServingEngines

    def methods(cls):
        return {n for n, f in vars(cls).items() if inspect.isfunction(f) and not n.startswith("_")}

    for engines, protocol in ((RolloutManager, ServingEngines), (RestartedEngines, EngineWeights)):
        wanted = methods(protocol) | (methods(EngineWeights) if protocol is ServingEngines else set())
        for name in sorted(wanted):
            assert hasattr(engines, name), f"{engines.__name__} lacks {name}"
            expected = list(
                inspect.signature(getattr(protocol if name in methods(protocol) else EngineWeights, name)).parameters
            )
            assert list(inspect.signature(getattr(engines, name)).parameters)[: len(expected)] == expected, name
    # the restarted engines are only what a resync needs: no memory, update window or restart of their own
    assert methods(RestartedEngines) == methods(EngineWeights)


def test_a_wildcard_sglang_host_is_advertised_at_the_engines_node_address(tmp_path: Path):
    placement = SimpleNamespace(bundles=[], engine_node_ip=lambda engine: f"10.0.0.{engine + 1}")
    for host, expected in (("0.0.0.0", "10.0.0.2"), ("::", "10.0.0.2"), ("10.9.9.9", "10.9.9.9")):
        job = parse_job(["--sglang-host", host, "--output-dir", str(tmp_path / "o")])
        rollouts = rollout_manager_of(job, SimpleNamespace(tokenizer=None), tmp_path)
        assert rollouts._engine_host(placement, 1) == expected, host


def test_training_data_carries_the_routed_experts_and_refuses_a_sample_without_under_replay():
    import dataclasses

    import numpy as np
    import pytest

    routed = dataclasses.replace(_sample([1, 2], [3, 4], 1.0), rollout_routed_experts=np.zeros((3, 4), np.int16))
    data = rollout_data([routed, routed], group_size=2, routing_replay=True)
    assert [r.shape for r in data.routed_experts] == [(3, 4), (3, 4)]
    assert rollout_data([routed, _sample([1], [6], 0.0)], group_size=2).routed_experts is None  # off: not needed
    with pytest.raises(ValueError, match=r"--use-rollout-routing-replay: 1 of 2 samples .* \(e\.g\. sample 1\)"):
        rollout_data([routed, _sample([1], [6], 0.0)], group_size=2, rollout_id=3, routing_replay=True)
