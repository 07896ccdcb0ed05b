"""Agent episodes through the gateway: GRPO groups, concurrency, timeouts and failures (the real SGLang server)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from tidal.rollout import RolloutError, SGLangClient, episode_ids, num_episodes, rollout_metrics
from tidal.rollout.gateway import Gateway
from tidal.rollout.gateway.agents import AgentRunner, agent_rollout, load_agent_fn


@pytest.fixture
def gateway(sglang_server, chat_tokenizer) -> Iterator[Gateway]:
    with Gateway(SGLangClient(sglang_server.url), chat_tokenizer, context_length=512) as gw:
        yield gw


def _rows(*modes: str) -> list[tuple[dict, str]]:
    return [({"prompt": f"add {i} and 2", "mode": mode}, f"label{i}") for i, mode in enumerate(modes)]


def test_groups_of_episodes_replace_a_failed_group_and_record_why(gateway, plugins, tmp_path) -> None:
    """--agent-function-path's episodes: a raising agent and one past --agent-timeout-s fail their groups."""
    agent = load_agent_fn("tidal_rollout_agents:two_turns")
    log = tmp_path / "agent_failures.log"
    runner = AgentRunner(gateway, agent, n_samples_per_prompt=2, max_concurrency=3, timeout_s=8.0, failure_log=log)
    rounds = {1: _rows("ok", "raise", "ok"), 2: _rows("stall", "ok")}
    result = agent_rollout(runner, rounds.__getitem__, num_groups=3, max_rounds=2)
    samples = result.samples
    assert [s.group_index for s in samples] == [0, 0, 1, 1, 2, 2]
    assert [s.label for s in samples] == ["label0", "label0", "label2", "label2", "label1", "label1"]
    for s in samples:  # each episode: one sample of two sampled turns with the user turn between, masked out
        assert s.reward in (0.0, 1.0) and s.response_loss_mask[0] == 1 and 0 in s.response_loss_mask
        assert sum(s.response_loss_mask) <= 8
    metrics = result.metrics
    assert metrics["rollout/agent/episodes"] == 10 and metrics["rollout/agent/failed"] == 4
    assert metrics["rollout/agent/failed/ValueError"] == 2 and metrics["rollout/agent/failed/timeout"] == 2
    assert metrics["rollout/agent/rounds"] == 2 and metrics["rollout/agent/groups_dropped"] == 2
    assert metrics["rollout/agent/turns/mean"] == pytest.approx(6 * 2 / 10)
    text = log.read_text()
    assert text.count("ValueError: no tool for 'add 1 and 2'") == 2 and "Traceback" in text
    assert text.count(" timeout row=") == 2 and "the agent ran past --agent-timeout-s 8" in text
    assert not gateway.sessions  # every session closed, the failed ones too


def test_an_episode_that_rewrote_its_history_gives_a_sample_per_trajectory_in_its_place(gateway, plugins) -> None:
    """A fork's trajectories stay together, in their group, with the episode's reward and index (one episode)."""
    agent = load_agent_fn("tidal_rollout_agents:two_turns")
    runner = AgentRunner(gateway, agent, n_samples_per_prompt=2, max_concurrency=4, timeout_s=10.0)
    result = agent_rollout(runner, lambda r: _rows("rewrite", "ok"), num_groups=2, max_rounds=1)
    samples = result.samples
    assert [(s.group_index, s.episode) for s in samples] == [(0, 0), (0, 0), (0, 1), (0, 1), (1, 0), (1, 1)]
    assert episode_ids(samples) == [0, 0, 1, 1, 2, 3] and num_episodes(samples) == 4
    for first, second in (samples[0:2], samples[2:4]):  # one sampled call each, from its own prompt
        assert first.reward == second.reward and 0 not in first.response_loss_mask + second.response_loss_mask
        assert first.tokens != second.tokens[: len(first.tokens)]
    assert all(0 in s.response_loss_mask for s in samples[4:])  # the extending episodes: one sample, two turns
    assert result.metrics["rollout/agent/samples_per_episode"] == 1.5
    assert result.metrics["rollout/agent/forks/mean"] == 0.5
    assert rollout_metrics(samples)["rollout/num_episodes"] == 4.0


def test_every_rollout_of_a_runner_runs_on_one_event_loop_open_until_it_closes(gateway, plugins) -> None:
    """Clients an agent makes per episode and never closes outlive their rollout on an open loop."""
    import tidal_rollout_agents

    agent = load_agent_fn("tidal_rollout_agents:two_turns")
    runner = AgentRunner(gateway, agent, n_samples_per_prompt=2, max_concurrency=4, timeout_s=10.0)
    tidal_rollout_agents.LOOPS.clear()
    for _ in range(2):
        agent_rollout(runner, lambda r: _rows("ok"), num_groups=1, max_rounds=1)
    loops = tidal_rollout_agents.LOOPS
    assert len(loops) == 4 and all(loop is loops[0] for loop in loops)
    assert not loops[0].is_closed()
    runner.close()
    assert loops[0].is_closed()
    runner.close()


def test_a_batch_still_short_after_the_last_round_is_one_line(gateway, plugins) -> None:
    agent = load_agent_fn("tidal_rollout_agents:two_turns")
    runner = AgentRunner(gateway, agent, n_samples_per_prompt=2, max_concurrency=4, timeout_s=5.0)
    with pytest.raises(RolloutError, match=r"kept 0 of 1 groups after 1 rounds .*'no_model_call': 2"):
        agent_rollout(runner, lambda r: _rows("silent"), num_groups=1, max_rounds=1)


def test_an_agent_path_that_is_not_an_async_function_is_refused(plugins) -> None:
    with pytest.raises(ValueError, match=r"--agent-function-path 'tidal_rollout_agents:not_async': must be 'async def"):
        load_agent_fn("tidal_rollout_agents:not_async")
    with pytest.raises(ValueError, match="--agent-function-path"):
        load_agent_fn("tidal_rollout_agents:absent")
