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
    assert RolloutConfig(rollout_stop=("</answer>", "\n\n")).sampling_params()["stop"] == ["</answer>", "\n\n"]
    assert "stop" not in RolloutConfig().sampling_params()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"n_samples_per_prompt": 0}, "--n-samples-per-prompt must be >= 1, got 0"),
        ({"rollout_max_response_len": 0}, "--rollout-max-response-len must be >= 1, got 0"),
        ({"rollout_temperature": -1.0}, "--rollout-temperature must be >= 0, got -1.0"),
        ({"rollout_top_p": 0.0}, r"--rollout-top-p must be in \(0, 1\], got 0.0"),
        ({"rollout_top_k": 0}, "--rollout-top-k must be -1 or >= 1, got 0"),
        ({"sglang_startup_timeout_s": 0.0}, "--sglang-startup-timeout-s must be > 0, got 0.0"),
        ({"rollout_request_timeout_s": 0.0}, "--rollout-request-timeout-s must be > 0, got 0.0"),
        ({"rollout_request_retries": -1}, "--rollout-request-retries must be >= 0, got -1"),
        ({"rm_type": "f1"}, "--rm-type must be exact_match, numeric_match, math or code, got 'f1'"),
        ({"custom_rm_path": "pkg.mod.fn"}, "--custom-rm-path must look like 'pkg.module:fn', got 'pkg.mod.fn'"),
        ({"rollout_stop": ("</a>", "")}, r"--rollout-stop strings must be non-empty, got \('</a>', ''\)"),
        ({"over_sampling_batch_size": 0}, "--over-sampling-batch-size must be >= 1, got 0"),
        (
            {"dynamic_sampling_filter_path": "std"},
            r"--dynamic-sampling-filter-path must be one of \['reward_variance'\]",
        ),
        ({"dynamic_sampling_max_rounds": 0}, "--dynamic-sampling-max-rounds must be >= 1, got 0"),
        ({"custom_generate_function_path": "f"}, "--custom-generate-function-path must look like 'pkg.module:fn'"),
        ({"generate_max_concurrency": 0}, "--generate-max-concurrency must be >= 1, got 0"),
        (
            {"save_debug_rollout_data": "/a", "load_debug_rollout_data": "/b"},
            "give only --load-debug-rollout-data",
        ),
    ],
)
def test_bad_values_name_the_flag(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RolloutConfig(**kwargs)


def test_sglang_flags_map_to_server_args() -> None:
    flags = ["--sglang-mem-fraction-static", "0.7", "--sglang-enable-metrics", "--sglang-context-length=512"]
    assert sglang_server_args(flags) == ("--mem-fraction-static", "0.7", "--enable-metrics", "--context-length", "512")
    with pytest.raises(ValueError, match="'--mem-fraction-static' is not an SGLang pass-through flag"):
        sglang_server_args(["--mem-fraction-static", "0.7"])


def test_the_value_read_from_the_pass_through_is_the_one_sglang_takes() -> None:
    from tidal.rollout import server_arg_value

    args = sglang_server_args(["--sglang-mem-fraction-static", "0.5", "--sglang-enable-metrics"])
    assert server_arg_value(args, "--mem-fraction-static") == "0.5"
    assert server_arg_value(args, "--enable-metrics") is None and server_arg_value(args, "--dtype") is None
    twice = sglang_server_args(["--sglang-mem-fraction-static", "0.5", "--sglang-mem-fraction-static=0.7"])
    assert server_arg_value(twice, "--mem-fraction-static") == "0.7"  # argparse keeps the last


def test_over_sampling_without_a_filter_warns(caplog: pytest.LogCaptureFixture) -> None:
    RolloutConfig(over_sampling_batch_size=8)
    assert "--over-sampling-batch-size has no effect without --dynamic-sampling-filter-path" in caplog.text
    caplog.clear()
    RolloutConfig(over_sampling_batch_size=8, dynamic_sampling_filter_path="pkg.mod:keep")
    assert not caplog.text
    RolloutConfig(dynamic_sampling_max_rounds=3)
    assert "--dynamic-sampling-max-rounds has no effect without --dynamic-sampling-filter-path" in caplog.text


def test_over_sampling_under_partial_rollout_does_not_warn(caplog: pytest.LogCaptureFixture) -> None:
    # Partial rollout starts --over-sampling-batch-size prompts and carries the unfinished groups to the next rollout.
    RolloutConfig(over_sampling_batch_size=8, partial_rollout=True)
    assert "--over-sampling-batch-size" not in caplog.text
    assert RolloutConfig(over_sampling_batch_size=8, partial_rollout=True).prompts_per_round(4) == 8
    filtered = RolloutConfig(over_sampling_batch_size=8, dynamic_sampling_filter_path="pkg.mod:keep")
    assert filtered.prompts_per_round(4) == 8
    assert RolloutConfig(over_sampling_batch_size=8).prompts_per_round(4) == 4  # warned above: no effect, none taken
    assert RolloutConfig(partial_rollout=True).prompts_per_round(4) == 4


def test_external_engine_addresses() -> None:
    cfg = RolloutConfig(rollout_external_engine_addrs=("10.0.0.5:30000", "http://h:1"))
    assert cfg.external_engine_urls() == ["http://10.0.0.5:30000", "http://h:1"]
    assert RolloutConfig().external_engine_urls() == []
    for bad in (("localhost",), ("h:0",), ("h:port",), ("h:1", "h:1")):
        with pytest.raises(ValueError, match="--rollout-external-engine-addrs"):
            RolloutConfig(rollout_external_engine_addrs=bad)
    with pytest.raises(ValueError, match="--rollout-external needs --rollout-external-engine-addrs"):
        RolloutConfig(rollout_external=True)


def test_each_engine_serves_with_tensor_parallelism_over_the_gpus_it_is_given():
    from tidal.rollout import with_engine_tp

    assert with_engine_tp(("--mem-fraction-static", "0.5"), 1) == ("--mem-fraction-static", "0.5")
    assert with_engine_tp(("--mem-fraction-static", "0.5"), 4) == ("--mem-fraction-static", "0.5", "--tp-size", "4")
    assert with_engine_tp(("--tp-size", "2"), 2) == ("--tp-size", "2")
    assert with_engine_tp(("--tensor-parallel-size=2",), 2) == ("--tensor-parallel-size=2",)
    with pytest.raises(ValueError, match="--sglang-tp-size 1 disagrees with --rollout-num-gpus-per-engine 2"):
        with_engine_tp(("--tp-size", "1"), 2)
    with pytest.raises(ValueError, match="--sglang-tensor-parallel-size 4 disagrees"):
        with_engine_tp(("--tensor-parallel-size=4",), 2)


def test_code_sandbox_options_warn_without_rm_type_code(caplog: pytest.LogCaptureFixture) -> None:
    RolloutConfig(code_sandbox_timeout_s=3.0)
    assert "--code-sandbox-timeout-s has no effect without --rm-type code" in caplog.text
    caplog.clear()
    RolloutConfig(rm_type="code", code_sandbox_timeout_s=3.0, code_sandbox_max_concurrency=2)
    assert not caplog.text
    RolloutConfig(rm_type="code", custom_rm_path="pkg.mod:fn", code_sandbox_memory_mb=512)  # the custom reward wins
    assert "--code-sandbox-memory-mb has no effect without --rm-type code" in caplog.text
