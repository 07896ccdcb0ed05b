"""Every option `train --help` lists names the test that checks its effect (or its refusal), or is a listed gap.

The options are collected from the parser the CLI is generated from (the config fields). ``COVERED`` maps an option
to ``(path, test)``: the test must exist, and its file must name the option (a stale or invented entry fails). Being
visible in config.yaml does not count as an effect. ``GAPS`` holds the options whose effect no test is pointed at
yet, each by name: an option in neither fails this test with its name, and an option in both fails too (move it
out of ``GAPS`` once a test covers it).
"""

import ast
import re
from pathlib import Path

import pytest
from tidal.train.flags import build_parser

ROOT = Path(__file__).resolve().parents[3]

MODES = "tests/test_train_modes_e2e.py"
ROUTER = "tests/test_train_router_e2e.py"
CLI = "apps/train/tests/test_cli.py"
E2E = "tests/test_train_e2e.py"
LORA = "packages/actor/tests/test_lora.py"
MOE = "packages/actor/tests/test_moe.py"
WANDB = "apps/train/tests/test_wandb_run.py"

COVERED: dict[str, tuple[str, str]] = {
    # dynamic sampling and the custom generate function, through the router over two real engines
    "--dynamic-sampling-filter-path": (
        ROUTER,
        "test_dynamic_sampling_fills_rollout_0_in_its_second_round_and_writes_its_metrics",
    ),
    "--dynamic-sampling-max-rounds": (
        ROUTER,
        "test_a_batch_still_short_after_the_last_round_stops_the_run_with_one_line",
    ),
    "--over-sampling-batch-size": (
        ROUTER,
        "test_dynamic_sampling_fills_rollout_0_in_its_second_round_and_writes_its_metrics",
    ),
    "--custom-generate-function-path": (
        ROUTER,
        "test_the_custom_generate_function_made_every_sample_through_the_router_and_in_the_workers",
    ),
    "--sglang-router-policy": (
        ROUTER,
        "test_the_custom_generate_function_made_every_sample_through_the_router_and_in_the_workers",
    ),
    # the other modes' runs
    "--partial-rollout": (MODES, "test_rollout_only_generates_without_training"),
    "--debug-rollout-only": (MODES, "test_rollout_only_generates_without_training"),
    "--save-debug-rollout-data": (MODES, "test_resumed_async_run_trains_on_the_buffered_samples_without_gap_or_repeat"),
    "--debug-train-only": (MODES, "test_train_only_trains_on_the_saved_rollouts_with_a_critic"),
    "--load-debug-rollout-data": (MODES, "test_train_only_trains_on_the_saved_rollouts_with_a_critic"),
    "--num-critic-only-steps": (MODES, "test_train_only_trains_on_the_saved_rollouts_with_a_critic"),
    "--critic-lr": (MODES, "test_train_only_trains_on_the_saved_rollouts_with_a_critic"),
    "--log-probs-max-tokens-per-gpu": (MODES, "test_train_only_trains_on_the_saved_rollouts_with_a_critic"),
    "--max-staleness": (MODES, "test_one_step_off_trains_on_samples_at_most_one_version_old"),
    "--pipeline-model-parallel-size": (
        MODES,
        "test_each_pipeline_stage_broadcast_its_own_tensors_and_both_engines_serve_all",
    ),
    "--check-weight-update-equal": (
        MODES,
        "test_each_pipeline_stage_broadcast_its_own_tensors_and_both_engines_serve_all",
    ),
    "--rollout-external-engine-addrs": (
        MODES,
        "test_each_pipeline_stage_broadcast_its_own_tensors_and_both_engines_serve_all",
    ),
    "--load": (MODES, "test_resume_continues_metrics_without_gap_or_repeat"),
    "--num-rollout": (MODES, "test_one_step_off_trains_on_samples_at_most_one_version_old"),
    # the embedded default's run
    "--eval-prompt-data": (E2E, "test_accuracy_is_reported_before_and_after"),
    "--n-samples-per-eval-prompt": (E2E, "test_accuracy_is_reported_before_and_after"),
    "--keep-best-by": (E2E, "test_checkpoint_has_tracker"),
    "--rollout-batch-size": (E2E, "test_samples_carry_the_engine_log_probs"),
    "--n-samples-per-prompt": (E2E, "test_samples_carry_the_engine_log_probs"),
    "--use-tensorboard": (MODES, "test_resumed_run_leaves_no_process_and_the_external_server_running"),
    "--save": (MODES, "test_resume_continues_metrics_without_gap_or_repeat"),
    # LoRA, MoE and W&B, in their packages' tests
    "--lora-rank": (LORA, "test_lora_at_init_is_the_base_and_trains_only_adapters"),
    "--lora-alpha": (LORA, "test_merged_export_is_w_plus_scaled_ba"),
    "--lora-dropout": (LORA, "test_dropout_acts_in_training_only"),
    "--moe-aux-loss-coeff": (MOE, "test_expert_load_metric_counts_transformers_routing"),
    "--expert-model-parallel-size": (CLI, "test_expert_parallel_size_is_checked_against_the_model_before_start"),
    "--wandb-mode": (WANDB, "test_disabled_logs_nothing_to_wandb"),
    "--wandb-group": (WANDB, "test_offline_run_holds_every_rollouts_metrics_and_says_where_it_is"),
    "--wandb-host": (WANDB, "test_online_goes_to_the_wandb_host_given"),
    # refusals where the option cannot act (their effect where it can is not named here yet)
    "--ref-load": (CLI, "test_bad_configuration_is_one_line_naming_the_flag_and_the_fix"),
    "--critic-load": (CLI, "test_bad_configuration_is_one_line_naming_the_flag_and_the_fix"),
    "--value-clip": (CLI, "test_bad_configuration_is_one_line_naming_the_flag_and_the_fix"),
    "--lambd": (CLI, "test_bad_configuration_is_one_line_naming_the_flag_and_the_fix"),
    "--tis-mode": (CLI, "test_bad_configuration_is_one_line_naming_the_flag_and_the_fix"),
    "--update-weights-interval": (CLI, "test_bad_configuration_is_one_line_naming_the_flag_and_the_fix"),
}

_GAPS = """
    --actor-num-gpus-per-node --actor-num-nodes --adam-beta1 --adam-beta2 --adam-eps --advantage-estimator
    --apply-chat-template --async-save --bf16 --calculate-per-token-loss --check-weight-update-tolerance --ckpt-step
    --clip-grad --colocate --config --context-parallel-size --cudnn-attention-min-tokens
    --custom-advantage-function-path --custom-loss-function-path --custom-rm-path --disable-grpo-std-normalization
    --entropy-coef --eps-clip --eps-clip-c --eps-clip-high --eval-interval --eval-max-response-len
    --eval-temperature --eval-top-p --fp32-main-params --gamma --generate-max-concurrency --global-batch-size
    --gpu-memory-gib --hf-checkpoint --input-key --keep-last --kl-coef --kl-loss-coef --kl-loss-type --label-key
    --list-recipes --log-probs-chunk-size --loss-type --lr --lr-warmup-iters --mask-offpolicy-in-partial-rollout
    --max-shard-bytes --max-tokens-per-gpu --micro-batch-size --mismatch-warn-threshold
    --no-check-for-nan-in-loss-and-grad --no-load-optim --no-load-rng --no-recompute-lm-head --num-cpus-local
    --num-cpus-per-bundle --num-eval-prompts --num-gpus-local --num-steps-per-rollout --offload --offload-rollout
    --offload-train --optimizer-cpu-offload --output-dir --overlong-buffer-len --overlong-penalty-factor
    --overwrite-output-dir --pad-to-multiple-of --params-dtype --placement-timeout --prompt-data --ray-address
    --ray-env --ray-propagate-uv-env --recipe --recompute-activations --recompute-num-layers
    --reward-sanity-rollouts --rm-type --rollout-external --rollout-health-check-interval
    --rollout-health-check-timeout --rollout-max-response-len --rollout-num-gpus --rollout-num-gpus-per-engine
    --rollout-request-retries --rollout-request-timeout-s --rollout-stop --rollout-stop-token-ids
    --rollout-temperature --rollout-top-k --rollout-top-p --save-hf --save-interval --seed --sglang-api-key
    --sglang-host --sglang-startup-timeout-s --start-rollout-id --tensor-model-parallel-size --tis-clip
    --update-weight-buffer-size --update-weight-timeout --update-weight-transport --use-dynamic-batch-size
    --use-fault-tolerance --use-kl-loss --use-router --use-tis --use-wandb --verbose --wandb-project --weight-decay
    --lora-target-modules --expert-tensor-parallel-size --moe-router-dtype
"""
GAPS = frozenset(_GAPS.split())
"""Options no test is pointed at yet (many are exercised by tests not yet named here); each must move to COVERED."""


def train_options() -> list[str]:
    """Every option `train --help` lists (its first spelling), from the parser built from the config fields."""
    parser = build_parser()
    return sorted(
        {a.option_strings[0] for a in parser._actions if a.option_strings and "--help" not in a.option_strings}
    )


def _test_names(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")}


@pytest.mark.parametrize("option", train_options())
def test_every_option_names_its_test_or_is_a_listed_gap(option):
    assert option in COVERED or option in GAPS, (
        f"{option}: no test is named for its effect or refusal; add it to COVERED (path, test) or, saying why, GAPS"
    )
    assert not (option in COVERED and option in GAPS), f"{option} is covered: remove it from GAPS"


@pytest.mark.parametrize("option", sorted(COVERED))
def test_each_named_test_exists_and_its_file_uses_the_option(option):
    path, name = COVERED[option]
    file = ROOT / path
    assert file.is_file(), f"{option}: {path} does not exist"
    assert name in _test_names(file), f"{option}: {path} has no test {name}"
    uses = re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", file.read_text(encoding="utf-8"))
    assert uses, f"{option}: {path} never passes it"


def test_no_entry_names_an_option_train_does_not_have():
    assert not (set(COVERED) | GAPS) - set(train_options())
