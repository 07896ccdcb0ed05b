"""`train --agent-function-path` end to end: agents written with the openai client train through the gateway.

Runs on the embedded model given a chat template (a copy of its checkpoint: a user's model with a template),
attached to the session's SGLang server (fp32, as the actor computes):

- two rollouts of 2 groups x 2 two-turn episodes, an agent that raises on some rows (their groups are replaced)
  and gives partial credit (a graded reward), its samples saved with their masks, and the actor trained on them
  with a PPO critic (``--advantage-estimator ppo``) fitting those rewards; the engine-actor agreement (mismatch)
  metrics cover the sampled tokens only;
- --max-staleness 1 and --partial-rollout (3 prompts a rollout for 2 groups, so one group a rollout is carried
  over, running or finished) with a checkpoint after each rollout: the driver is SIGKILLed once the checkpoint of
  rollout 1 (which holds rollout 2, generated while rollout 1 trained, and the carried groups) is written, then
  resumed with --load: it trains on exactly the checkpointed episodes, takes the carried groups first, runs the
  rollout that was in flight again, and no prompt is lost or repeated;
- the embedded agent recipe's own agent, its groups filtered by dynamic sampling (every second one kept), its
  weights synced to the external engine as deltas.
"""

import json
import math
import os
import shutil
import signal
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # --import-mode=importlib: siblings are not importable otherwise
from test_train_modes_e2e import _records, _train
from tidal_train_plugins import AGENT_CHAT_TEMPLATE

pytestmark = pytest.mark.slow


AGREEMENT = ("rollout/logprob_abs_diff/mean", "rollout/logprob_abs_diff/max", "rollout/engine_actor_kl")


def _agent_model(root: Path) -> Path:
    """A copy of the embedded model whose tokenizer has AGENT_CHAT_TEMPLATE."""
    from tidal.train.embedded_model import ensure_embedded_model

    model = Path(shutil.copytree(ensure_embedded_model(), root / "model"))
    config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": AGENT_CHAT_TEMPLATE}))
    return model


def _agent_args(root: Path, model: Path, engine: str, agent: str) -> list[str]:
    """The agent runs' shared options: ``tidal_train_plugins:<agent>`` on ``model``, served by ``engine``."""
    return [
        "--recipe", "embedded", "--hf-checkpoint", str(model), "--rollout-external-engine-addrs", engine,
        "--agent-function-path", f"tidal_train_plugins:{agent}", "--agent-timeout-s", "120",
        "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
        "--rollout-max-response-len", "6", "--num-eval-prompts", "4", "--lr", "1e-4",
        "--save-debug-rollout-data", str(root / "debug"),
    ]  # fmt: skip


@pytest.fixture(scope="module")
def agent_run(tmp_path_factory, external_engine):
    root = tmp_path_factory.mktemp("agents")
    model = _agent_model(root)
    args = [*_agent_args(root, model, external_engine, "graded_arithmetic_agent"), "--agent-max-concurrency", "3",
            "--num-rollout", "2", "--advantage-estimator", "ppo"]  # fmt: skip
    with pytest.MonkeyPatch.context() as env:
        env.setenv("PYTHONPATH", os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]))
        code, log, leftovers = _train(args, out=root / "run")
    return root, code, log, leftovers


def test_agents_train_through_the_gateway_and_failed_groups_are_replaced(agent_run):
    from tidal.rollout import load_rollout_data, num_episodes
    from transformers import AutoTokenizer

    root, code, log, leftovers = agent_run
    assert code == 0, log[-4000:]
    assert not leftovers
    records = _records(root / "run")
    assert [r["rollout"] for r in records] == [0, 1] and all("train/loss" in r for r in records)
    failed = sum(r.get("rollout/agent/failed/RuntimeError", 0.0) for r in records)
    assert failed > 0 and failed == sum(r["rollout/agent/failed"] for r in records)
    for r in records:  # every kept episode took two turns; failed groups were run and dropped
        assert r["rollout/agent/episodes"] == 2 * (
            2 + r["rollout/agent/groups_dropped"] + r["rollout/agent/groups_surplus"]
        )
        assert r["rollout/agent/groups_dropped"] == r["rollout/agent/failed"] / 2
    (failure_log,) = (root / "run").rglob("agent_failures.log")
    assert failure_log.read_text().count("RuntimeError: broken agent on") == failed
    # held-out evaluation runs the agent too: of its 4 rows two have even labels, before RL and after rollout 2
    (failed_key,) = [k for k in records[-1] if k.startswith("eval/") and k.endswith("/agent_failed")]
    assert records[-1][failed_key] == 2.0 and records[-1]["eval/accuracy"] <= 0.5
    (eval_log,) = (root / "run").rglob("agent_eval_failures.log")
    assert eval_log.read_text().count("RuntimeError: broken agent on") == 4
    tokenizer = AutoTokenizer.from_pretrained(root / "model")
    forked = 0
    for rollout_id, record in zip((0, 1), records, strict=True):
        samples = load_rollout_data(root / "debug", rollout_id)
        assert num_episodes(samples) == 4 and record["rollout/num_episodes"] == 4.0
        assert len(samples) == 6 and record["rollout/agent/samples_per_episode"] == 1.5
        assert all(int(str(s.label)[-1]) % 2 == 1 and 0.0 <= s.reward <= 1.0 for s in samples)
        episodes: dict[tuple, list] = {}
        for s in samples:
            episodes.setdefault((s.group_index, s.episode), []).append(s)
        assert list(episodes) == [(0, 0), (0, 1), (1, 0), (1, 1)]
        for parts in episodes.values():
            if len(parts) == 1:
                _assert_two_sampled_turns(parts, tokenizer)
                continue
            # a rewritten history: each call's answer is a sample of its own, both with the episode's reward
            forked += 1
            assert len(parts) == 2 and all(0 not in s.response_loss_mask for s in parts)
            assert parts[0].reward == parts[1].reward and parts[0].tokens != parts[1].tokens[: len(parts[0].tokens)]
    assert forked == 4  # one episode of each group rewrote its history, and trained (train/loss above)


def _assert_two_sampled_turns(samples, tokenizer, *, offpolicy_masked: bool = False) -> None:
    """Each sample: two sampled answers (mask 1) around the template's "check" turn (mask 0, log-prob 0).

    With ``offpolicy_masked`` a sampled token may have mask 0 too (older weights sampled it).
    """
    for s in samples:
        sampled = [int(v is not None) for v in s.response_weight_versions]  # the template's tokens have no version
        first_gap = sampled.index(0)
        assert 1 <= first_gap <= 6 and sampled[first_gap:].count(1) >= 1 and sum(sampled) <= 12
        mask = list(s.response_loss_mask)
        assert all(m <= v for m, v in zip(mask, sampled, strict=True))
        assert offpolicy_masked or mask == sampled
        gap = [i for i, v in enumerate(sampled) if v == 0]
        assert all(s.response_log_probs[i] == 0.0 for i in gap)
        # (the embedded tokenizer encodes no whitespace: "user: check\n" is the ids of "user:check")
        assert "user:checkassistant:" in tokenizer.decode([s.response_ids[i] for i in gap])


def _assert_engine_and_actor_agree(records) -> None:
    # The metrics compare the engine's and the actor's log-probs on loss tokens only. Counting an agent's template
    # tokens (engine log-prob 0, the actor's far below) would put the mean far above fp32 rounding.
    for r in records:
        assert all(math.isfinite(r[k]) and r[k] >= 0.0 for k in AGREEMENT), r
        assert r["rollout/logprob_abs_diff/mean"] < 1e-3 and r["rollout/logprob_abs_diff/max"] < 1e-2, r


def test_a_critic_fits_the_agents_graded_rewards(agent_run):
    # --advantage-estimator ppo: every rollout trained the critic beside the actor (no critic-only steps) on the
    # agent samples' returns, above 0 (partial credit), over their sampled tokens (the template's are off the loss)
    from tidal.rollout import load_rollout_data

    root, code, log, _ = agent_run
    assert code == 0, log[-4000:]
    records = _records(root / "run")
    for rollout_id, r in enumerate(records):
        rewards = [s.reward for s in load_rollout_data(root / "debug", rollout_id)]
        assert max(rewards) > 0.0 and r["rollout/reward/mean"] > 0.0, rewards
        assert r["train/critic_only"] == 0.0 and r["critic/returns_mean"] > 0.0, r
        assert r["critic/value_loss"] > 0.0 and r["critic/grad_norm"] > 0.0, r


def test_agent_samples_are_covered_by_the_engine_actor_agreement_metrics(agent_run):
    root, code, log, _ = agent_run
    assert code == 0, log[-4000:]
    _assert_engine_and_actor_agree(_records(root / "run"))
    assert "--mismatch-warn-threshold" not in log


@pytest.fixture(scope="module")
def async_agent_run(tmp_path_factory, external_engine):
    """--max-staleness 1 and --partial-rollout, 4 rollouts, a checkpoint after each; SIGKILLed after checkpoint 1."""
    from tidal.rollout import load_rollout_data

    root = tmp_path_factory.mktemp("async_agents")
    model = _agent_model(root)
    tracker = root / "ckpt" / "latest_checkpointed_iteration.txt"
    args = [*_agent_args(root, model, external_engine, "steady_arithmetic_agent"), "--agent-max-concurrency", "4",
            "--num-rollout", "4", "--max-staleness", "1", "--save-interval", "1",
            "--save", str(root / "ckpt"), "--partial-rollout", "--over-sampling-batch-size", "3",
            "--mask-offpolicy-in-partial-rollout"]  # fmt: skip

    def checkpointed_rollout_1(_run_dir: Path, _log: Path) -> bool:
        return tracker.exists() and tracker.read_text().strip() == "2"

    with pytest.MonkeyPatch.context() as env:
        env.setenv("PYTHONPATH", os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]))
        killed = _train(args, out=root / "run", kill_when=checkpointed_rollout_1, group=False, poll_s=0.1)
        resume_at = int(tracker.read_text())  # 2, or 3 when the kill landed after rollout 2's checkpoint
        at_kill = resume_at, _records(root / "run"), load_rollout_data(root / "debug", resume_at)
        resumed = _train([*args, "--load", str(root / "ckpt")], out=root / "run")
    return root, args, killed, at_kill, resumed


def test_async_partial_agents_resume_the_checkpointed_episodes_and_lose_or_repeat_no_prompt(async_agent_run):
    from tidal.rollout import load_rollout_data
    from tidal.train.cli import parse_job
    from tidal.train.data import PromptDataset
    from transformers import AutoTokenizer

    root, _, (killed_code, killed_log, _), (k, records_at_kill, buffered), resumed = async_agent_run
    code, log, leftovers = resumed
    assert killed_code == -signal.SIGKILL, killed_log[-3000:]
    assert code == 0, log[-6000:]
    assert not leftovers, leftovers
    assert k in (2, 3) and [r["rollout"] for r in records_at_kill] == list(range(k))
    records = _records(root / "run")
    assert [r["rollout"] for r in records] == [0, 1, 2, 3]  # no gap, no repeat across the kill
    assert all(r["rollout/staleness_max"] <= 1 and "train/loss" in r for r in records)
    # Rollout k's episodes ran before the kill (while rollout k - 1 trained) and were in the checkpoint: trained on
    # as they were, not run again. Rollout k + 1 (in flight at the kill, if it had started) was run again.
    assert f"resumed 1 buffered rollout(s) from the checkpoint: [{k}]" in log
    again = load_rollout_data(root / "debug", k)
    assert [(list(s.prompt_ids), list(s.response_ids), s.reward) for s in again] == [
        (list(s.prompt_ids), list(s.response_ids), s.reward) for s in buffered
    ]
    assert records[k]["rollout/reward/mean"] == pytest.approx(sum(s.reward for s in buffered) / len(buffered))
    # Each rollout submits its 3 prompts and takes 2 groups (the agent never fails): one more group is carried over
    # after each, running or finished, and the checkpoint gave the resumed run the k + 1 that rollout k left.
    assert f"resumed {k + 1} carried agent group(s) from the checkpoint" in log
    for r, record in enumerate(records):
        assert record["rollout/partial/resumed_groups"] == r and record["rollout/partial/carried_over_groups"] == r + 1
        assert record["rollout/agent/groups_in_flight"] + record["rollout/agent/groups_surplus"] == r + 1
        assert record["rollout/agent/episodes"] == 4 and record["rollout/agent/groups_dropped"] == 0
    job = parse_job(["--recipe", "embedded", "--hf-checkpoint", str(root / "model")])  # the run's prompt data
    tokenizer = AutoTokenizer.from_pretrained(root / "model")
    data = PromptDataset(job.train.prompt_data, tokenizer, input_key=job.train.input_key,
                         label_key=job.train.label_key, seed=job.train.seed)  # fmt: skip
    batches = [[p.text for p in data.batch(r, 3)] for r in range(4)]
    assert len({text for batch in batches for text in batch}) == 12
    trained: list[str] = []
    for rollout_id, record in enumerate(records):
        samples = load_rollout_data(root / "debug", rollout_id)
        assert [s.group_index for s in samples] == [0, 0, 1, 1]
        _assert_two_sampled_turns(samples, tokenizer, offpolicy_masked=True)
        texts = [_prompt_of(s, batches, tokenizer) for s in samples]
        assert texts[0] == texts[1] and texts[2] == texts[3]
        # every group is a prompt of this rollout's batch or of an earlier one (carried over), counted as such
        earlier = [t for t in texts[::2] if t not in batches[rollout_id]]
        assert all(any(t in batch for batch in batches[:rollout_id]) for t in earlier)
        assert record["rollout/agent/carried_groups_taken"] == len(earlier)
        # --mask-offpolicy-in-partial-rollout: the tokens trained on were sampled by the rollout's own weights, those
        # the engines had when it began or when it ended (under --max-staleness 1 an update lands while it runs):
        # what it generated itself is never all masked away
        pairs = [pair for s in samples for pair in zip(s.response_weight_versions, s.response_loss_mask, strict=True)]
        assert 1 <= len({v for v, m in pairs if m}) <= 2
        assert 0.0 <= record["rollout/partial/offpolicy_token_frac"] < 1.0
        trained += texts[::2]
    assert sum(r["rollout/agent/carried_groups_taken"] for r in records) >= 1  # carried groups came back
    # nothing repeated, nothing lost: 8 prompts trained on once each, the other 4 of the 12 still carried at the end
    assert len(set(trained)) == 8 and records[-1]["rollout/partial/carried_over_groups"] == 12 - 8
    _assert_engine_and_actor_agree(records)


def _prompt_of(sample, batches: list[list[str]], tokenizer) -> str:
    """The prompt (of ``batches``) the sample's episode answered: its row's text is in the first call's prompt."""
    text = tokenizer.decode(list(sample.prompt_ids))
    (found,) = {p for batch in batches for p in batch if p in text}
    return found


def test_the_embedded_agent_recipe_trains_its_shipped_agent_and_evaluates_episodes(tmp_path, external_engine):
    # The recipe's options and agent (tidal.train.agent_task:run) on the session's server: its own chat model would
    # need a server of its own, so this run gives the embedded model a template (the learning run is in bench/).
    args = [
        "--recipe", "embedded-agent", "--hf-checkpoint", str(_agent_model(tmp_path)),
        "--rollout-external-engine-addrs", external_engine,
        "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--num-rollout", "2", "--num-eval-prompts", "3",
        "--lr", "1e-4",
        "--dynamic-sampling-filter-path", "tidal_train_plugins:keep_every_second_group",
        "--update-weight-delta", "--check-weight-update-equal",
        "--entropy-coef", "1e-3",  # a gradient, so weights change, even when every reward is 0 (the loss's is then 0)
    ]  # fmt: skip
    with pytest.MonkeyPatch.context() as env:
        env.setenv("PYTHONPATH", os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]))
        code, log, leftovers = _train(args, out=tmp_path / "run")
    assert code == 0, log[-4000:]
    assert not leftovers
    effective = (tmp_path / "run" / "config.yaml").read_text()
    assert "tidal.train.agent_task:run" in effective
    records = _records(tmp_path / "run")
    assert [r["rollout"] for r in records] == [0, 1] and all("train/loss" in r for r in records)
    for r in records:  # every episode ran (a first turn, and a second one when the model asked for the operand)
        assert r["rollout/agent/failed"] == 0 and 1.0 <= r["rollout/agent/turns/mean"] <= 2.0
        # --dynamic-sampling-filter-path keeps every second group: each round of 2 keeps 1, so a batch of 2 groups
        # took two rounds, 4 groups of 2 episodes, 2 of them dropped by the filter (none failed)
        assert r["rollout/agent/rounds"] == 2 and r["rollout/agent/groups_dropped"] == 2, r
        assert r["rollout/agent/episodes"] == 8 and r["rollout/agent/groups_surplus"] == 0, r
    # --update-weight-delta (by broadcast to the external engine): the first sync whole, the second the changed
    # elements only; the engine then served the actor's weights (the probe) and sampled rollout 1's agent calls
    # with them (their log-probs are the actor's)
    assert all(r["weight_sync/transport"] == "nccl" for r in records)  # the external engine: by broadcast
    assert [r["weight_sync/delta_full"] for r in records] == [1.0, 0.0]
    assert 0.0 < records[1]["weight_sync/delta_changed_share"] <= 1.0
    assert all(r["weight_sync/delta_fallbacks"] == 0.0 for r in records)
    assert all(r["weight_sync/probe_logprob_abs_diff/max"] < 1e-4 for r in records)
    _assert_engine_and_actor_agree(records)
    # the held-out evaluation ran the agent's episodes: one per held-out prompt, none failed, success a share
    (failed,) = [k for k in records[-1] if k.startswith("eval/") and k.endswith("/agent_failed")]
    assert records[-1][failed] == 0.0 and 0.0 <= records[-1]["eval/accuracy"] <= 1.0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert 0.0 <= summary["eval_before"] <= 1.0
