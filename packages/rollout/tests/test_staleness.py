"""Staleness of sampled tokens against the trainer's weights, and the loss mask of the too-stale ones."""

from __future__ import annotations

import pytest
from tidal.rollout import Sample, mask_stale_tokens, staleness_metrics, version_number


def _sample(versions: list[str | None], mask: list[int] | None = None) -> Sample:
    return Sample(
        prompt_ids=[1, 2],
        response_ids=[3] * len(versions),
        response_log_probs=[-0.5] * len(versions),
        finish_reason="stop",
        weight_version=versions[-1],
        response_loss_mask=mask,
        response_weight_versions=versions,
    )


def test_staleness_counts_loss_tokens_only_and_stale_tokens_are_masked_not_dropped():
    samples = [_sample(["1", "3", "4"]), _sample(["2", "2"], mask=[1, 0])]
    assert staleness_metrics(samples, 4) == {
        "rollout/staleness_max": 3.0,
        "rollout/staleness_mean": pytest.approx(1.5),
        "rollout/mixed_version_samples": 1.0,  # the first: resumed under newer weights
    }
    kept, masked = mask_stale_tokens(samples, oldest=3)
    assert masked == 2  # the first sample's "1" and the second's first "2"; its masked "2" was not a loss token
    assert [list(s.response_loss_mask) for s in kept] == [[0, 1, 1], [0, 0]]
    assert len(kept) == len(samples)  # every sample stays: its reward still counts for its group
    assert staleness_metrics(kept, 4)["rollout/staleness_max"] == 1.0
    assert mask_stale_tokens(samples, oldest=1) == (samples, 0)


def test_an_agent_samples_template_tokens_do_not_make_it_mixed():
    # An agent's sample holds the tokens of the turns between its answers (loss mask 0, no version): only the
    # sampled tokens count, and both answers here came from version 2.
    agent = _sample(["2", "2", None, None, "2"], mask=[1, 1, 0, 0, 1])
    assert staleness_metrics([agent], 3) == {
        "rollout/staleness_max": 1.0,
        "rollout/staleness_mean": 1.0,
        "rollout/mixed_version_samples": 0.0,
    }
    resumed = _sample(["2", "3", None, "3"], mask=[1, 1, 0, 1])  # an update cut the first answer
    assert staleness_metrics([resumed], 3)["rollout/mixed_version_samples"] == 1.0


def test_a_version_the_engine_did_not_number_counts_as_the_initial_weights():
    assert version_number("7") == 7.0
    assert version_number(None) == 0.0
    assert version_number("initial") == 0.0
