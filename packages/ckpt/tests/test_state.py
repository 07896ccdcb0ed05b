"""TrainerState: the driver's counters and RNG streams round-trip through a checkpoint exactly."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from megatron.core.dist_checkpointing import ShardedTensor
from tidal.ckpt import CheckpointError, TrainerState, load_checkpoint, save_checkpoint

BATCH = 4
# two unfinished groups of one sample each, as tidal.rollout.sample_records writes them (plain JSON types)
CARRY = [
    [{"prompt_ids": [1, 2], "response_ids": [7], "response_log_probs": [-0.5], "finish_reason": "abort", "label": "4"}],
    [{"prompt_ids": [3], "response_ids": [], "response_log_probs": [], "finish_reason": "abort", "label": None}],
]
BUFFER = [{"rollout_id": 42, "samples": CARRY[0], "metrics": {"time/generate": 0.5}}]


def _model(value: float) -> dict:
    return {"model": {"w": ShardedTensor.from_rank_offsets("w", torch.full((2, 3), value))}}


def _next_batch(state: TrainerState) -> dict:
    """What a data loader and a sampler draw next: the shuffled prompt order from (seed, epoch, offset) + RNG."""
    order = torch.randperm(100, generator=torch.Generator().manual_seed(state.data_seed * 1000 + state.data_epoch))
    return {
        "prompts": order[state.data_offset : state.data_offset + BATCH].tolist(),
        "python": [random.random() for _ in range(3)],
        "numpy": np.random.randint(0, 2**31, size=3).tolist(),
        "torch": torch.rand(3).tolist(),
    }


def test_trainer_state_round_trips_and_the_resumed_run_draws_the_same_next_batch(ranks, tmp_path):
    def body(rank, world, save_dir):
        random.seed(11), np.random.seed(12), torch.manual_seed(13)
        _ = random.random(), np.random.rand(5), torch.rand(7)  # mid-run: the streams have moved on
        saved = TrainerState.capture(
            rollout_id=41,
            weight_version=42,
            data_epoch=3,
            data_offset=96,
            data_seed=7,
            rollout_carry=CARRY,
            rollout_buffer=BUFFER,
        )
        save_checkpoint(save_dir, saved.rollout_id, _model(1.0), common_state=saved.to_dict())
        uninterrupted = _next_batch(saved)
        random.seed(0), np.random.seed(0), torch.manual_seed(0)  # a fresh process resumes
        _, common = load_checkpoint(save_dir, _model(0.0))
        resumed = TrainerState.from_dict(common)
        resumed.restore_rng()
        return saved, resumed, uninterrupted, _next_batch(resumed)

    saved, resumed, uninterrupted, after_resume = ranks(1, body, tmp_path / "ckpt")[0]
    assert resumed == saved and (resumed.rollout_id, resumed.weight_version) == (41, 42)
    assert (resumed.data_epoch, resumed.data_offset, resumed.data_seed) == (3, 96, 7)
    assert resumed.rng_state["random"] == saved.rng_state["random"]
    assert torch.equal(resumed.rng_state["numpy"][1], saved.rng_state["numpy"][1])
    assert torch.equal(resumed.rng_state["torch"], saved.rng_state["torch"])
    assert after_resume == uninterrupted
    assert resumed.rollout_carry == CARRY  # partial rollout's unfinished groups survive the checkpoint
    assert resumed.rollout_buffer == BUFFER  # and asynchronous training's rollouts not yet trained on


def test_trainer_state_refuses_a_carry_that_is_not_plain_data():
    state = TrainerState(rollout_id=1, weight_version=1, rollout_carry=[[{"label": object()}]])
    with pytest.raises(CheckpointError, match=r"carry-over is not plain data.*JSON values"):
        state.to_dict()  # before anything is written, not at load time


def test_trainer_state_without_rng_or_fields():
    plain = TrainerState.from_dict({"rollout_id": 3, "weight_version": 4})  # an older checkpoint: defaults
    assert plain == TrainerState(rollout_id=3, weight_version=4, data_epoch=0, data_offset=0, data_seed=0)
    with pytest.raises(CheckpointError, match="holds no RNG states"):
        plain.restore_rng()
    with pytest.raises(CheckpointError, match=r"lacks trainer field\(s\) \['weight_version'\]"):
        TrainerState.from_dict({"rollout_id": 3})
