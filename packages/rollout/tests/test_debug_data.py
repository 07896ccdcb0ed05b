"""Debug rollout data: samples from the real server saved per rollout and replayed exactly."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from tidal.rollout import (
    SGLangEngine,
    generate_samples,
    load_rollout_data,
    sample_records,
    samples_from_records,
    save_rollout_data,
    score_samples,
)
from tidal.rollout.debug_data import rollout_data_path
from tidal.rollout.rewards import numeric_match


def test_saved_rollouts_replay_exactly(sglang_server: SGLangEngine, tmp_path: Path) -> None:
    params = {"n": 3, "max_new_tokens": 5, "temperature": 1.0}
    samples = score_samples(
        generate_samples(sglang_server, [[3, 4], [5, 6, 7]], params, labels=["4", 7]), numeric_match
    )
    samples[1] = dataclasses.replace(
        samples[1], response_loss_mask=[0] * len(samples[1].response_ids), reward_error="x"
    )
    out = tmp_path / "debug"
    assert save_rollout_data(out, 0, samples) == rollout_data_path(out, 0)
    save_rollout_data(out, 1, samples[:2])
    replayed = load_rollout_data(out, 0)
    assert replayed == samples  # every field, log-probs bit for bit
    assert [s.response_log_probs for s in replayed] == [s.response_log_probs for s in samples]
    assert replayed[1].loss_mask == samples[1].loss_mask
    assert load_rollout_data(out, 1) == samples[:2]
    records = sample_records(samples)  # what a checkpoint keeps of partial rollout's carry-over
    assert samples_from_records(records) == samples and all(isinstance(r["response_ids"], list) for r in records)
    assert sorted(p.name for p in out.iterdir()) == ["rollout_000000.jsonl", "rollout_000001.jsonl"]


def test_load_errors_say_what_is_there(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"no rollout 3 \(rollout_000003.jsonl\); present: none"):
        load_rollout_data(tmp_path, 3)
    from tidal.rollout import Sample

    sample = Sample(prompt_ids=[1], response_ids=[2], response_log_probs=[-0.5], finish_reason="stop")
    path = save_rollout_data(tmp_path, 0, [sample, sample])
    with pytest.raises(ValueError, match=r"present: \['rollout_000000.jsonl'\]"):
        load_rollout_data(tmp_path, 3)
    path.write_text("\n".join(path.read_text().splitlines()[:-1]) + "\n")  # a truncated file
    with pytest.raises(ValueError, match="declares 2 samples but holds 1"):
        load_rollout_data(tmp_path, 0)
    with pytest.raises(ValueError, match="sample 0 of rollout 4 is not JSON"):
        save_rollout_data(tmp_path, 4, [dataclasses.replace(sample, label=object())])
    assert not rollout_data_path(tmp_path, 4).exists()
