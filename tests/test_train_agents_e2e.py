"""`train --agent-function-path` end to end: agents written with the openai client train through the gateway.

One run on the embedded model given a chat template (a copy of its checkpoint: a user's model with a template),
attached to the session's SGLang server: two rollouts of 2 groups x 2 two-turn episodes, an agent that raises on
some rows (their groups are replaced), its samples saved with their masks, and the actor trained on them.
"""

import json
import os
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # --import-mode=importlib: siblings are not importable otherwise
from test_train_modes_e2e import _records, _train
from tidal_train_plugins import AGENT_CHAT_TEMPLATE

pytestmark = pytest.mark.slow


def _chat_model(root: Path) -> Path:
    """A copy of the embedded model whose tokenizer has a chat template (what the session's server serves)."""
    from tidal.train.embedded_model import ensure_embedded_model

    model = Path(shutil.copytree(ensure_embedded_model(), root / "model"))
    config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": AGENT_CHAT_TEMPLATE}))
    return model


@pytest.fixture(scope="module")
def agent_run(tmp_path_factory, external_engine):
    root = tmp_path_factory.mktemp("agents")
    model = _chat_model(root)
    args = [
        "--recipe", "embedded", "--hf-checkpoint", str(model),
        "--rollout-external-engine-addrs", external_engine,
        "--agent-function-path", "tidal_train_plugins:arithmetic_agent",
        "--agent-max-concurrency", "3", "--agent-timeout-s", "120",
        "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--num-rollout", "2",
        "--rollout-max-response-len", "6", "--num-eval-prompts", "4", "--lr", "1e-4",
        "--save-debug-rollout-data", str(root / "debug"),
    ]  # fmt: skip
    with pytest.MonkeyPatch.context() as env:
        env.setenv("PYTHONPATH", os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]))
        code, log, leftovers = _train(args, out=root / "run")
    return root, code, log, leftovers


def test_agents_train_through_the_gateway_and_failed_groups_are_replaced(agent_run):
    from tidal.rollout import load_rollout_data
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
    for rollout_id in (0, 1):
        samples = load_rollout_data(root / "debug", rollout_id)
        assert len(samples) == 4 and [s.group_index for s in samples] == [0, 0, 1, 1]
        for s in samples:
            assert int(str(s.label)[-1]) % 2 == 1 and s.reward in (0.0, 1.0)
            mask = list(s.response_loss_mask)
            # two sampled turns (mask 1) around the template's "check" turn (mask 0, log-prob 0)
            first_gap = mask.index(0)
            assert 1 <= first_gap <= 6 and mask[first_gap:].count(1) >= 1 and sum(mask) <= 12
            gap = [i for i, m in enumerate(mask) if m == 0]
            assert all(s.response_log_probs[i] == 0.0 for i in gap)
            # (the embedded tokenizer encodes no whitespace: "user: check\n" is the ids of "user:check")
            assert "user:checkassistant:" in tokenizer.decode([s.response_ids[i] for i in gap])


def test_the_embedded_agent_recipe_trains_its_shipped_agent_and_evaluates_episodes(tmp_path, external_engine):
    # The recipe's options and agent (tidal.train.agent_task:run) on the session's server: its own chat model would
    # need a server of its own, so this run gives the embedded model a template (the learning run is in bench/).
    args = [
        "--recipe", "embedded-agent", "--hf-checkpoint", str(_chat_model(tmp_path)),
        "--rollout-external-engine-addrs", external_engine,
        "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--num-rollout", "2", "--num-eval-prompts", "3",
        "--lr", "1e-4",
    ]  # fmt: skip
    code, log, leftovers = _train(args, out=tmp_path / "run")
    assert code == 0, log[-4000:]
    assert not leftovers
    effective = (tmp_path / "run" / "config.yaml").read_text()
    assert "tidal.train.agent_task:run" in effective
    records = _records(tmp_path / "run")
    assert [r["rollout"] for r in records] == [0, 1] and all("train/loss" in r for r in records)
    for r in records:  # every episode ran (a first turn, and a second one when the model asked for the operand)
        assert r["rollout/agent/failed"] == 0 and r["rollout/agent/episodes"] == 4
        assert 1.0 <= r["rollout/agent/turns/mean"] <= 2.0
    # the held-out evaluation ran the agent's episodes: one per held-out prompt, none failed, success a share
    (failed,) = [k for k in records[-1] if k.startswith("eval/") and k.endswith("/agent_failed")]
    assert records[-1][failed] == 0.0 and 0.0 <= records[-1]["eval/accuracy"] <= 1.0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert 0.0 <= summary["eval_before"] <= 1.0
