"""Partial rollout's carry-over goes into the checkpoint and comes back on resume: no unfinished group is dropped."""

from __future__ import annotations

import io
import logging
from types import SimpleNamespace

import torch
from tidal.ckpt import TrainerState
from tidal.rollout import Sample
from tidal.train.cli import parse_job
from tidal.train.driver_rollouts import DriverRollouts

NO_ENGINES = SimpleNamespace(engines=[], router=None)  # the strategy choice only reads these two


def _rollouts(*flags: str) -> DriverRollouts:
    return DriverRollouts(parse_job(list(flags)), NO_ENGINES, None, None, tokenizer=None)


def _group(prompt: list[int], label: str, n: int) -> list[Sample]:
    return [
        Sample(
            prompt_ids=prompt,
            response_ids=[5 + i, 6],
            response_log_probs=[-0.25 * (i + 1), -1.5],
            finish_reason="abort",
            label=label,
            group_index=3,
            weight_version="2",
            response_weight_versions=["2", "2"],
        )
        for i in range(n)
    ]


def test_carry_over_round_trips_through_the_checkpoint_state():
    before = _rollouts("--partial-rollout", "--over-sampling-batch-size", "6")
    assert before.carry_state() is None  # nothing carried: nothing saved
    before.carry = [_group([1, 2, 3], "4", 2), _group([9], "x", 1)]
    state = TrainerState.capture(rollout_id=4, weight_version=2, rollout_carry=before.carry_state())
    buffer = io.BytesIO()
    torch.save(state.to_dict(), buffer)  # what the checkpoint's common state holds
    buffer.seek(0)
    loaded = TrainerState.from_dict(torch.load(buffer, weights_only=True))

    after = _rollouts("--partial-rollout", "--over-sampling-batch-size", "6")
    after.restore_carry(loaded.rollout_carry)
    assert after.carry == before.carry  # every field of every unfinished sample


def test_carry_over_without_partial_rollout_is_dropped_with_a_warning(caplog):
    carried = _rollouts("--partial-rollout", "--over-sampling-batch-size", "6")
    carried.carry = [_group([1, 2], "4", 1)]
    plain = _rollouts()
    with caplog.at_level(logging.WARNING):
        plain.restore_carry(carried.carry_state())
    assert plain.carry == []
    assert "--partial-rollout is off" in caplog.text
