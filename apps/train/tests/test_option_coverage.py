"""Every option `train --help` lists names the test that checks its effect (or its refusal), or is a listed gap.

The options are collected from the parser the CLI is generated from (the config fields). ``COVERED`` maps an option
to the test id ``path::test`` of the test that must fail when the option is neutralized (``(path, test)``; a
parametrized test may be narrowed to one case, ``test[id]``). This file checks the table statically: every option
has an entry, and each entry names a test that exists. Whether the test notices the option is checked by option
mutation, outside the suite (too slow for it): ``tools/option_mutation.py`` runs each named test with the option
replaced by its default (or by ``MUTANT_VALUES``'s value, where the test already runs the default), and a test
that still passes is a survivor. ``GAPS`` holds the options whose effect no test is pointed at yet, each by name:
an option in neither fails this test with its name, and an option in both fails too (move it out of ``GAPS`` once
a test covers it).
"""

import ast
from pathlib import Path

import pytest
from tidal.train.flags import build_parser
from tidal.train.option_mutant import APP_FLAGS, parse_mutant

ROOT = Path(__file__).resolve().parents[3]

MODES = "tests/test_train_modes_e2e.py"
ROUTER = "tests/test_train_router_e2e.py"
CLI = "apps/train/tests/test_cli.py"
E2E = "tests/test_train_e2e.py"
LORA = "packages/actor/tests/test_lora.py"
MOE = "packages/actor/tests/test_moe.py"
WANDB = "apps/train/tests/test_wandb_run.py"
BAD_CONFIG = "test_bad_configuration_is_one_line_naming_the_flag_and_the_fix"
SETTINGS = "packages/actor/tests/test_loss_settings.py"
ADV = "packages/actor/tests/test_advantages.py"
WEIGHTS = "packages/actor/tests/test_sample_weights.py"
ACTOR = "packages/actor/tests/test_actor.py"
MAIN = "packages/actor/tests/test_main_params.py"
FAST = "packages/actor/tests/test_fast_paths.py"
GENERATION = "packages/rollout/tests/test_generation.py"
CODE = "packages/rollout/tests/test_code_reward.py"
HANDLES = "apps/train/tests/test_handles.py"
EMBEDDED = "apps/train/tests/test_embedded.py"
PROMPT_DATA = "apps/train/tests/test_prompt_data.py"
MICRO = "packages/batching/tests/test_micro_batches.py"
ARITH = "packages/batching/tests/test_arithmetic.py"
SFT_E2E = "tests/test_train_sft_e2e.py"
SFT_RUN = "test_sft_lowers_the_nll_of_its_rows_counting_response_tokens_only"

COVERED: dict[str, tuple[str, str]] = {
    # the SFT stage, end to end (its run is the session fixture sft_run)
    "--stage": (SFT_E2E, SFT_RUN),
    "--sft-data": (SFT_E2E, SFT_RUN),
    "--sft-eval-data": (SFT_E2E, SFT_RUN),
    "--num-epoch": (SFT_E2E, SFT_RUN),
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
    "--update-weights-interval": (
        "tests/test_update_interval_e2e.py",
        "test_the_engines_serve_new_weights_only_after_every_second_rollout",
    ),
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
    "--moe-aux-loss-coeff": (MOE, "test_the_balance_loss_coefficient_scales_its_pull_on_the_routers"),
    "--use-rollout-routing-replay": (
        "packages/actor/tests/test_routing_replay.py",
        "test_mismatch_metric_and_train_on_rollout_under_replay",
    ),
    "--expert-model-parallel-size": (CLI, "test_expert_parallel_size_is_checked_against_the_model_before_start"),
    "--wandb-mode": (WANDB, "test_disabled_logs_nothing_to_wandb"),
    "--wandb-group": (WANDB, "test_offline_run_holds_every_rollouts_metrics_and_says_where_it_is"),
    "--wandb-host": (WANDB, "test_online_goes_to_the_wandb_host_given"),
    # the loss, the advantages and the per-sample weights, from the actor's config
    "--eps-clip": (SETTINGS, "test_the_clip_options_reach_the_loss_through_the_actor_config"),
    "--eps-clip-high": (SETTINGS, "test_the_clip_options_reach_the_loss_through_the_actor_config"),
    "--eps-clip-c": (SETTINGS, "test_the_clip_options_reach_the_loss_through_the_actor_config"),
    "--kl-loss-type": (SETTINGS, "test_the_kl_and_entropy_options_reach_the_loss_through_the_actor_config"),
    "--kl-loss-coef": (SETTINGS, "test_the_kl_and_entropy_options_reach_the_loss_through_the_actor_config"),
    "--entropy-coef": (SETTINGS, "test_the_kl_and_entropy_options_reach_the_loss_through_the_actor_config"),
    "--use-tis": (SETTINGS, "test_tis_and_the_loss_type_reach_the_loss_through_the_actor_config"),
    "--tis-clip": (SETTINGS, "test_tis_and_the_loss_type_reach_the_loss_through_the_actor_config"),
    "--loss-type": (SETTINGS, "test_tis_and_the_loss_type_reach_the_loss_through_the_actor_config"),
    "--advantage-estimator": (ADV, "test_reinforce_plus_plus_formula"),
    "--gamma": (ADV, "test_reinforce_plus_plus_formula"),
    "--kl-coef": (ADV, "test_kl_coef_shapes_the_advantage_per_token"),
    "--disable-grpo-std-normalization": (
        WEIGHTS,
        "test_std_normalization_follows_the_config_unless_the_caller_overrides_it",
    ),
    "--calculate-per-token-loss": (WEIGHTS, "test_per_token_loss_packs_no_loss_weights"),
    "--overlong-buffer-len": (WEIGHTS, "test_overlong_penalty_is_added_to_the_reward_before_the_advantage"),
    "--overlong-penalty-factor": (WEIGHTS, "test_overlong_penalty_is_added_to_the_reward_before_the_advantage"),
    # the actor's memory options, the optimizer and the checkpoint writer
    "--recompute-activations": (ACTOR, "test_recompute_activations_gives_the_same_step"),
    "--recompute-num-layers": (ACTOR, "test_recompute_num_layers_recomputes_only_the_first_layers"),
    "--params-dtype": (MAIN, "test_same_update_as_fp32"),
    "--fp32-main-params": (MAIN, "test_small_updates_survive_in_main_params"),
    "--optimizer-cpu-offload": (
        "packages/actor/tests/test_offload.py",
        "test_actor_with_offloaded_optimizer_trains_like_on_device_adam",
    ),
    "--async-save": (
        "packages/ckpt/tests/test_async_save.py",
        "test_caller_regains_control_before_the_write_and_the_result_equals_a_sync_save",
    ),
    # batching: the micro-batches and the optimizer steps of a rollout
    "--use-dynamic-batch-size": (MICRO, "test_plan_from_config_follows_the_mode"),
    "--max-tokens-per-gpu": (MICRO, "test_plan_from_config_follows_the_mode"),
    "--pad-to-multiple-of": (MICRO, "test_plan_from_config_follows_the_mode"),
    "--micro-batch-size": (MICRO, "test_plan_from_config_follows_the_mode"),
    "--global-batch-size": (ARITH, "test_derives_steps_from_global_batch_size_and_defaults_to_one_step"),
    "--num-steps-per-rollout": (ARITH, "test_derives_global_batch_size_from_steps"),
    "--gpu-memory-gib": (
        "apps/train/tests/test_memory.py",
        "test_a_budget_too_large_for_the_card_is_one_line_naming_the_budget_that_fits",
    ),
    # data, evaluation, monitors, the run folder, recipes, the config file and the engines' address and key
    "--apply-chat-template": (
        EMBEDDED,
        "test_the_apply_chat_template_flag_renders_the_training_and_held_out_prompts_train_reads",
    ),
    "--eval-temperature": ("apps/train/tests/test_metrics.py", "test_eval_sampling_params_follow_the_eval_flags"),
    "--eval-top-p": ("apps/train/tests/test_metrics.py", "test_eval_sampling_params_follow_the_eval_flags"),
    "--eval-max-response-len": ("apps/train/tests/test_metrics.py", "test_eval_sampling_params_follow_the_eval_flags"),
    "--mismatch-warn-threshold": (
        "apps/train/tests/test_monitors.py",
        "test_the_recorder_warns_above_the_mismatch_warn_threshold_it_is_given",
    ),
    "--output-dir": ("apps/train/tests/test_run_folder.py", "test_effective_config_reruns_into_a_new_folder"),
    "--overwrite-output-dir": (
        "apps/train/tests/test_run_folder.py",
        "test_a_folder_holding_a_run_is_refused_in_one_line_naming_both_options",
    ),
    "--recipe": (
        "apps/train/tests/test_recipes.py",
        "test_the_embedded_moe_recipe_is_the_embedded_one_on_the_moe_model_with_the_balance_loss",
    ),
    "--list-recipes": ("apps/train/tests/test_recipes.py", "test_recipe_list_lists_them"),
    "--config": ("apps/train/tests/test_config_file.py", "test_config_file_equals_flags"),
    "--sglang-host": (HANDLES, "test_a_wildcard_sglang_host_is_advertised_at_the_engines_node_address"),
    "--sglang-api-key": ("apps/train/tests/test_api_key.py", "test_clients_built_from_the_config_send_the_key"),
    "--wandb-project": (WANDB, "test_offline_run_holds_every_rollouts_metrics_and_says_where_it_is"),
    "--use-wandb": (WANDB, "test_offline_run_holds_every_rollouts_metrics_and_says_where_it_is"),
    # the actor's optimizer and compute options, on the real model over gloo
    "--adam-beta2": (ACTOR, "test_optimizer_flags_reach_adamw_and_shape_the_step"),
    "--adam-eps": (ACTOR, "test_optimizer_flags_reach_adamw_and_shape_the_step"),
    "--weight-decay": (ACTOR, "test_optimizer_flags_reach_adamw_and_shape_the_step"),
    "--lr-warmup-iters": (ACTOR, "test_optimizer_flags_reach_adamw_and_shape_the_step"),
    "--clip-grad": (ACTOR, "test_clip_grad_bounds_the_gradient_the_step_applies"),
    "--bf16": (ACTOR, "test_bf16_autocast_is_a_cuda_option_and_says_so_on_cpu"),
    "--cudnn-attention-min-tokens": (ACTOR, "test_the_cudnn_threshold_reaches_every_attention_module"),
    "--no-check-for-nan-in-loss-and-grad": (ACTOR, "test_a_non_finite_step_is_skipped_and_counted_when_asked"),
    "--no-recompute-lm-head": (FAST, "test_keeping_lm_head_logits_gives_the_same_step"),
    "--rollout-stop": (GENERATION, "test_rollout_stop_strings_end_responses_and_keep_the_tokens"),
    "--rollout-top-k": (GENERATION, "test_top_k_max_response_len_and_stop_token_ids_reach_the_engine"),
    "--rollout-max-response-len": (GENERATION, "test_top_k_max_response_len_and_stop_token_ids_reach_the_engine"),
    "--rollout-stop-token-ids": (GENERATION, "test_top_k_max_response_len_and_stop_token_ids_reach_the_engine"),
    "--no-load-optim": (
        "packages/ckpt/tests/test_checkpoint_io.py",
        "test_save_then_load_restores_the_model_and_the_rng_unless_told_not_to",
    ),
    "--no-load-rng": (
        "packages/ckpt/tests/test_checkpoint_io.py",
        "test_save_then_load_restores_the_model_and_the_rng_unless_told_not_to",
    ),
    "--offload-train": (HANDLES, "test_sync_plan_defaults_follow_the_placement"),
    "--offload-rollout": (HANDLES, "test_sync_plan_defaults_follow_the_placement"),
    "--update-weight-buffer-size": (HANDLES, "test_sync_plan_defaults_follow_the_placement"),
    "--check-weight-update-tolerance": (HANDLES, "test_a_probe_gap_above_the_tolerance_stops_the_sync_with_one_line"),
    "--input-key": (EMBEDDED, "test_the_data_flags_pick_the_keys_and_the_order_train_reads"),
    "--tool-key": (PROMPT_DATA, "test_parquet_with_nested_keys_chat_rows_tools_and_metadata_through_train"),
    "--metadata-key": (PROMPT_DATA, "test_parquet_with_nested_keys_chat_rows_tools_and_metadata_through_train"),
    "--rm-math-timeout-s": (PROMPT_DATA, "test_the_math_reward_flags_reach_the_rollout_manager"),
    "--label-key": (EMBEDDED, "test_the_data_flags_pick_the_keys_and_the_order_train_reads"),
    "--seed": (EMBEDDED, "test_the_data_flags_pick_the_keys_and_the_order_train_reads"),
    "--actor-num-nodes": (CLI, "test_placement_flags_shape_the_bundles_and_the_local_ray"),
    "--actor-num-gpus-per-node": (CLI, "test_placement_flags_shape_the_bundles_and_the_local_ray"),
    "--rollout-num-gpus-per-engine": (CLI, "test_placement_flags_shape_the_bundles_and_the_local_ray"),
    "--num-cpus-local": (CLI, "test_placement_flags_shape_the_bundles_and_the_local_ray"),
    "--ray-address": (CLI, "test_ray_address_from_the_environment_connects_like_the_flag"),
    "--ray-propagate-uv-env": (
        "packages/placement/tests/test_lifecycle.py",
        "test_ray_ships_the_uv_environment_only_with_the_flag",
    ),
    "--rollout-health-check-interval": (
        "packages/rollout/tests/test_health.py",
        "test_the_health_check_flags_set_the_heartbeat",
    ),
    "--rollout-health-check-timeout": (
        "packages/rollout/tests/test_health.py",
        "test_the_health_check_flags_set_the_heartbeat",
    ),
    "--reward-sanity-rollouts": (
        "apps/train/tests/test_monitors.py",
        "test_the_recorder_warns_after_reward_sanity_rollouts_identical_rewards",
    ),
    "--save-interval": (MODES, "test_checkpoints_hf_copies_and_evaluations_follow_their_options"),
    "--save-hf": (MODES, "test_checkpoints_hf_copies_and_evaluations_follow_their_options"),
    "--eval-interval": (MODES, "test_checkpoints_hf_copies_and_evaluations_follow_their_options"),
    "--num-eval-prompts": (MODES, "test_checkpoints_hf_copies_and_evaluations_follow_their_options"),
    "--verbose": (MODES, "test_checkpoints_hf_copies_and_evaluations_follow_their_options"),
    "--use-router": (
        ROUTER,
        "test_the_custom_generate_function_made_every_sample_through_the_router_and_in_the_workers",
    ),
    "--mask-offpolicy-in-partial-rollout": (
        "packages/rollout/tests/test_partial_rollout.py",
        "test_partial_rollout_stops_when_full_and_resumes_the_rest_next_call",
    ),
    # refusals where the option cannot act (their effect where it can is not named here yet)
    "--ref-load": (CLI, "test_bad_configuration_is_one_line_naming_the_flag_and_the_fix"),
    "--critic-load": (CLI, "test_bad_configuration_is_one_line_naming_the_flag_and_the_fix"),
    "--value-clip": (CLI, "test_bad_configuration_is_one_line_naming_the_flag_and_the_fix"),
    "--lambd": (CLI, "test_bad_configuration_is_one_line_naming_the_flag_and_the_fix"),
    "--tis-mode": (CLI, "test_bad_configuration_is_one_line_naming_the_flag_and_the_fix"),
    # a bad value, or a combination the option cannot act in, refused in one line naming it
    "--lr": (CLI, BAD_CONFIG),
    "--rollout-temperature": (CLI, BAD_CONFIG),
    "--rollout-top-p": (CLI, BAD_CONFIG),
    "--rm-type": (CLI, BAD_CONFIG),
    "--custom-rm-path": (CLI, BAD_CONFIG),
    "--ray-env": (CLI, BAD_CONFIG),
    "--colocate": (CLI, BAD_CONFIG),
    "--rollout-num-gpus": (CLI, BAD_CONFIG),
    "--hf-checkpoint": (CLI, BAD_CONFIG),
    "--prompt-data": (CLI, BAD_CONFIG),
    "--tensor-model-parallel-size": (CLI, BAD_CONFIG),
    "--context-parallel-size": (CLI, BAD_CONFIG),
    "--expert-tensor-parallel-size": (CLI, BAD_CONFIG),
    "--moe-router-dtype": (CLI, BAD_CONFIG),
    "--use-kl-loss": (CLI, BAD_CONFIG),
    "--start-rollout-id": (CLI, BAD_CONFIG),
    "--ckpt-step": (CLI, BAD_CONFIG),
    "--keep-last": (CLI, BAD_CONFIG),
    "--rollout-external": (CLI, BAD_CONFIG),
    "--use-fault-tolerance": (CLI, BAD_CONFIG),
    "--update-weight-transport": (CLI, BAD_CONFIG),
    "--update-weight-delta": (
        "tests/test_delta_sync.py",
        "test_a_server_serving_another_version_gets_the_next_sync_whole_then_deltas_again",
    ),
    "--offload": (CLI, BAD_CONFIG),
    "--update-weight-timeout": (CLI, BAD_CONFIG),
    "--custom-loss-function-path": (CLI, BAD_CONFIG),
    "--custom-advantage-function-path": (CLI, BAD_CONFIG),
    "--sglang-startup-timeout-s": (CLI, BAD_CONFIG),
    "--rollout-request-timeout-s": (CLI, BAD_CONFIG),
    "--rollout-request-retries": (CLI, BAD_CONFIG),
    "--generate-max-concurrency": (CLI, BAD_CONFIG),
    "--code-sandbox-max-concurrency": (CODE, "test_memory_and_concurrency_follow_their_options"),
    "--code-sandbox-memory-mb": (CODE, "test_memory_and_concurrency_follow_their_options"),
    "--code-sandbox-timeout-s": (
        CODE,
        "test_hostile_programs_are_contained_scored_zero_with_their_reason_and_the_run_goes_on",
    ),
    "--environment": ("apps/train/tests/test_environments.py", "test_an_environment_is_an_agent_run_on_its_own_rows"),
    "--agent-function-path": (
        "packages/rollout/tests/test_gateway_agents.py",
        "test_groups_of_episodes_replace_a_failed_group_and_record_why",
    ),
    "--agent-timeout-s": (
        "packages/rollout/tests/test_gateway_agents.py",
        "test_groups_of_episodes_replace_a_failed_group_and_record_why",
    ),
    "--agent-max-concurrency": (
        "tests/test_agent_engine_restart.py",
        "test_agent_max_concurrency_bounds_the_episodes_in_flight",
    ),
    "--tool-call-parser": ("apps/train/tests/test_agents.py", "test_the_tool_call_parser_reaches_the_agents_gateway"),
    "--adam-beta1": (CLI, BAD_CONFIG),
    "--log-probs-chunk-size": (CLI, BAD_CONFIG),
    "--max-shard-bytes": (CLI, BAD_CONFIG),
    "--num-cpus-per-bundle": (CLI, BAD_CONFIG),
    "--placement-timeout": (CLI, BAD_CONFIG),
    "--num-gpus-local": (CLI, BAD_CONFIG),
    "--lora-target-modules": (CLI, BAD_CONFIG),
}

_GAPS = """

"""
GAPS = frozenset(_GAPS.split())
"""Options no test is pointed at yet (many are exercised by tests not yet named here); each must move to COVERED."""

MUTANT_VALUES: dict[str, str] = {}
"""Option -> the value its mutant takes (as ``TIDAL_OPTION_MUTANT=--flag=VALUE`` spells it) where the named test
already runs the option's default, so that going back to the default would change nothing."""


def named_test_id(option: str) -> str:
    """The pytest id of the test named for ``option`` (``path::test``, from the repository root)."""
    path, name = COVERED[option]
    return f"{path}::{name}"


def mutant_text(option: str) -> str:
    """What ``TIDAL_OPTION_MUTANT`` is set to for ``option``'s mutant: ``--flag`` or ``--flag=VALUE``."""
    return f"{option}={MUTANT_VALUES[option]}" if option in MUTANT_VALUES else option


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
def test_each_named_test_exists(option):
    path, name = COVERED[option]
    file = ROOT / path
    assert file.is_file(), f"{option}: {path} does not exist"
    assert name.split("[", 1)[0] in _test_names(file), f"{option}: {path} has no test {name}"


@pytest.mark.parametrize("option", sorted(COVERED))
def test_each_option_has_a_mutant_that_changes_its_value(option):
    mutant = parse_mutant(mutant_text(option))
    assert mutant.flag == option or option in APP_FLAGS
    if option in MUTANT_VALUES:
        from tidal.train.flags import options

        default = next(o.default for o in options() if o.flag == option)
        assert mutant.value != default, f"{option}: MUTANT_VALUES gives its default; the mutant would change nothing"


def test_no_entry_names_an_option_train_does_not_have():
    assert not (set(COVERED) | GAPS | set(MUTANT_VALUES)) - set(train_options())
