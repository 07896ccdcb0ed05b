"""Partial rollout of agent groups: groups outlive their rollout, are taken first, checkpoint, resume (real SGLang)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator

import pytest
from tidal.rollout import AgentGroupPool, CallHold, SGLangClient, partial_agent_rollout, samples_from_records
from tidal.rollout.gateway import Gateway
from tidal.rollout.gateway.agents import AgentRunner, load_agent_fn


@pytest.fixture
def gateway(sglang_server, chat_tokenizer) -> Iterator[Gateway]:
    with Gateway(SGLangClient(sglang_server.url), chat_tokenizer, context_length=512) as gw:
        yield gw


def _pool(gateway: Gateway, concurrency: int) -> AgentGroupPool:
    agent = load_agent_fn("tidal_rollout_agents:two_turns")
    runner = AgentRunner(gateway, agent, n_samples_per_prompt=2, max_concurrency=concurrency, timeout_s=30.0)
    return AgentGroupPool(runner)


def _row(name: str, mode: str = "ok", **extra) -> tuple[dict, str]:
    return {"prompt": f"add {name} and 2", "mode": mode, **extra}, f"label-{name}"


def _wait(condition, what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"still waiting for {what}"
        time.sleep(0.05)


@pytest.fixture
def versioned(sglang_server, tiny_model_dir) -> Iterator[SGLangClient]:
    """The session's server serving its weights as version "partial-v0"; its former version label again after."""
    client = SGLangClient(sglang_server.url)
    before = client.get_model_info().get("weight_version")
    client.update_weights_from_disk(tiny_model_dir, weight_version="partial-v0")
    yield client
    client.update_weights_from_disk(tiny_model_dir, weight_version=before)


def test_a_group_running_when_the_batch_is_full_runs_on_and_the_next_rollout_takes_it_first(
    gateway, versioned, tiny_model_dir, plugins
) -> None:
    def version() -> str | None:
        return versioned.get_model_info().get("weight_version")

    pool = _pool(gateway, 6)  # three groups of two episodes at once
    try:
        rows = [_row("a"), _row("b"), _row("slow", "pause", pause_s=3.0)]
        first = partial_agent_rollout(pool, {1: rows}.__getitem__, rollout_id=0, num_groups=2, max_rounds=1,
                                      current_version=version)  # fmt: skip
        assert sorted({s.label for s in first.samples}) == ["label-a", "label-b"]
        m = first.metrics
        assert m["rollout/agent/groups_in_flight"] == 1 and m["rollout/partial/carried_over_groups"] == 1
        assert m["rollout/partial/resumed_groups"] == 0 and m["rollout/agent/carried_groups_taken"] == 0
        assert m["rollout/agent/episodes"] == 4 and m["rollout/agent/groups_surplus"] == 0
        # the slow group's episodes are still open, their first call answered by version partial-v0
        _wait(lambda: len(gateway.sessions) == 2 and all(s.calls == 1 for s in gateway.sessions.values()),
              "the slow group's first calls")  # fmt: skip
        versioned.update_weights_from_disk(tiny_model_dir, weight_version="partial-v1")  # "training" happened
        second = partial_agent_rollout(pool, {1: [_row("c")]}.__getitem__, rollout_id=1, num_groups=2, max_rounds=1,
                                       current_version=version, mask_offpolicy=True)  # fmt: skip
    finally:
        pool.close()
    m = second.metrics
    assert m["rollout/partial/resumed_groups"] == 1 and m["rollout/agent/carried_groups_taken"] == 1
    assert m["rollout/partial/carried_over_groups"] == 0 and m["rollout/agent/groups_in_flight"] == 0
    assert 0.0 < m["rollout/partial/offpolicy_token_frac"] < 1.0
    slow = [s for s in second.samples if s.label == "label-slow"]
    fresh = [s for s in second.samples if s.label == "label-c"]
    assert len(slow) == 2 and len(fresh) == 2 and {s.group_index for s in slow} != {s.group_index for s in fresh}
    for s in slow:  # the first answer sampled by the old weights (masked out), the second by the new (trained on)
        pairs = list(zip(s.response_weight_versions, s.response_loss_mask, strict=True))
        old = [mask for v, mask in pairs if v == "partial-v0"]
        new = [mask for v, mask in pairs if v == "partial-v1"]
        assert old and new and set(old) == {0} and set(new) == {1}
    for s in fresh:  # all sampled by the new weights: nothing masked but the template's tokens
        assert {v for v in s.response_weight_versions if v is not None} == {"partial-v1"}
        assert all(m == 1 for v, m in zip(s.response_weight_versions, s.response_loss_mask, strict=True) if v)
    assert not gateway.sessions


def test_a_checkpointed_pool_keeps_its_finished_groups_and_runs_the_running_ones_again_from_their_rows(
    gateway, plugins
) -> None:
    pool = _pool(gateway, 8)  # all four groups at once
    rows = [_row("a"), _row("b"), _row("c"), _row("slow", "pause", pause_s=2.0)]
    try:
        first = partial_agent_rollout(pool, {1: rows}.__getitem__, rollout_id=0, num_groups=2, max_rounds=1)
        _wait(lambda: pool.counts() == (1, 1), "the third fast group to finish")
        state = json.loads(json.dumps(pool.state()))  # what a checkpoint holds: plain JSON
    finally:
        pool.close()  # the run stops: the slow group's episodes are cancelled, their sessions closed
    assert not gateway.sessions
    taken = {s.label for s in first.samples}
    (surplus,) = {"label-a", "label-b", "label-c"} - taken
    assert [(g["label"], "episodes" in g, g["started_in"]) for g in state] == [(surplus, True, 0),
                                                                               ("label-slow", False, 0)]  # fmt: skip
    # the third fast group finished after the batch was full, or just before it was taken: either way it waits
    m = first.metrics
    assert m["rollout/agent/groups_surplus"] + m["rollout/agent/groups_in_flight"] == 2
    assert m["rollout/partial/carried_over_groups"] == 2

    restored = _pool(gateway, 8)
    try:
        restored.restore(state)
        assert restored.counts() == (1, 1)
        second = partial_agent_rollout(restored, {1: []}.__getitem__, rollout_id=1, num_groups=2, max_rounds=1)
    finally:
        restored.close()
    m = second.metrics
    assert m["rollout/partial/resumed_groups"] == 2 and m["rollout/agent/carried_groups_taken"] == 2
    assert m["rollout/agent/episodes"] == 4 and m["rollout/partial/carried_over_groups"] == 0
    # the finished group comes back exactly as it was saved, first; the running one ran again, from its row
    assert [s.label for s in second.samples] == [surplus, surplus, "label-slow", "label-slow"]
    saved = [s for episode in state[0]["episodes"] for s in samples_from_records(episode["samples"])]
    assert [(list(s.tokens), s.reward) for s in second.samples[:2]] == [(list(s.tokens), s.reward) for s in saved]
    for s in second.samples[2:]:  # two sampled turns each
        assert s.response_loss_mask[0] == 1 and 0 in s.response_loss_mask and s.response_loss_mask[-1] == 1


def test_held_engine_calls_wait_for_the_release_and_a_hold_past_its_bound_fails_the_episode(
    sglang_server, chat_tokenizer, plugins
) -> None:
    hold = CallHold(timeout_s=1.0)
    engine = hold.wrap(SGLangClient(sglang_server.url))
    with Gateway(engine, chat_tokenizer, context_length=512) as gateway:
        pool = _pool(gateway, 4)
        try:
            hold.hold()  # the engines give their memory away: no call goes out
            pool.submit(*_row("a"), started_in=0)
            time.sleep(0.5)
            assert pool.counts() == (1, 0) and [s.calls for s in gateway.sessions.values()] == [0, 0]
            hold.release()
            group = pool.next_finished()
            assert group is not None and all(r.failure is None and r.samples for r in group.results)
            hold.hold()  # held for longer than its bound: the call gets a 503, and the agent's episode fails
            pool.submit(*_row("b"), started_in=0)
            group = pool.next_finished()
            assert group is not None and all(r.failure is not None for r in group.results)
        finally:
            hold.release()
            pool.close()


def test_a_held_engines_stream_waits_for_the_release_too(sglang_server) -> None:
    hold = CallHold(timeout_s=30.0)
    engine = hold.wrap(SGLangClient(sglang_server.url))
    chunks: list[dict] = []
    hold.hold()
    try:
        reader = threading.Thread(
            target=lambda: chunks.extend(engine.generate_stream([1, 2, 3], {"max_new_tokens": 4, "ignore_eos": True}))
        )
        reader.start()
        reader.join(timeout=1.0)
        assert reader.is_alive() and not chunks  # nothing went out while held
    finally:
        hold.release()
    reader.join(timeout=60.0)
    assert not reader.is_alive() and chunks and chunks[-1]["finish_reason"] is not None
    assert len(chunks[-1]["output_ids"]) == 4
