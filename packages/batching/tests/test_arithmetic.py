import logging

import pytest
from tidal.batching import BatchingConfig
from tidal.batching.arithmetic import resolve_batch_arithmetic


def test_derives_global_batch_size_from_steps():
    a = resolve_batch_arithmetic(rollout_batch_size=32, n_samples_per_prompt=8, num_steps_per_rollout=4, dp_size=8)
    assert (a.rollout_size, a.global_batch_size, a.num_steps_per_rollout, a.samples_per_rank) == (256, 64, 4, 8)
    assert [(s.start, s.stop) for s in a.step_slices()] == [(0, 64), (64, 128), (128, 192), (192, 256)]
    # --num-steps-per-rollout reaches the arithmetic through the config the app builds
    config = BatchingConfig(rollout_batch_size=32, n_samples_per_prompt=8, num_steps_per_rollout=4)
    assert config.resolve(dp_size=8) == a


def test_derives_steps_from_global_batch_size_and_defaults_to_one_step():
    a = resolve_batch_arithmetic(rollout_batch_size=32, n_samples_per_prompt=8, global_batch_size=128)
    assert a.num_steps_per_rollout == 2
    # --global-batch-size reaches the arithmetic through the config the app builds
    config = BatchingConfig(rollout_batch_size=32, n_samples_per_prompt=8, global_batch_size=128)
    assert config.resolve(dp_size=1) == a
    b = resolve_batch_arithmetic(rollout_batch_size=4, n_samples_per_prompt=2)
    assert (b.global_batch_size, b.num_steps_per_rollout) == (8, 1)


def test_both_set_consistently_is_fine():
    a = resolve_batch_arithmetic(
        rollout_batch_size=32, n_samples_per_prompt=8, global_batch_size=64, num_steps_per_rollout=4
    )
    assert a.global_batch_size == 64


@pytest.mark.parametrize(
    ("kwargs", "needles"),
    [
        (
            {"global_batch_size": 64, "num_steps_per_rollout": 2},
            ["disagree", "--global-batch-size 64", "--num-steps-per-rollout 2", "256", "4 steps"],
        ),
        ({"global_batch_size": 48}, ["--global-batch-size 48 does not divide", "256", "--num-steps-per-rollout"]),
        (
            {"num_steps_per_rollout": 3},
            ["--num-steps-per-rollout 3 does not divide", "--rollout-batch-size 32", "--n-samples-per-prompt 8"],
        ),
        (
            {"global_batch_size": 64, "dp_size": 6},
            ["not divisible by the data-parallel size 6", "--global-batch-size 64"],
        ),
        ({"global_batch_size": 0}, ["--global-batch-size must be >= 1, got 0"]),
    ],
)
def test_errors_state_numbers_and_flags(kwargs, needles):
    with pytest.raises(ValueError) as info:
        resolve_batch_arithmetic(rollout_batch_size=32, n_samples_per_prompt=8, **kwargs)
    for needle in needles:
        assert needle in str(info.value)


def test_config_validates_at_construction():
    cfg = BatchingConfig(rollout_batch_size=8, n_samples_per_prompt=4, num_steps_per_rollout=2)
    assert cfg.resolve(dp_size=4).samples_per_rank == 4
    with pytest.raises(ValueError, match="not divisible by the data-parallel size 3"):
        cfg.resolve(dp_size=3)
    with pytest.raises(ValueError, match="--n-samples-per-prompt must be >= 1, got 0"):
        BatchingConfig(rollout_batch_size=8, n_samples_per_prompt=0)
    with pytest.raises(ValueError, match="--use-dynamic-batch-size needs --max-tokens-per-gpu"):
        BatchingConfig(rollout_batch_size=8, use_dynamic_batch_size=True)
    with pytest.raises(ValueError, match="disagree"):
        BatchingConfig(rollout_batch_size=8, global_batch_size=4, num_steps_per_rollout=1)
    with pytest.raises(ValueError, match="--pad-to-multiple-of must be >= 1"):
        BatchingConfig(rollout_batch_size=8, pad_to_multiple_of=0)


def test_config_warns_about_flags_without_effect(caplog):
    with caplog.at_level(logging.WARNING, logger="tidal.batching.config"):
        BatchingConfig(rollout_batch_size=8, max_tokens_per_gpu=4096)
        BatchingConfig(rollout_batch_size=8, use_dynamic_batch_size=True, max_tokens_per_gpu=4096, micro_batch_size=2)
        BatchingConfig(rollout_batch_size=8, log_probs_max_tokens_per_gpu=8192)
    assert "--max-tokens-per-gpu 4096 has no effect" in caplog.text
    assert "--log-probs-max-tokens-per-gpu 8192 has no effect without --use-dynamic-batch-size" in caplog.text
    assert "--micro-batch-size 2 has no effect" in caplog.text


def test_config_is_frozen():
    cfg = BatchingConfig(rollout_batch_size=8)
    with pytest.raises(AttributeError):
        cfg.rollout_batch_size = 4  # type: ignore[misc]
