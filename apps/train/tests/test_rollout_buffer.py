"""The rollout buffer: the staleness bound's gate and the checkpoint (the masking: packages/rollout test_staleness).

The buffer's producer calls the rollout manager's ``generate(rollout_id)`` from its thread; here a recorder with
the same two methods stands for the manager, so that the order of generation and training can be asserted exactly
(the end-to-end run with real engines is in tests/test_train_modes_e2e.py).
"""

from __future__ import annotations

import threading
import time

import pytest
from tidal.rollout import Sample
from tidal.train.cli import parse_job
from tidal.train.rollout_buffer import RolloutBuffer


def _sample(versions: list[str], mask: list[int] | None = None) -> Sample:
    return Sample(
        prompt_ids=[1, 2],
        response_ids=[3] * len(versions),
        response_log_probs=[-0.5] * len(versions),
        finish_reason="stop",
        weight_version=versions[-1],
        response_loss_mask=mask,
        response_weight_versions=versions,
    )


class Recorder:
    """Generates one sample per rollout, under the weight version the trainer last synced; logs each call."""

    def __init__(self) -> None:
        self.version = 0
        self.events: list[tuple[str, int]] = []
        self.lock = threading.Lock()

    def generate(self, rollout_id: int):
        with self.lock:
            self.events.append(("generate", rollout_id))
            version = self.version
        return [_sample([str(version)] * 2)], {"time/generate": 0.0}

    def carry_state(self):
        return None


def _buffer(rollouts, *flags: str) -> RolloutBuffer:
    train = parse_job(["--no-colocate", "--rollout-num-gpus", "1", *flags]).train
    return RolloutBuffer(rollouts, max_staleness=train.max_staleness, num_rollout=train.num_rollout)


def test_one_step_off_generates_the_next_rollout_while_training_and_never_runs_further_ahead():
    recorder = Recorder()
    with _buffer(recorder, "--max-staleness", "1", "--num-rollout", "4") as buffer:
        for rollout_id in range(4):
            _, metrics = buffer.take(rollout_id, version=rollout_id)
            deadline = time.monotonic() + 10
            while ("generate", rollout_id + 1) not in recorder.events and rollout_id < 3:
                assert time.monotonic() < deadline, recorder.events
                time.sleep(0.01)  # rollout k + 1 starts while the "actor" trains on rollout k
            time.sleep(0.05)
            with recorder.lock:  # but not rollout k + 2: the engines wait for the weights of version k + 1
                assert ("generate", rollout_id + 2) not in recorder.events
                recorder.events.append(("trained", rollout_id))
                recorder.version = rollout_id + 1  # the weight sync
            assert metrics["rollout/staleness_max"] <= 1.0
            assert metrics["rollout/staleness_max"] == (0.0 if rollout_id == 0 else 1.0)
            assert {"time/trainer_wait", "time/engine_wait", "rollout/stale_tokens_masked"} <= set(metrics)
    order = [e for e in recorder.events if e[0] == "generate"]
    assert order == [("generate", j) for j in range(4)]  # each rollout once, in order, nothing past --num-rollout


def test_buffered_rollouts_survive_a_checkpoint_and_are_trained_on_after_resume():
    recorder = Recorder()
    with _buffer(recorder, "--max-staleness", "2", "--num-rollout", "5") as buffer:
        buffer.take(0, version=0)
        deadline = time.monotonic() + 10
        while len([e for e in recorder.events if e[0] == "generate"]) < 3:  # 1 and 2 run ahead of version 0
            assert time.monotonic() < deadline, recorder.events
            time.sleep(0.01)
        carry, buffered = buffer.checkpoint_state()
    assert carry is None and [b["rollout_id"] for b in buffered] == [1, 2]

    resumed_recorder = Recorder()
    resumed_recorder.version = 1
    with _buffer(resumed_recorder, "--num-rollout", "5") as resumed:  # even synchronously
        resumed.restore(buffered, start=1)
        samples, metrics = resumed.take(1, version=1)
        assert samples[0].weight_version == "0" and metrics["rollout/staleness_max"] == 1.0
        resumed.take(2, version=2)
        assert resumed_recorder.events == []  # both came from the checkpoint, none was generated again
        resumed.take(3, version=3)
        assert resumed_recorder.events == [("generate", 3)]


def test_a_failed_generation_reaches_the_trainer():
    class Failing(Recorder):
        def generate(self, rollout_id: int):
            raise ValueError(f"engine gone at rollout {rollout_id}")

    buffer = _buffer(Failing(), "--max-staleness", "1")
    with buffer, pytest.raises(ValueError, match="engine gone at rollout 0"):
        buffer.take(0, version=0)
