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
    job = parse_job(list(flags))
    return DriverRollouts(
        job.rollout,
        NO_ENGINES,
        None,
        None,
        rollout_batch_size=job.batching.rollout_batch_size,
        fault_tolerant=job.train.use_fault_tolerance,
        tokenizer=None,
    )


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
    before = _rollouts("--partial-rollout", "--over-sampling-batch-size", "6", "--rollout-batch-size", "4")
    assert before.carry_state() is None  # nothing carried: nothing saved
    before.carry = [_group([1, 2, 3], "4", 2), _group([9], "x", 1)]
    state = TrainerState.capture(rollout_id=4, weight_version=2, rollout_carry=before.carry_state())
    buffer = io.BytesIO()
    torch.save(state.to_dict(), buffer)  # what the checkpoint's common state holds
    buffer.seek(0)
    loaded = TrainerState.from_dict(torch.load(buffer, weights_only=True))

    after = _rollouts("--partial-rollout", "--over-sampling-batch-size", "6", "--rollout-batch-size", "4")
    after.restore_carry(loaded.rollout_carry)
    assert after.carry == before.carry  # every field of every unfinished sample


def test_carry_over_without_partial_rollout_is_dropped_with_a_warning(caplog):
    carried = _rollouts("--partial-rollout", "--over-sampling-batch-size", "6", "--rollout-batch-size", "4")
    carried.carry = [_group([1, 2], "4", 1)]
    plain = _rollouts()
    with caplog.at_level(logging.WARNING):
        plain.restore_carry(carried.carry_state())
    assert plain.carry == []
    assert "--partial-rollout is off" in caplog.text


def test_dynamic_sampling_rounds_draw_their_own_prompts_the_same_on_every_call(tmp_path):
    import collections
    import json

    from tidal.train.data import PromptDataset

    class Words:  # PromptDataset only encodes: one id per character
        def encode(self, text):
            return [ord(c) for c in text]

    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"q{i}", "label": str(i)}) + "\n" for i in range(10)))
    data = PromptDataset(path, Words(), input_key="prompt", label_key="label", seed=3)
    first_rounds = [p.label for k in range(5) for p in data.batch(k, 2)]
    more = [p.label for k in range(5) for r in (2, 3) for p in data.more_batch(k, r, 2, max_rounds=3)]
    # Rounds 2 and 3 of five rollouts walk two whole epochs of their own order: each prompt twice, none skipped.
    assert collections.Counter(more) == {str(i): 2 for i in range(10)}
    assert more != first_rounds * 2  # another order than the rollouts' own batches
    again = PromptDataset(path, Words(), input_key="prompt", label_key="label", seed=3)  # a resumed run
    assert [p.label for p in again.more_batch(4, 3, 2, max_rounds=3)] == more[-2:]
    assert sorted(first_rounds) == sorted(str(i) for i in range(10))  # round 1: the rollouts' own epoch, untouched
