"""RolloutConfig validation and the --sglang-* pass-through."""

from __future__ import annotations

import pytest
from tidal.rollout import RolloutConfig, sglang_server_args


def test_sampling_params_carry_the_rollout_flags() -> None:
    cfg = RolloutConfig(
        n_samples_per_prompt=4, rollout_max_response_len=16, rollout_temperature=0.7, rollout_stop_token_ids=(5,)
    )
    assert cfg.sampling_params() == {
        "n": 4,
        "max_new_tokens": 16,
        "temperature": 0.7,
        "top_p": 1.0,
        "top_k": -1,
        "stop_token_ids": [5],
    }
    assert "stop_token_ids" not in RolloutConfig().sampling_params()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"n_samples_per_prompt": 0}, "--n-samples-per-prompt must be >= 1, got 0"),
        ({"rollout_max_response_len": 0}, "--rollout-max-response-len must be >= 1, got 0"),
        ({"rollout_temperature": -1.0}, "--rollout-temperature must be >= 0, got -1.0"),
        ({"rollout_top_p": 0.0}, r"--rollout-top-p must be in \(0, 1\], got 0.0"),
        ({"rollout_top_k": 0}, "--rollout-top-k must be -1 or >= 1, got 0"),
        ({"sglang_startup_timeout_s": 0.0}, "--sglang-startup-timeout-s must be > 0, got 0.0"),
        ({"rm_type": "f1"}, "--rm-type must be exact_match, numeric_match or math, got 'f1'"),
        ({"custom_rm_path": "pkg.mod.fn"}, "--custom-rm-path must look like 'pkg.module:fn', got 'pkg.mod.fn'"),
    ],
)
def test_bad_values_name_the_flag(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RolloutConfig(**kwargs)


def test_sglang_flags_map_to_server_args() -> None:
    flags = ["--sglang-mem-fraction-static", "0.7", "--sglang-enable-metrics", "--sglang-context-length=512"]
    assert sglang_server_args(flags) == ("--mem-fraction-static", "0.7", "--enable-metrics", "--context-length=512")
    with pytest.raises(ValueError, match="'--mem-fraction-static' is not an SGLang pass-through flag"):
        sglang_server_args(["--mem-fraction-static", "0.7"])
