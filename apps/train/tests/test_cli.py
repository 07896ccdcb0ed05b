import subprocess
import sys
import time

import pytest
from tidal.train.cli import parse_job

BAD = [
    (["--lr", "-1"], "--lr"),
    (["--rollout-batch-size", "0"], "--rollout-batch-size"),
    (["--n-samples-per-prompt", "0"], "--n-samples-per-prompt"),
    (["--num-rollout", "0"], "--num-rollout"),
    (["--rollout-temperature", "-0.5"], "--rollout-temperature"),
    (["--eps-clip", "0"], "--eps-clip"),
    (["--kl-loss-type", "k9"], "--kl-loss-type"),
    (["--rm-type", "vibes"], "--rm-type"),
    (["--custom-rm-path", "no_colon"], "--custom-rm-path"),
    (["--ray-env", "NOVALUE"], "--ray-env"),
    (["--rollout-num-gpus", "3", "--rollout-num-gpus-per-engine", "2"], "--rollout-num-gpus"),
    (["--rollout-num-gpus", "2", "--colocate"], "--colocate"),
    (["--global-batch-size", "48"], "--global-batch-size"),
    (["--use-dynamic-batch-size", "--max-tokens-per-gpu", "0"], "--max-tokens-per-gpu"),
    (["--hf-checkpoint", "/nonexistent/model", "--prompt-data", __file__], "--hf-checkpoint"),
    (["--prompt-data", "/nonexistent.jsonl"], "--prompt-data"),
    (["--not-a-flag", "1"], "--not-a-flag"),
    (["--debug-train-only"], "--load-debug-rollout-data"),
    (["--debug-rollout-only", "--debug-train-only"], "--debug-rollout-only"),
    (["--tensor-model-parallel-size", "2"], "--tensor-model-parallel-size"),
    (["--pipeline-model-parallel-size", "0"], "--pipeline-model-parallel-size"),
    (["--pipeline-model-parallel-size", "2"], "--pipeline-model-parallel-size"),  # 1 actor GPU
    (
        ["--actor-num-gpus-per-node", "4", "--pipeline-model-parallel-size", "2", "--context-parallel-size", "2"],
        "--context-parallel-size",
    ),
    (["--advantage-estimator", "magic"], "--advantage-estimator"),
    (["--eps-clip-c", "0.5"], "--eps-clip-c"),
    (["--use-kl-loss"], "--kl-loss-coef"),
    (["--num-rollout", "3", "--start-rollout-id", "3"], "--start-rollout-id"),
    (["--load", "/nonexistent/ckpt"], "--load"),
    (["--ckpt-step", "5"], "--ckpt-step"),
    (["--config", "/nonexistent.yaml"], "--config"),
    (["--update-weights-interval", "0"], "--update-weights-interval"),
    (["--keep-last", "0"], "--keep-last"),
    (["--rollout-external"], "--rollout-external-engine-addrs"),
    (["--rollout-external-engine-addrs", "localhost"], "--rollout-external-engine-addrs"),
    (["--rollout-external-engine-addrs", "h:1", "h:1"], "--rollout-external-engine-addrs"),
    (["--rollout-external-engine-addrs", "h:1", "--use-fault-tolerance"], "--use-fault-tolerance"),
    (["--rollout-external-engine-addrs", "h:1", "--no-colocate"], "--no-colocate"),
    (["--rollout-request-timeout-s", "0"], "--rollout-request-timeout-s"),
    (["--rollout-request-retries", "-1"], "--rollout-request-retries"),
]


@pytest.mark.parametrize(("argv", "flag"), BAD, ids=[b[1] + str(i) for i, b in enumerate(BAD)])
def test_bad_configuration_names_the_flag(argv, flag):
    with pytest.raises(ValueError, match=flag):
        parse_job(argv)


def test_load_without_tracker_names_the_iterations_and_the_fix(tmp_path):
    for name in ("iter_0000050", "iter_0000100"):  # complete saves (the marker exists) but no tracker file
        (tmp_path / name).mkdir()
        (tmp_path / name / "metadata.json").write_text("{}")
    with pytest.raises(ValueError, match="--load") as info:
        parse_job(["--load", str(tmp_path)])
    assert "latest_checkpointed_iteration.txt" in str(info.value)
    assert "--ckpt-step" in str(info.value)


def test_load_of_an_hf_checkpoint_says_to_use_hf_checkpoint(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="--hf-checkpoint"):
        parse_job(["--load", str(tmp_path)])


def test_default_job_is_valid_and_consistent():
    job = parse_job([])
    assert job.actor.hf_checkpoint.endswith(job.actor.hf_checkpoint.split("/")[-1])
    assert job.batching.n_samples_per_prompt == job.rollout.n_samples_per_prompt
    assert job.batching.resolve(dp_size=job.placement.num_actor_gpus).rollout_size == (
        job.batching.rollout_batch_size * job.rollout.n_samples_per_prompt
    )
    # the engines serve in the actor's dtype unless told otherwise
    assert job.rollout.sglang_server_args[-2:] == ("--dtype", job.actor.params_dtype)


def test_memory_flags_reach_the_actor():
    job = parse_job(["--params-dtype", "bfloat16", "--fp32-main-params", "--optimizer-cpu-offload"])
    assert job.actor.fp32_main_params and job.actor.optimizer_cpu_offload
    assert not parse_job([]).actor.optimizer_cpu_offload
    assert parse_job([]).actor.recompute_lm_head and not parse_job(["--no-recompute-lm-head"]).actor.recompute_lm_head
    with pytest.raises(ValueError, match="--fp32-main-params"):
        parse_job(["--fp32-main-params"])  # float32 parameters have no main copies


def test_sglang_flags_pass_through():
    job = parse_job(["--sglang-mem-fraction-static", "0.5", "--sglang-dtype", "bfloat16"])
    assert job.rollout.sglang_server_args == ("--mem-fraction-static", "0.5", "--dtype", "bfloat16")


def test_a_config_error_answers_in_seconds_with_one_line():
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "tidal.train.cli", "--lr", "-1"], capture_output=True, text=True, timeout=120
    )
    elapsed = time.monotonic() - start
    assert proc.returncode == 2
    assert proc.stderr.strip() == "train: error: --lr must be >= 0, got -1.0"
    # Parsing must not import the heavy stacks; a generous bound that still catches a megatron import (~10 s+).
    assert elapsed < 30, elapsed


@pytest.mark.skipif(__import__("importlib").util.find_spec("wandb") is not None, reason="wandb is installed here")
def test_use_wandb_without_wandb_says_how_to_install_it():
    with pytest.raises(ValueError, match="--use-wandb needs the wandb package"):
        parse_job(["--use-wandb"])


def test_external_engines_parse_to_urls():
    job = parse_job(["--rollout-external", "--rollout-external-engine-addrs", "127.0.0.1:30000", "10.0.0.5:30001"])
    assert job.rollout.external_engine_urls() == ["http://127.0.0.1:30000", "http://10.0.0.5:30001"]


def test_pipeline_stages_must_divide_the_layers(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "qwen2", "num_hidden_layers": 3}')
    argv = ["--hf-checkpoint", str(tmp_path), "--prompt-data", __file__, "--rollout-batch-size", "4"]
    argv += ["--actor-num-gpus-per-node", "4"]
    with pytest.raises(ValueError, match="--pipeline-model-parallel-size 2 does not divide the model's 3 layers"):
        parse_job([*argv, "--pipeline-model-parallel-size", "2"])
    job = parse_job([*argv, "--pipeline-model-parallel-size", "3", "--actor-num-gpus-per-node", "3"])
    assert job.train.pipeline_model_parallel_size == 3
