"""`train --environment verifiers:NAME`: environments written with `verifiers` itself, run as they are.

On the embedded model given a chat template, attached to the session's SGLang server:

- the adapter alone, through a real gateway: the multi-turn environment of ``vf_addition_check`` (its own harness,
  two model calls on one conversation) gives one trajectory that its second turn extends, scored by its rubric;
- one `train --debug-rollout-only` run on the single-turn environment of ``vf_addition`` (verifiers' own ``null``
  chat program, run as a subprocess, streaming from the gateway; held-out evaluation runs it too): the rubric's
  rewards are the samples' rewards, and the samples are the gateway's tokens (the engine's log-probs and weight
  versions). Training on agent samples is the agent tests' (tests/test_train_agents_e2e.py).
"""

import asyncio
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # --import-mode=importlib: siblings are not importable otherwise
from test_train_agents_e2e import _agent_model, _assert_two_sampled_turns
from test_train_modes_e2e import _records, _train

pytestmark = pytest.mark.slow


@pytest.fixture
def tests_on_path(monkeypatch):
    """tests/ importable here and in the processes `train` starts (the environments are modules of it)."""
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]))


def test_a_multi_turn_environment_extends_one_trajectory_through_the_gateway(tmp_path, external_engine, tests_on_path):
    from tidal.rollout import Gateway, SGLangClient
    from tidal.train.verifiers_env import VerifiersEnvironment
    from transformers import AutoTokenizer
    from vf_addition import NUM_TASKS

    tokenizer = AutoTokenizer.from_pretrained(_agent_model(tmp_path))
    env = VerifiersEnvironment("vf_addition_check")
    rows = env.rows()
    assert len(rows) == NUM_TASKS and rows[0]["prompt"] == [{"role": "user", "content": env.tasks[0].data.prompt}]
    with Gateway(SGLangClient(f"http://{external_engine}"), tokenizer, api_key="k", default_max_tokens=6) as gw:
        sessions = [gw.open_session() for _ in rows[:3]]

        async def episodes():  # at once, on one event loop: they share the environment's servers
            return await asyncio.gather(
                *(env.episode(gw.session_url(sid), gw.api_key, row) for sid, row in zip(sessions, rows, strict=False))
            )

        rewards = asyncio.run(episodes())
        for sid, row, reward in zip(sessions, rows, rewards, strict=False):
            episode = gw.close_session(sid).episode
            (sample,) = episode.samples(reward=reward, label=row["label"])  # one trajectory: the turns extend it
            assert episode.forks == 0 and episode.metrics()["turns"] == 2.0
            _assert_two_sampled_turns([sample], tokenizer)
            # the rubric scored the last answer the engine sampled
            sampled = [t for t, v in zip(sample.response_ids, sample.response_weight_versions, strict=True) if v]
            last = tokenizer.decode(sampled, skip_special_tokens=True).split("user:check")[-1]
            assert reward == float(last.strip() == env.tasks[row["task"]].data.answer), (last, reward)
    assert not env._served  # the last episode on the loop stopped the environment's servers


@pytest.fixture(scope="module")
def environment_run(tmp_path_factory, external_engine):
    root = tmp_path_factory.mktemp("environment")
    model = _agent_model(root)
    args = [
        "--recipe", "embedded", "--hf-checkpoint", str(model), "--rollout-external-engine-addrs", external_engine,
        "--environment", "verifiers:vf_addition", "--agent-timeout-s", "120", "--agent-max-concurrency", "4",
        "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--num-rollout", "1",
        "--rollout-max-response-len", "4", "--num-eval-prompts", "1", "--debug-rollout-only",
        "--save-debug-rollout-data", str(root / "debug"),
    ]  # fmt: skip
    with pytest.MonkeyPatch.context() as env:
        env.setenv("PYTHONPATH", os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]))
        env.setenv("TIDAL_CACHE", str(root / "cache"))
        code, log, leftovers = _train(args, out=root / "run")
    return root, code, log, leftovers


def test_the_rubric_rewards_the_gateway_sampled_tokens_of_a_train_run(environment_run, tests_on_path):
    import json

    from tidal.rollout import load_rollout_data
    from transformers import AutoTokenizer
    from verifiers.v1 import TasksetConfig
    from vf_addition import AdditionTaskset, expected_reward

    root, code, log, leftovers = environment_run
    assert code == 0, log[-4000:]
    assert not leftovers
    (record,) = _records(root / "run")
    assert record["rollout/agent/episodes"] == 4 and record["rollout/agent/failed"] == 0
    assert record["eval/accuracy"] in (0.0, 0.5, 1.5)  # held-out: the environment's first task, its rubric's reward
    (rows_file,) = (root / "cache" / "environments").glob("verifiers_vf_addition-*.jsonl")
    rows = [json.loads(line) for line in rows_file.read_text().splitlines()]
    assert [r["task"] for r in rows] == list(range(len(rows))) and {r["environment"] for r in rows} == {
        "verifiers:vf_addition"
    }
    answers = [t.data.answer for t in AdditionTaskset(TasksetConfig(id="vf_addition")).load()]  # built again here
    tokenizer = AutoTokenizer.from_pretrained(root / "model")
    samples = load_rollout_data(root / "debug", 0)
    assert len(samples) == 4 and len({s.group_index for s in samples}) == 2
    for s in samples:
        # the gateway's tokens: every response token sampled by the engine, with its log-prob and weight version
        assert all(v is not None for v in s.response_weight_versions) and list(s.response_loss_mask) == [1] * len(
            s.response_ids
        )
        assert all(lp <= 0.0 for lp in s.response_log_probs) and any(lp < 0.0 for lp in s.response_log_probs)
        text = tokenizer.apply_chat_template(rows[int(s.label)]["prompt"], tokenize=False, add_generation_prompt=True)
        assert list(s.prompt_ids) == tokenizer.encode(text, add_special_tokens=False)
        reply = tokenizer.decode(s.response_ids, skip_special_tokens=True)
        # the environment's rubric (weights 1.0 and 0.5) scored exactly this reply
        assert s.reward == expected_reward(reply, answers[int(s.label)]), (reply, s.reward)
    assert record["rollout/reward/mean"] == pytest.approx(sum(s.reward for s in samples) / 4)
