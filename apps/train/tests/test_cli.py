import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tidal.placement import ResourceShortageError
from tidal.train.checks import ConfigErrors
from tidal.train.cli import main, parse_job, validate

# A user's model folder and data, for the cases that leave the embedded default.
USER = ["--recipe", "base", "--hf-checkpoint", "{model}", "--prompt-data", "{data}", "--rollout-batch-size", "4"]

# (argv, what the message must say[, CUDA GPUs of the machine: 0 is a CPU-only box])
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
    (["--log-probs-max-tokens-per-gpu", "0"], "--log-probs-max-tokens-per-gpu must be >= 1, got 0"),
    (["--recipe", "base", "--hf-checkpoint", "/nonexistent/model", "--prompt-data", __file__], "--hf-checkpoint"),
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
    (["--expert-model-parallel-size", "2"], "--expert-model-parallel-size 2 does not divide the 1 actor GPU"),
    (["--expert-tensor-parallel-size", "2"], "--expert-tensor-parallel-size"),
    (["--moe-router-dtype", "bf16"], "--moe-router-dtype"),
    (["--use-rollout-routing-replay"], "--use-rollout-routing-replay replays the experts of a mixture-of-experts"),
    (["--moe-aux-loss-coeff", "-1"], "--moe-aux-loss-coeff"),
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
    (["--rollout-external-engine-addrs", "h:1", "--rollout-num-gpus", "1"], "--rollout-num-gpus 1"),
    (["--rollout-num-gpus", "0"], "--rollout-num-gpus 0 places no SGLang engine"),
    (["--update-weight-transport", "rdma"], "--update-weight-transport must be one of tensor, nccl, disk"),
    (["--update-weight-transport", "tensor", "--rollout-external-engine-addrs", "h:1"], "transport nccl"),
    (["--update-weight-delta", "--lora-rank", "8"], "--update-weight-delta with --lora-rank 8 is not supported"),
    (["--rollout-external-engine-addrs", "h:1", "--offload"], "drop --offload-rollout"),
    (["--update-weight-timeout", "0"], "--update-weight-timeout must be > 0"),
    (["--code-sandbox-max-concurrency", "0"], "--code-sandbox-max-concurrency must be >= 1, got 0"),
    (["--code-sandbox-timeout-s", "0"], "--code-sandbox-timeout-s must be > 0"),
    (["--code-sandbox-memory-mb", "16"], "--code-sandbox-memory-mb must be >= 64"),
    # mistakes a new user makes: each is one line before anything starts
    (
        [
            "--recipe",
            "base",
            "--hf-checkpoint",
            "{model}",
            "--prompt-data",
            "{data}",
            "--rm-type",
            "math",
            "--num-rollout",
            "100",
        ],
        "--rollout-batch-size is required",
    ),  # the README's example as it was
    (["--actor-num-gpus-per-node", "64", "--rollout-num-gpus", "8"], "needs 64 GPUs.*available: none"),  # CPU box
    (["--actor-num-gpus-per-node", "64", "--rollout-num-gpus", "8"], "needs 64 GPUs.*available: 8 CUDA GPU", 8),
    ([*USER, "--actor-num-gpus-per-node", "1"], r"needs 2 GPUs \(decoupled, --no-colocate.*--colocate", 1),
    (["--custom-rm-path", "no_such_module:fn"], "--custom-rm-path 'no_such_module:fn': cannot import"),
    (["--custom-rm-path", "json:no_such_fn"], "has no attribute 'no_such_fn'"),
    (["--custom-rm-path", "os.path:sep"], "not a function"),
    (["--custom-generate-function-path", "no_such_module:fn"], "--custom-generate-function-path"),
    (["--dynamic-sampling-filter-path", "no_such_module:fn"], "--dynamic-sampling-filter-path"),
    (
        ["--loss-type", "custom_loss", "--custom-loss-function-path", "no_such_module:fn"],
        "--custom-loss-function-path 'no_such_module:fn': cannot import",
    ),
    (["--custom-loss-function-path", "math:sqrt"], "--loss-type custom_loss and --custom-loss-function-path"),
    (["--custom-advantage-function-path", "json:no_such_fn"], "--custom-advantage-function-path .*no_such_fn"),
    (["--gamma", "2"], "--gamma must be in"),
    (["--overlong-buffer-len", "64", "--rollout-max-response-len", "64"], "--overlong-buffer-len must be in"),
    (["--save", "{file}"], "--save .* is a file"),
    (["--output-dir", "{file}"], "--output-dir .* is a file"),
    (["--save-debug-rollout-data", "{file}"], "--save-debug-rollout-data .* is a file"),
    (["--output-dir", "{file}/run"], "--output-dir .* cannot be created"),
    (
        ["--use-dynamic-batch-size", "--max-tokens-per-gpu", "16", "--rollout-max-response-len", "256"],
        "--max-tokens-per-gpu 16 cannot hold one sample",
    ),
    (
        ["--log-probs-max-tokens-per-gpu", "200", "--rollout-max-response-len", "256"],  # the recipe's 8192 holds it
        "--log-probs-max-tokens-per-gpu 200 cannot hold one sample: .* raise --log-probs-max-tokens-per-gpu above",
    ),
    (["--global-batch-size", "2", "--actor-num-gpus-per-node", "4"], "--global-batch-size 2 is not divisible by"),
    (["--num-steps-per-rollout", "7"], "--num-steps-per-rollout 7 does not divide"),
    (["--sglang-startup-timeout-s", "0"], "--sglang-startup-timeout-s must be > 0"),  # a real flag, not forwarded
    (["--rollout-request-timeout-s", "0"], "--rollout-request-timeout-s must be > 0"),
    (["--rollout-request-retries", "-1"], "--rollout-request-retries must be >= 0"),
    (["--generate-max-concurrency", "0"], "--generate-max-concurrency must be >= 1"),
    (["--dynamic-sampling-max-rounds", "0"], "--dynamic-sampling-max-rounds must be >= 1"),
    (["--adam-beta1", "1.5"], "--adam-beta1 must be in"),
    (["--log-probs-chunk-size", "0"], "--log-probs-chunk-size must be >= 1"),
    (["--max-shard-bytes", "0"], "--max-shard-bytes must be >= 1"),
    (["--mismatch-warn-threshold", "-0.1"], "--mismatch-warn-threshold must be >= 0 nats"),
    (["--mismatch-warn-threshold", "nan"], "--mismatch-warn-threshold must be >= 0 nats"),
    (["--num-cpus-per-bundle", "0"], "--num-cpus-per-bundle"),
    (["--placement-timeout", "0"], "--placement-timeout"),
    (["--num-gpus-local", "4"], "--num-gpus-local 4 exceeds the 1 CUDA GPU", 1),
    (
        [
            "--recipe",
            "base",
            "--hf-checkpoint",
            "{notokenizer}",
            "--prompt-data",
            "{data}",
            "--rollout-batch-size",
            "4",
        ],
        "has no tokenizer",
    ),
    (
        ["--recipe", "base", "--hf-checkpoint", "{noweights}", "--prompt-data", "{data}", "--rollout-batch-size", "4"],
        "has no weights",
    ),
    (["--prompt-data", "{qa}"], "--prompt-data .* no key 'prompt'.*set --input-key"),
    (["--prompt-data", "{qa}", "--input-key", "question"], "no key 'label'.*set --label-key"),
    (["--prompt-data", "{empty}"], "--prompt-data .* holds no records"),
    (["--eval-prompt-data", "/nonexistent.jsonl"], "--eval-prompt-data /nonexistent.jsonl is not a file"),
    (["--eval-prompt-data", "a", "{data}", "b", "/nonexistent.jsonl"], "--eval-prompt-data /nonexistent.jsonl is not"),
    (["--eval-prompt-data", "a", "{data}", "b"], "--eval-prompt-data takes PATH or NAME PATH"),
    (["--n-samples-per-eval-prompt", "0"], "--n-samples-per-eval-prompt must be >= 1"),
    (["--eval-prompt-data", "a", "{data}", "--keep-best-by", "eval/b/mean@1"], "--keep-best-by eval/b/mean@1 is no"),
    (["--eval-top-p", "0"], "--eval-top-p in"),
    (["--lr", "abc"], "argument --lr: invalid float value"),
    (["--rollout-batch-sise", "4"], "did you mean --rollout-batch-size"),
    (["oops"], "unexpected argument 'oops'"),
    (["--rollout-top-p", "0"], "--rollout-top-p"),
    (["--sglang-router-policy", "fastest"], "--sglang-router-policy"),
    (["--micro-batch-size", "0"], "--micro-batch-size"),
    (["--context-parallel-size", "2"], "--context-parallel-size"),
    (["--debug-train-only", "--load-debug-rollout-data", "/nonexistent"], "--load-debug-rollout-data .* not a dir"),
    (["--partial-rollout", "--rollout-external-engine-addrs", "h:1", "h:2", "--no-use-router"], "drop --no-use-router"),
    (["--max-staleness", "-1"], "--max-staleness must be >= 0"),
    (["--tis-mode", "clip"], "--tis-mode must be one of"),
    (["--max-staleness", "1"], "--max-staleness 1 .* --colocate the engines share the actor's GPUs.*--no-colocate"),
    (
        ["--max-staleness", "2", "--no-colocate", "--rollout-num-gpus", "1", "--update-weights-interval", "2"],
        "--update-weights-interval 2",
    ),
    (
        ["--max-staleness", "1", "--rollout-external-engine-addrs", "h:1", "--debug-rollout-only"],
        "--max-staleness 1 .*--debug-rollout-only",
    ),
    (["--value-clip", "0.2"], "^--value-clip .*only --advantage-estimator ppo has .*pass --advantage-estimator ppo"),
    (["--num-critic-only-steps", "2"], "^--num-critic-only-steps .*--advantage-estimator ppo"),
    (["--advantage-estimator", "grpo", "--lambd", "0.95"], "^--lambd .*--advantage-estimator grpo"),
    (["--critic-lr", "1e-5"], "^--critic-lr .*--advantage-estimator ppo"),
    (["--advantage-estimator", "ppo", "--lambd", "2"], "^--lambd must be in \\[0, 1\\]"),
    (["--advantage-estimator", "ppo", "--value-clip", "-1"], "^--value-clip must be > 0"),
    (["--critic-load", "{file}"], "^--critic-load starts the critic of --advantage-estimator ppo"),
    (["--advantage-estimator", "ppo", "--critic-load", "/nonexistent"], "^--critic-load /nonexistent does not exist"),
    (
        ["--custom-generate-function-path", "json:loads", "--partial-rollout"],
        "^--partial-rollout resumes a cut response as one continuation, and a --custom-generate-function-path sample "
        r"\(several turns, inserted tokens\) cannot be resumed that way: drop --partial-rollout or "
        "--custom-generate-function-path$",
    ),
    (["--ref-load", "/nonexistent"], "^--ref-load /nonexistent loads the reference model of a KL term, and this run"),
    (["--use-kl-loss", "--kl-loss-coef", "0.01", "--ref-load", "/no/ref"], "^--ref-load /no/ref does not exist"),
    (["--kl-coef", "0.01", "--ref-load", "{file}"], "^--ref-load .* is a file, not a checkpoint directory"),
    (["--kl-loss-coef", "0.01", "--ref-load", "{model}"], "^--ref-load .* and this run has none"),  # no --use-kl-loss
    (
        ["--lora-rank", "4", "--use-kl-loss", "--kl-loss-coef", "0.01", "--ref-load", "{model}"],
        r"^--ref-load .* with --lora-rank 4: a LoRA run's reference is its base model .*drop --ref-load$",
    ),
    (["--lora-rank", "-1"], r"^--lora-rank must be >= 0 \(0: full fine-tuning"),
    (["--lora-rank", "4", "--lora-target-modules", "qkv"], "^--lora-target-modules 'qkv' matches no linear module"),
    (["--lora-rank", "4", "--advantage-estimator", "ppo"], "^--lora-rank 4 with --advantage-estimator ppo"),
    (
        ["--lora-rank", "4", "--no-colocate", "--update-weight-transport", "nccl"],
        r"^--update-weight-transport nccl with --lora-rank 4: SGLang loads LoRA adapters from tensors or from disk",
    ),
]


def _write_model(folder: Path, *, tokenizer: bool = True, weights: bool = True, layers: int = 4) -> Path:
    """The files parse_job looks at in an HF model folder (none is loaded at parse time)."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen2", "num_hidden_layers": layers}))
    if tokenizer:
        (folder / "tokenizer.json").write_text("{}")
    if weights:
        (folder / "model.safetensors").write_bytes(b"")
    return folder


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("inputs")
    (root / "data.jsonl").write_text('{"prompt": "1+1=", "label": "2"}\n')
    (root / "qa.jsonl").write_text('{"question": "1+1=", "answer": "2"}\n')
    (root / "empty.jsonl").write_text("\n")
    return {
        "model": str(_write_model(root / "model")),
        "notokenizer": str(_write_model(root / "notok", tokenizer=False)),
        "noweights": str(_write_model(root / "noweights", weights=False)),
        "data": str(root / "data.jsonl"),
        "qa": str(root / "qa.jsonl"),
        "empty": str(root / "empty.jsonl"),
        "file": str(root / "data.jsonl"),
    }


def _fill(argv: list[str], paths: dict[str, str]) -> list[str]:
    return [a.format(**paths) if "{" in a else a for a in argv]


def _error(argv: list[str], gpus: int = 0) -> str:
    """The message ``validate`` answers with, on a machine with ``gpus`` CUDA GPUs (it must fail)."""
    with pytest.raises((ValueError, ResourceShortageError)) as info:
        validate(argv, detected_gpus=gpus)
    return str(info.value)


@pytest.mark.parametrize("case", BAD, ids=[f"{i}:{c[1][:40]}" for i, c in enumerate(BAD)])
def test_bad_configuration_is_one_line_naming_the_flag_and_the_fix(case, paths):
    argv, expected, *gpus = case
    start = time.monotonic()
    message = _error(_fill(argv, paths), *gpus)
    assert re.search(expected, message), message
    assert "Traceback" not in message
    assert time.monotonic() - start < 5  # no process started: milliseconds, but the import of a user module


def test_the_table_has_at_least_40_bad_configurations():
    assert len(BAD) >= 40


def test_independent_errors_come_together_one_line_each():
    with pytest.raises(ConfigErrors) as info:
        parse_job(["--lr", "-1", "--rollout-top-p", "0", "--keep-last", "0", "--custom-rm-path", "no_such_mod:fn"])
    problems = info.value.problems
    assert len(problems) == 4, problems
    for flag in ("--lr", "--rollout-top-p", "--keep-last", "--custom-rm-path"):
        assert sum(flag in p for p in problems) == 1, (flag, problems)
    assert all("\n" not in p for p in problems)


def test_readme_example_parses_with_its_batch_size(paths):
    readme = ["--recipe", "base", "--hf-checkpoint", "{model}", "--prompt-data", "{data}", "--rm-type", "math",
              "--num-rollout", "100"]  # fmt: skip
    argv = _fill(readme, paths)
    job = validate([*argv, "--rollout-batch-size", "32", "--n-samples-per-prompt", "8"], detected_gpus=0)
    # outside the embedded recipe, actor and rollout get their own GPUs (slime's default): 1 + 1
    assert not job.placement.colocate and job.placement.num_gpus == 2
    assert job.batching.rollout_batch_size == 32


def test_gpus_a_local_ray_declares(paths):
    from tidal.train.cli import check_local_gpus

    cpu = check_local_gpus(parse_job([]), detected_gpus=0)  # the embedded default on a CPU-only box
    assert cpu.logical and cpu.num_gpus == 1
    user = parse_job([*_fill(USER, paths), "--actor-num-gpus-per-node", "2"])
    gpu = check_local_gpus(user, detected_gpus=8)  # real GPUs: all of them, whatever the job asks
    assert not gpu.logical and gpu.num_gpus == 8
    assert check_local_gpus(parse_job(["--ray-address", "10.0.0.1:6379"]), detected_gpus=0) is None
    external = parse_job([*_fill(USER, paths), "--rollout-external-engine-addrs", "h:1"])
    assert not external.placement.colocate and external.placement.num_gpus == 1  # nothing reserved for them
    assert external.placement.num_engines == 0 and external.placement.rollout_num_gpus == 0


def _console_script() -> str:
    script = Path(sys.executable).parent / "train"
    return str(script) if script.exists() else shutil.which("train")


CONSOLE = [
    (["--lr", "-1"], ["train: error: --lr must be >= 0, got -1.0"]),
    (["--actor-num-gpus-per-node", "64", "--rollout-num-gpus", "8"], ["needs 64 GPUs"]),
    (["--lr", "-1", "--rollout-top-p", "0"], ["--lr must be", "--rollout-top-p must be"]),
]


@pytest.mark.parametrize(("argv", "lines"), CONSOLE, ids=[c[1][0][:30] for c in CONSOLE])
def test_the_console_script_answers_in_seconds_with_one_line_per_problem(argv, lines):
    start = time.monotonic()
    proc = subprocess.run([_console_script(), *argv], capture_output=True, text=True, timeout=120)
    elapsed = time.monotonic() - start
    assert proc.returncode == 2, proc.stderr
    errors = proc.stderr.strip().splitlines()
    assert len(errors) == len(lines), proc.stderr
    for got, want in zip(errors, lines, strict=True):
        assert got.startswith("train: error: ") and want in got, got
    assert "Traceback" not in proc.stderr
    # Parsing must not import the heavy stacks; a generous bound that still catches a torch or Ray import.
    assert elapsed < 15, elapsed


def test_parsing_imports_no_heavy_stack():
    code = (
        "import sys; from tidal.train.cli import validate; validate([], detected_gpus=0); "
        "print(sorted(m for m in ('torch', 'ray', 'sglang', 'megatron', 'transformers') if m in sys.modules))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip() == "[]", proc.stdout + proc.stderr


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


def test_sglang_flags_in_the_equals_form_reach_sglang_as_the_two_token_form_does():
    from tidal.train.config_file import effective_options

    two = parse_job(["--sglang-mem-fraction-static", "0.5", "--sglang-dtype", "bfloat16", "--sglang-tp-size", "1"])
    one = parse_job(["--sglang-mem-fraction-static=0.5", "--sglang-dtype=bfloat16", "--sglang-tp-size=1"])
    assert one.rollout.sglang_server_args == two.rollout.sglang_server_args
    assert one.rollout.sglang_server_args == ("--mem-fraction-static", "0.5", "--dtype", "bfloat16", "--tp-size", "1")
    assert effective_options(one)["sglang-dtype"] == "bfloat16"  # config.yaml reruns it as given
    router = parse_job(["--use-router", "--sglang-router-cache-threshold=0.3"])
    assert router.rollout.sglang_router_args == ("--cache-threshold", "0.3")


def test_pass_through_values_tidal_reads_are_checked_before_anything_starts():
    for argv in (["--sglang-mem-fraction-static", "1.5"], ["--sglang-mem-fraction-static=0"]):
        with pytest.raises(ConfigErrors) as info:
            parse_job(argv)
        (line,) = info.value.problems
        assert line.startswith(f"--sglang-mem-fraction-static {argv[-1].split('=')[-1]}: must be in (0, 1)"), line
    with pytest.raises(ConfigErrors, match=r"--sglang-dtype nope: sglang\.launch_server refuses it"):
        parse_job(["--sglang-dtype=nope"])
    with pytest.raises(ConfigErrors) as info:  # flags tidal sets on each server and on the router
        parse_job(["--sglang-port=30000", "--sglang-model-path", "/m", "--use-router", "--sglang-router-port", "1"])
    assert [line.split(" is set by tidal")[0] for line in info.value.problems] == [
        "--sglang-model-path",
        "--sglang-port",
        "--sglang-router-port",
    ]
    assert parse_job(["--sglang-mem-fraction-static", "0.85"]).rollout.sglang_server_args[:2] == (
        "--mem-fraction-static",
        "0.85",
    )


def test_each_engine_is_given_tp_over_its_gpus_and_a_disagreeing_sglang_tp_size_is_one_line():
    layout = ["--actor-num-gpus-per-node", "2", "--rollout-num-gpus", "2", "--rollout-num-gpus-per-engine", "2"]
    with pytest.raises(ConfigErrors, match="--sglang-tp-size 1 disagrees with --rollout-num-gpus-per-engine 2"):
        parse_job([*layout, "--sglang-tp-size", "1"])
    assert parse_job([*layout, "--sglang-tp-size", "2"]).rollout.sglang_server_args[:2] == ("--tp-size", "2")


def test_sglang_pass_through_is_checked_by_sglangs_own_parsers_one_line_per_flag():
    argv = ["--sglang-mem-fraction-static", "abc", "--sglang-attention-backend", "nope", "--sglang-mem-fraction-statc",
            "0.5", "--sglang-enable-metrics", "yes", "--sglang-router-cache-threshold", "x", "--lr", "-1"]  # fmt: skip
    start = time.monotonic()
    with pytest.raises(ConfigErrors) as info:
        parse_job(argv)
    elapsed = time.monotonic() - start
    expected = [
        "--sglang-mem-fraction-static abc: sglang.launch_server refuses it (argument --mem-fraction-static: invalid "
        "float value: 'abc')",
        "--sglang-attention-backend nope: sglang.launch_server refuses it (argument --attention-backend: invalid "
        "choice: 'nope' (choose from ",
        "--sglang-mem-fraction-statc is not an option of sglang.launch_server (tidal passes --sglang-X on as --X); "
        "did you mean --sglang-mem-fraction-static?",
        "--sglang-enable-metrics yes: sglang.launch_server takes no value 'yes' after --enable-metrics",
        "--sglang-router-cache-threshold x: sglang_router.launch_router refuses it (argument --cache-threshold: "
        "invalid float value: 'x')",
        "--lr must be >= 0",
    ]
    problems = info.value.problems
    assert len(problems) == len(expected), problems
    for got, want in zip(problems, expected, strict=True):
        assert got.startswith(want) and "\n" not in got, (got, want)
    assert elapsed < 30, elapsed  # sglang's parser imports torch (about 4 s alone); nothing starts
    good = ["--sglang-mem-fraction-static", "0.5", "--sglang-enable-metrics", "--sglang-router-cache-threshold", "0.3"]
    job = parse_job(good)
    assert job.rollout.sglang_server_args[:3] == ("--mem-fraction-static", "0.5", "--enable-metrics")
    assert job.rollout.sglang_router_args == ("--cache-threshold", "0.3")


def test_a_custom_generate_function_is_accepted_on_every_path_but_partial_rollout():
    job = parse_job(["--custom-generate-function-path", "json:loads"])  # one engine, no router: each worker calls it
    assert job.rollout.custom_generate_function_path == "json:loads"
    assert not job.rollout.router_wanted(job.placement.num_engines)
    # The driver-side paths call it in the driver (tests/test_train_router_e2e.py runs it through the router).
    for extra in (["--dynamic-sampling-filter-path", "reward_variance"], ["--use-router"]):
        job = parse_job(["--custom-generate-function-path", "json:loads", *extra])
        assert job.rollout.custom_generate_function_path == "json:loads"
    job = parse_job(["--custom-generate-function-path", "json:loads", "--rollout-external-engine-addrs", "h:1", "h:2"])
    assert job.rollout.router_wanted(2)


def test_hf_checkpoint_without_recipe_reports_the_folder_as_well():
    with pytest.raises(ConfigErrors) as info:
        parse_job(["--hf-checkpoint", "/no/such/dir"])
    problems = info.value.problems
    assert len(problems) == 2, problems
    assert problems[0].startswith("--hf-checkpoint is given without --recipe: add --recipe base")
    assert problems[1] == "--hf-checkpoint /no/such/dir has no config.json; point it at a Hugging Face model directory"


def test_wandb_flags_reach_the_logging_section_and_warn_without_use_wandb(tmp_path, caplog):
    flags = ["--wandb-mode", "offline", "--wandb-project", "p", "--wandb-group", "g", "--wandb-host", "http://h:1"]
    job = parse_job(["--output-dir", str(tmp_path / "a"), "--use-wandb", *flags])
    log = job.logging
    assert (log.use_wandb, log.wandb_mode, log.wandb_project, log.wandb_group, log.wandb_host) == (
        True, "offline", "p", "g", "http://h:1",
    )  # fmt: skip
    assert "no effect" not in caplog.text
    parse_job(["--output-dir", str(tmp_path / "b"), *flags])
    for flag in ("--wandb-mode", "--wandb-project", "--wandb-group", "--wandb-host"):
        assert caplog.text.count(f"{flag} has no effect without --use-wandb") == 1, caplog.text


def test_wandb_mode_must_be_one_of_its_choices():
    with pytest.raises(ValueError, match="--wandb-mode must be one of online, offline, disabled, got 'dryrun'"):
        parse_job(["--use-wandb", "--wandb-mode", "dryrun"])


def test_external_engines_parse_to_urls():
    job = parse_job(["--rollout-external", "--rollout-external-engine-addrs", "127.0.0.1:30000", "10.0.0.5:30001"])
    assert job.rollout.external_engine_urls() == ["http://127.0.0.1:30000", "http://10.0.0.5:30001"]


def _fail_in_run(monkeypatch, error: BaseException) -> None:
    import tidal.train.loop

    def run(job):
        raise error

    monkeypatch.setattr(tidal.train.loop, "run", run)


def _ray_task_error(cause: BaseException, *, prefix: str = ""):
    """The RayTaskError a worker's method that raised ``cause`` produces (``prefix``: text before its traceback)."""
    import traceback

    from ray.exceptions import RayTaskError

    try:
        raise cause
    except BaseException:
        return RayTaskError("EngineWorker.generate_samples", prefix + traceback.format_exc(), cause)


def _raised_by_ray_get(cause: BaseException) -> BaseException:
    """What ``ray.get`` raises when a worker's method raised ``cause``: the RayTaskError, also a ``cause``'s type."""
    return _ray_task_error(cause).as_instanceof_cause()


@pytest.mark.parametrize(
    ("make_error", "line"),
    [
        (lambda: _rollout_error("SGLang engine 0 died (exit 9); its log: runs/x/logs/engine0.log"), "engine 0 died"),
        (lambda: _raised_by_ray_get(_rollout_error("engine 1 died; its log: L")), "engine 1 died; its log: L"),
        (lambda: ResourceShortageError("Not enough resources: needs 8 GPUs, has 4.\n    node ..."), "needs 8 GPUs"),
        (lambda: ZeroDivisionError("division by zero"), "unexpected ZeroDivisionError: division by zero"),
        (lambda: _raised_by_ray_get(KeyError("weights")), "unexpected KeyError: 'weights'"),
        (
            lambda: _actor_died_in_init(OSError("EADDRINUSE: address already in use")),
            "a Ray worker failed (ActorDiedError): OSError: EADDRINUSE: address already in use",
        ),
    ],
    ids=["package error", "package error in a Ray worker", "multi-line", "bug", "bug in a Ray worker", "died"],
)
def test_an_error_during_the_run_is_one_line_and_a_log_with_the_traceback(
    make_error, line, paths, tmp_path, monkeypatch, capsys
):
    _fail_in_run(monkeypatch, make_error())
    out = tmp_path / "run"
    assert main([*_fill(USER, paths), "--output-dir", str(out)]) == 1
    err = [e for e in capsys.readouterr().err.splitlines() if not e.startswith("[tidal ")]  # log lines aside
    assert len(err) == 1 and err[0].startswith("train: error: ") and line in err[0], err
    log = out / "error.log"
    assert err[0].endswith(f"(traceback in {log.resolve()})")
    assert "Traceback (most recent call last)" in log.read_text()


def _actor_died_in_init(cause: BaseException) -> BaseException:
    """What ``ray.get`` raises when a worker raised ``cause`` in ``__init__`` (its text only, colored by Ray)."""
    from ray.exceptions import ActorDiedError

    return ActorDiedError(_ray_task_error(cause, prefix="\x1b[36mray::ActorWorker.__init__()\x1b[39m\n"))


def _rollout_error(message: str) -> BaseException:
    from tidal.rollout import RolloutError

    return RolloutError(message)


def test_ctrl_c_during_the_run_exits_130(paths, tmp_path, monkeypatch):
    _fail_in_run(monkeypatch, KeyboardInterrupt())
    assert main([*_fill(USER, paths), "--output-dir", str(tmp_path / "run")]) == 130


def test_pipeline_stages_must_divide_the_layers(tmp_path, paths):
    model = _write_model(tmp_path / "model", layers=3)
    argv = [
        "--recipe",
        "base",
        "--hf-checkpoint",
        str(model),
        "--prompt-data",
        paths["data"],
        "--rollout-batch-size",
        "4",
    ]
    argv += ["--actor-num-gpus-per-node", "4"]
    with pytest.raises(ValueError, match="--pipeline-model-parallel-size 2 does not divide the model's 3 layers"):
        parse_job([*argv, "--pipeline-model-parallel-size", "2"])
    job = parse_job([*argv, "--pipeline-model-parallel-size", "3", "--actor-num-gpus-per-node", "3"])
    assert job.parallel.pipeline_model_parallel_size == 3


def test_ray_address_from_the_environment_connects_like_the_flag(monkeypatch, tmp_path):
    from tidal.train.cli import check_local_gpus

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    local = parse_job(["--output-dir", str(tmp_path / "a")])
    assert local.placement.cluster_address is None and check_local_gpus(local, detected_gpus=0) is not None
    monkeypatch.setenv("RAY_ADDRESS", "auto")  # what `ray job submit` gives the entrypoint
    job = parse_job(["--output-dir", str(tmp_path / "b")])
    assert job.placement.cluster_address == "auto" and check_local_gpus(job, detected_gpus=0) is None
    flag = parse_job(["--output-dir", str(tmp_path / "c"), "--ray-address", "10.0.0.1:6379"])
    assert flag.placement.cluster_address == "10.0.0.1:6379"  # the flag wins


def test_paths_sent_to_workers_are_absolute(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    job = parse_job(["--output-dir", "out"])
    assert job.train.output_dir == str(tmp_path / "out") and job.ckpt.save == str(tmp_path / "out" / "ckpt")


def test_algorithm_flags_without_effect_warn_once(tmp_path, caplog):
    job = parse_job(["--output-dir", str(tmp_path / "a"), "--gamma", "0.9", "--overlong-penalty-factor", "0.5"])
    assert job.actor.gamma == 0.9
    text = caplog.text
    assert text.count("--gamma has no effect") == 1 and text.count("--overlong-penalty-factor has no effect") == 1
    caplog.clear()
    parse_job(["--output-dir", str(tmp_path / "b"), "--advantage-estimator", "reinforce_plus_plus", "--gamma", "0.9"])
    assert "no effect" not in caplog.text


def test_named_eval_sets_parse_and_name_their_keys(tmp_path):
    from tidal.train.config import eval_metric_keys
    from tidal.train.task_data import EVAL_FILE, TRAIN_FILE, shipped_path

    held_out, train = str(shipped_path(EVAL_FILE)), str(shipped_path(TRAIN_FILE))
    argv = ["--eval-prompt-data", "add", held_out, "seen", train, "--n-samples-per-eval-prompt", "4"]
    job = parse_job([*argv, "--output-dir", str(tmp_path / "a"), "--keep-best-by", "eval/seen/pass@4"])
    assert job.eval.eval_prompt_data == ("add", held_out, "seen", train)
    assert eval_metric_keys(job.train, job.eval) == [
        "eval/accuracy",
        *(f"eval/add/{m}" for m in ("mean@4", "pass@1", "pass@2", "pass@4")),
        *(f"eval/seen/{m}" for m in ("mean@4", "pass@1", "pass@2", "pass@4")),
    ]
    one = parse_job(["--output-dir", str(tmp_path / "b")])  # the embedded recipe's one PATH, named by its stem
    assert eval_metric_keys(one.train, one.eval)[1] == "eval/addition_eval/mean@1"


def test_help_lists_the_lora_options():
    from tidal.train.flags import build_parser

    text = build_parser().format_help()
    for flag in ("--lora-rank", "--lora-alpha", "--lora-dropout", "--lora-target-modules"):
        assert flag in text, flag
    args = build_parser().parse_args(["--lora-rank", "8", "--lora-target-modules", "q_proj", "v_proj"])
    assert args.lora_rank == 8 and args.lora_target_modules == ["q_proj", "v_proj"]


def test_an_unknown_architecture_is_one_line_listing_the_known_families_before_anything_starts(tmp_path, paths):
    # A DeepSeek-V3 checkpoint used to start Ray and the engines, then a Ray worker died naming its model_type.
    model = _write_model(tmp_path / "dsv3")
    config = {"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], "num_hidden_layers": 4}
    (model / "config.json").write_text(json.dumps(config))
    argv = ["--recipe", "base", "--prompt-data", paths["data"], "--rollout-batch-size", "4"]
    message = _error([*argv, "--hf-checkpoint", str(model)])
    assert re.fullmatch(
        rf"--hf-checkpoint {re.escape(str(model / 'config.json'))}: model_type 'deepseek_v3' "
        r"\(DeepseekV3ForCausalLM\) is not a model family tidal trains; known: qwen2 \(Qwen2ForCausalLM\), .*"
        r"qwen3_moe \(Qwen3MoeForCausalLM\).*",
        message,
    ), message
    (model / "config.json").write_text(json.dumps(config | {"model_type": "qwen2"}))  # a known type, other class
    assert "tidal trains qwen2 as Qwen2ForCausalLM only" in _error([*argv, "--hf-checkpoint", str(model)])


def test_a_glm_checkpoint_is_known_and_checked_as_a_mixture_of_experts(tmp_path, paths):
    model = _write_model(tmp_path / "glm")
    config = {"model_type": "glm4_moe", "architectures": ["Glm4MoeForCausalLM"], "num_hidden_layers": 4,
              "n_routed_experts": 4, "first_k_dense_replace": 1}  # fmt: skip
    (model / "config.json").write_text(json.dumps(config))
    argv = ["--recipe", "base", "--prompt-data", paths["data"], "--rollout-batch-size", "4", "--hf-checkpoint"]
    argv += [str(model), "--actor-num-gpus-per-node", "2"]
    job = parse_job([*argv, "--expert-model-parallel-size", "2", "--use-rollout-routing-replay"])
    assert job.parallel.expert_model_parallel_size == 2 and job.actor.use_rollout_routing_replay
    with pytest.raises(ValueError, match="--lora-rank 8 with a mixture-of-experts model"):
        parse_job([*argv, "--lora-rank", "8"])
    message = _error([*argv, "--update-weight-delta"])
    assert message.startswith(f"--update-weight-delta with --hf-checkpoint {model} (glm4_moe) is not supported: ")
    assert "\n" not in message


def test_expert_parallel_size_is_checked_against_the_model_before_start(tmp_path, paths):
    dense = _write_model(tmp_path / "dense")
    moe = _write_model(tmp_path / "moe")
    (moe / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "num_hidden_layers": 4, "num_experts": 6}))
    argv = ["--recipe", "base", "--prompt-data", paths["data"], "--rollout-batch-size", "4"]
    argv += ["--actor-num-gpus-per-node", "4", "--expert-model-parallel-size", "4"]
    with pytest.raises(ValueError, match="--expert-model-parallel-size 4 does not divide the model's 6 experts"):
        parse_job([*argv, "--hf-checkpoint", str(moe)])
    with pytest.raises(ValueError, match="--expert-model-parallel-size 4 needs a mixture-of-experts model"):
        parse_job([*argv, "--hf-checkpoint", str(dense)])
    ep2 = parse_job([*argv[:-1], "2", "--hf-checkpoint", str(moe)])
    assert ep2.parallel.expert_model_parallel_size == 2
    with pytest.raises(ValueError, match="--context-parallel-size 2 with a mixture-of-experts model"):
        parse_job([*argv[:-1], "1", "--context-parallel-size", "2", "--hf-checkpoint", str(moe)])


def test_moe_with_dense_layers_is_refused_when_sglang_serves_it(tmp_path, paths):
    moe = _write_model(tmp_path / "moe")
    config = {"model_type": "qwen3_moe", "num_hidden_layers": 4, "num_experts": 4, "mlp_only_layers": [0]}
    (moe / "config.json").write_text(json.dumps(config))
    argv = ["--recipe", "base", "--prompt-data", paths["data"], "--rollout-batch-size", "4"]
    argv += ["--hf-checkpoint", str(moe)]
    with pytest.raises(ValueError, match=r"dense layers \(mlp_only_layers \[0\], decoder_sparse_step 1\)"):
        parse_job(argv)
    (moe / "config.json").write_text(json.dumps(config | {"mlp_only_layers": []}))  # every layer MoE: served right
    assert parse_job(argv).actor.hf_checkpoint == str(moe)
    (moe / "config.json").write_text(json.dumps(config | {"mlp_only_layers": [], "tie_word_embeddings": True}))
    with pytest.raises(
        ValueError, match=r"ties the LM head to the embedding .* which SGLang 0.5.23's qwen3_moe ignores"
    ):
        parse_job(argv)
    saved = tmp_path / "saved"
    saved.mkdir()
    assert parse_job([*argv, "--debug-train-only", "--load-debug-rollout-data", str(saved)]).actor


def test_lora_on_a_moe_model_is_refused_before_start(tmp_path, paths):
    moe = _write_model(tmp_path / "moe")
    (moe / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "num_hidden_layers": 4, "num_experts": 4}))
    argv = ["--recipe", "base", "--prompt-data", paths["data"], "--rollout-batch-size", "4", "--lora-rank", "8"]
    with pytest.raises(ValueError, match="--lora-rank 8 with a mixture-of-experts model"):
        parse_job([*argv, "--hf-checkpoint", str(moe)])


def test_the_weight_check_with_routing_replay_is_refused_before_start(tmp_path, paths):
    # The probe of --check-weight-update-equal is scored by the actor without an engine's routing to replay: accepted,
    # the run failed after its first rollout, in the actor.
    moe = _write_model(tmp_path / "moe")
    config = {"model_type": "qwen3_moe", "num_hidden_layers": 4, "num_experts": 4, "mlp_only_layers": []}
    (moe / "config.json").write_text(json.dumps(config))
    argv = ["--recipe", "base", "--prompt-data", paths["data"], "--rollout-batch-size", "4"]
    argv += ["--hf-checkpoint", str(moe), "--use-rollout-routing-replay"]
    assert parse_job(argv).actor.use_rollout_routing_replay
    with pytest.raises(ValueError, match=r"^--check-weight-update-equal with --use-rollout-routing-replay is not") as e:
        parse_job([*argv, "--check-weight-update-equal"])
    assert len(str(e.value).splitlines()) == 1


def test_routing_replay_is_refused_where_no_sample_would_carry_routed_experts():
    # sglang-router 0.3.2 forwards /generate without return_routed_experts, and a custom sample is built from several
    # calls: accepted, either run failed after its first rollout, when the actor found no experts to replay.
    argv = ["--recipe", "embedded-moe", "--use-rollout-routing-replay", "--no-colocate", "--rollout-num-gpus", "2"]
    with pytest.raises(ValueError, match=r"^--use-rollout-routing-replay with 2 engine\(s\) behind sglang-router is "
                       r"not supported: sglang-router 0.3.2 drops return_routed_experts") as e:  # fmt: skip
        parse_job(argv)
    assert len(str(e.value).splitlines()) == 1
    assert parse_job([*argv, "--no-use-router"]).rollout.return_routed_experts  # each engine's worker generates
    custom = ["--custom-generate-function-path", "json:loads"]
    with pytest.raises(ValueError, match=r"^--use-rollout-routing-replay with --custom-generate-function-path is not"):
        parse_job([*argv[:3], *custom])
    assert not parse_job(custom).rollout.return_routed_experts  # a custom function alone, or replay alone: accepted
    assert parse_job(argv[:3]).rollout.return_routed_experts


def test_rounds_that_can_never_fill_the_batch_are_refused(paths):
    argv = ["--recipe", "base", "--prompt-data", paths["data"], "--rollout-batch-size", "8"]
    argv += ["--dynamic-sampling-filter-path", "reward_variance", "--over-sampling-batch-size", "2"]
    with pytest.raises(ValueError, match=r"--dynamic-sampling-max-rounds 3 rounds of --over-sampling-batch-size 2 .* "
                       r"never fill --rollout-batch-size 8: raise either"):  # fmt: skip
        parse_job([*argv, "--dynamic-sampling-max-rounds", "3"])
    assert parse_job([*argv, "--dynamic-sampling-max-rounds", "4"]).rollout.dynamic_sampling_max_rounds == 4  # 4 x 2


def test_partial_rollout_over_sampling_below_the_batch_without_a_filter_is_refused(paths):
    # No filter: one round of --over-sampling-batch-size prompts (plus the carried groups) must fill the batch.
    argv = ["--recipe", "base", "--prompt-data", paths["data"], "--rollout-batch-size", "4", "--partial-rollout"]
    with pytest.raises(ValueError, match=r"--partial-rollout with --over-sampling-batch-size 2 below "
                       r"--rollout-batch-size 4"):  # fmt: skip
        parse_job([*argv, "--over-sampling-batch-size", "2"])
    assert parse_job([*argv, "--over-sampling-batch-size", "6"]).rollout.over_sampling_batch_size == 6


def test_placement_flags_shape_the_bundles_and_the_local_ray(paths):
    """--actor-num-nodes x --actor-num-gpus-per-node actor ranks and engines of --rollout-num-gpus-per-engine GPUs
    are the bundles the placement group reserves (each engine's GPUs side by side); on a CPU box --num-cpus-local
    bounds the logical GPUs a local Ray can hold."""
    from tidal.placement import ResourcePlan
    from tidal.train.cli import check_local_gpus

    argv = [*_fill(USER, paths), "--no-colocate", "--actor-num-nodes", "2", "--actor-num-gpus-per-node", "2",
            "--rollout-num-gpus", "4", "--rollout-num-gpus-per-engine", "2"]  # fmt: skip
    argv += ["--num-cpus-per-bundle", "0.5"]
    job = parse_job([*argv, "--num-cpus-local", "4"])
    assert (job.placement.num_actor_gpus, job.placement.num_engines, job.placement.num_gpus) == (4, 2, 8)
    plan = ResourcePlan.from_config(job.placement)
    assert plan.actor_positions == [0, 1, 2, 3] and plan.engine_positions == [[4, 5], [6, 7]]
    assert check_local_gpus(job, detected_gpus=0).num_gpus == 8  # 4 CPUs hold 8 bundles of 0.5
    with pytest.raises(ResourceShortageError, match=r"--num-cpus-local 3 CPUs holds at most 6 GPU bundles"):
        check_local_gpus(parse_job([*argv, "--num-cpus-local", "3"]), detected_gpus=0)


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs util-linux's unshare")
def test_rm_type_code_is_refused_in_one_line_where_no_sandbox_can_be_built():
    # Inside a user namespace that allows no nested one (what a seccomp profile forbidding unshare, or
    # user.max_user_namespaces=0, looks like), `train --rm-type code` stops before anything starts.
    script = "import sys; from tidal.train.cli import main; sys.exit(main(['--rm-type', 'code', '--num-rollout', '0']))"
    no_namespaces = 'echo 0 > /proc/sys/user/max_user_namespaces && exec "$0" -c "$1"'
    proc = subprocess.run(
        ["unshare", "--user", "--map-root-user", "sh", "-c", no_namespaces, sys.executable, script],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    if "unshare failed" in proc.stderr:
        pytest.skip(f"this machine allows no user namespace at all: {proc.stderr.strip()}")
    lines = [line for line in proc.stderr.splitlines() if "--rm-type code" in line]
    assert proc.returncode != 0 and len(lines) == 1, proc.stderr
    assert "refused it" in lines[0] and "cannot create a user namespace" in lines[0], lines[0]
    assert "Traceback" not in proc.stderr


def test_rm_type_code_with_its_sandbox_options_reaches_the_rollout_config():
    from tidal.rollout import check_sandbox

    try:
        check_sandbox()
    except ValueError as e:
        if "cannot create a user namespace" not in str(e):
            raise  # the machine allows namespaces: the sandbox itself is broken
        pytest.skip(f"no sandbox here: {e}")
    job = validate(["--rm-type", "code", "--code-sandbox-max-concurrency", "2", "--code-sandbox-timeout-s", "3"])
    assert (job.rollout.rm_type, job.rollout.code_sandbox_max_concurrency, job.rollout.code_sandbox_timeout_s) == (
        "code",
        2,
        3.0,
    )
