"""`train` through sglang-router in front of two real engines: a custom generate function, dynamic sampling, PPO, TP=2,
one step off (``--max-staleness 1``) with delta weight syncs.

One run, attached to the session's two SGLang servers (``external_engine``, ``second_external_engine``) with the
router on (the default with two engines, ``round_robin`` so both get requests), the embedded actor training in two
tensor-parallel ranks with a critic (``--advantage-estimator ppo``), its weights broadcast to both engines, whole at
the first sync and as deltas after it (``--update-weight-delta``), each rollout generated while the actor trains on
the one before (``--max-staleness 1``):

- ``--custom-generate-function-path``: every training sample is made by the test's two-turn function, in the driver,
  through the router; evaluation calls it in the engines' own workers;
- ``--dynamic-sampling-filter-path`` keeps only the prompts the test lists, so each round's outcome is known:
  rollout 0 keeps one group in round 1 and fills its batch in round 2 (``--dynamic-sampling-max-rounds 2``), and
  its ``rollout/dynamic_sampling/*`` metrics are in metrics.jsonl; rollout 1 keeps both groups of round 1, generated
  by the initial weights while rollout 0 trains; rollout 2 keeps nothing in either round, and once rollout 1 has
  trained and synced the run stops with one line naming --dynamic-sampling-max-rounds.
"""

import json
import os
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # --import-mode=importlib: siblings are not importable otherwise
from test_train_modes_e2e import _records, _train
from tidal_train_plugins import TOOL_IDS

pytestmark = pytest.mark.slow

ARGS = [
    "--rollout-batch-size", "2",
    "--n-samples-per-prompt", "2",
    "--rollout-max-response-len", "6",
    "--num-eval-prompts", "4",
    "--num-rollout", "3",
    "--over-sampling-batch-size", "2",
    "--dynamic-sampling-filter-path", "tidal_train_plugins:keep_listed_prompts",
    "--dynamic-sampling-max-rounds", "2",
    "--custom-generate-function-path", "tidal_train_plugins:two_turns_with_a_tool",
    "--use-router",  # the default with two engines; test_train_modes_e2e's --no-use-router run starts none
    "--sglang-router-policy", "round_robin",
    "--advantage-estimator", "ppo",  # a critic trains beside the actor
    "--custom-rm-path", "tidal_train_plugins:reward_by_length",  # returns above 0, so the critic has a loss
    "--tensor-model-parallel-size", "2", "--actor-num-gpus-per-node", "2",
    "--check-weight-update-equal",  # each sync checked on both engines
    "--max-staleness", "1",  # rollout k + 1 generated while the actor trains on k
    "--update-weight-delta",  # the second sync sends only the changed elements
]  # fmt: skip


def _rounds(args: list[str]) -> list[list[tuple[int, ...]]]:
    """Prompt ids of the rounds of rollouts 0 to 2, as `train` draws them: [r0 round 1, r0 round 2, r1 ...]."""
    from tidal.train.cli import parse_job
    from tidal.train.data import PromptDataset
    from transformers import AutoTokenizer

    job = parse_job(args)
    tokenizer = AutoTokenizer.from_pretrained(job.actor.hf_checkpoint)
    keys = {"input_key": job.train.input_key, "label_key": job.train.label_key, "seed": job.train.seed}
    data = PromptDataset(job.train.prompt_data, tokenizer, **keys)
    rounds = []
    for rollout_id in (0, 1, 2):
        rounds.append([p.ids for p in data.batch(rollout_id, 2)])
        rounds.append([p.ids for p in data.more_batch(rollout_id, 2, 2, max_rounds=2)])
    return rounds


@pytest.fixture(scope="module")
def routed(tmp_path_factory, external_engine, second_external_engine, external_engine_logs):
    root = tmp_path_factory.mktemp("routed")
    engines = [external_engine, second_external_engine]
    args = [*ARGS, "--rollout-external-engine-addrs", *engines, "--save-debug-rollout-data", str(root / "debug")]
    rounds = _rounds(args)
    keep = [rounds[0][0], rounds[1][0], *rounds[2]]  # rollout 0: the first prompt of each round; rollout 1: round 1
    assert not set(keep) & {rounds[0][1], rounds[1][1], *rounds[4], *rounds[5]}  # the data's seeded order allows it
    (root / "keep.json").write_text(json.dumps([list(ids) for ids in keep]))
    requests_before = [external_engine_logs[e].read_text().count("POST /generate") for e in engines]
    with pytest.MonkeyPatch.context() as env:
        env.setenv("PYTHONPATH", os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]))
        env.setenv("TIDAL_TEST_KEEP", str(root / "keep.json"))
        env.setenv("TIDAL_TEST_CALLS", str(root / "calls.txt"))
        code, log, leftovers = _train(args, out=root / "run")
    requests = [
        external_engine_logs[e].read_text().count("POST /generate") - n
        for e, n in zip(engines, requests_before, strict=True)
    ]
    return root, rounds, keep, (code, log, leftovers), requests


def test_dynamic_sampling_fills_rollout_0_in_its_second_round_and_writes_its_metrics(routed):
    from tidal.rollout import load_rollout_data

    root, _, keep, (_, log, _), _ = routed
    record, second = _records(root / "run")  # rollout 2 stopped the run before its record
    assert record["rollout"] == 0 and "train/loss" in record  # the actor trained on the filtered batch
    assert {k: v for k, v in record.items() if k.startswith("rollout/dynamic_sampling/")} == {
        "rollout/dynamic_sampling/rounds": 2.0,
        "rollout/dynamic_sampling/groups_generated": 3.0,  # round 1's two, round 2's first (it filled the batch)
        "rollout/dynamic_sampling/groups_dropped": 1.0,
        "rollout/dynamic_sampling/groups_surplus": 0.0,
        "rollout/dynamic_sampling/kept_frac": pytest.approx(2 / 3),
    }
    samples = load_rollout_data(root / "debug", 0)
    assert [tuple(s.prompt_ids) for s in samples] == [keep[0]] * 2 + [keep[1]] * 2
    assert "dynamic sampling: 1/2 groups kept after round 1; round 2" in log
    assert second["rollout/dynamic_sampling/rounds"] == 1.0 and second["rollout/dynamic_sampling/groups_dropped"] == 0
    assert [tuple(s.prompt_ids) for s in load_rollout_data(root / "debug", 1)] == [k for k in keep[2:] for _ in "ab"]


def test_the_custom_generate_function_made_every_sample_through_the_router_and_in_the_workers(routed):
    from tidal.rollout import load_rollout_data

    root, _, _, (_, log, _), requests = routed
    samples = load_rollout_data(root / "debug", 0) + load_rollout_data(root / "debug", 1)
    for s in samples:  # two turns around the tool's tokens, which the loss does not see
        mask = list(s.response_loss_mask)
        first = mask.index(0)
        assert mask[first : first + len(TOOL_IDS)] == [0] * len(TOOL_IDS) and mask.count(0) == len(TOOL_IDS)
        assert tuple(s.response_ids[first : first + len(TOOL_IDS)]) == TOOL_IDS and 1 <= first <= 2
    callers = {line.split(" ", 1)[1] for line in (root / "calls.txt").read_text().splitlines()}
    assert any(c.endswith("tidal/train/cli.py") for c in callers), callers  # the driver: rollouts, via the router
    assert any("default_worker.py" in c for c in callers), callers  # an engine's Ray worker: evaluation
    assert re.search(r"starting sglang-router at \S+: .* --worker-urls \S+ \S+ --policy round_robin", log)
    assert all(n > 0 for n in requests), requests  # round robin: both engines served the run


def test_a_batch_still_short_after_the_last_round_stops_the_run_with_one_line(routed):
    _, _, _, (code, log, leftovers), _ = routed
    assert code == 1, log[-4000:]
    errors = [line for line in log.splitlines() if line.startswith("train: error:")]
    assert len(errors) == 1, log[-4000:]
    assert re.match(
        r"train: error: dynamic sampling kept 0 of 2 groups after 2 round\(s\) \(4 groups generated, 4 dropped by "
        r"the filter\); the prompts are too easy or too hard for the policy: raise --dynamic-sampling-max-rounds or "
        r"--over-sampling-batch-size, or change --dynamic-sampling-filter-path \(traceback in .*error\.log\)$",
        errors[0],
    ), errors[0]
    assert not leftovers, leftovers


def test_the_tp2_actor_and_its_critic_trained_and_both_engines_serve_the_synced_weights(routed):
    root, *_ = routed
    records = _records(root / "run")
    assert [r["rollout"] for r in records] == [0, 1]
    # --tensor-model-parallel-size 2: two ranks
    assert sorted(p.name for p in (root / "run" / "logs").glob("actor_r*.log")) == ["actor_r0.log", "actor_r1.log"]
    for record in records:
        # --advantage-estimator ppo: the critic trained beside the actor on the filtered, custom-generated batch
        # (--custom-rm-path: each sample's reward is its response length / 10, the returns the critic fits)
        assert record["train/critic_only"] == 0.0 and record["rollout/reward/mean"] > 0.0
        assert record["critic/returns_mean"] > 0.0 and record["critic/value_loss"] > 0.0
        assert record["critic/grad_norm"] > 0.0
        # decoupled: the gathered weights went to both engines by broadcast, and both serve them (the probe)
        assert record["weight_sync/transport"] == "nccl"
        probe = record["weight_sync/probe_logprob_abs_diff/max"]
        assert probe < 1e-4, probe
    # the TP ranks' log-probs agree with the fp32 engines' on the tokens sampled by the weights they hold (rollout 0;
    # rollout 1 was sampled one version behind, the gap --use-tis corrects)
    assert records[0]["rollout/logprob_abs_diff/mean"] < 1e-3, records[0]["rollout/logprob_abs_diff/mean"]


def test_one_step_off_through_the_router_with_delta_syncs(routed):
    from tidal.rollout import load_rollout_data

    root, *_ = routed
    records = _records(root / "run")
    # --max-staleness 1: rollout 1 was generated (by the custom function, through the router) by the initial weights
    # while the actor trained on rollout 0, and trained on with the off-policy correction
    assert [r["rollout/weight_version"] for r in records] == [0.0, 0.0]
    assert [r["rollout/staleness_max"] for r in records] == [0.0, 1.0]
    assert all(s.weight_version == "0" for s in load_rollout_data(root / "debug", 1))
    assert "train/tis" in records[1]
    # --update-weight-delta: the first sync whole, the second only the changed elements, and after each both engines
    # serve the actor's weights (the probe, in the test above)
    assert [r["weight_sync/delta_full"] for r in records] == [1.0, 0.0]
    assert 0.0 < records[1]["weight_sync/delta_changed_share"] <= 1.0
    assert all(r["weight_sync/delta_fallbacks"] == 0.0 for r in records)
