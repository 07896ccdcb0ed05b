import json
import re
from pathlib import Path

import pytest
from tidal.actor import ModelShape, largest_fitting_tokens
from tidal.train.checks import ConfigErrors
from tidal.train.cli import parse_job
from tidal.train.memory import engine_fraction, job_memory_plan, memory_inputs

QWEN3_1_7B = dict(
    model_type="qwen3",
    vocab_size=151936,
    hidden_size=2048,
    intermediate_size=6144,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    tie_word_embeddings=True,
)
GIB = 2**30
BF16 = ["--params-dtype", "bfloat16", "--fp32-main-params"]


@pytest.fixture(scope="module")
def user(tmp_path_factory) -> list[str]:
    root = tmp_path_factory.mktemp("memory")
    model = root / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(QWEN3_1_7B))
    (model / "tokenizer.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"")
    (root / "data.jsonl").write_text('{"prompt": "1+1=", "label": "2"}\n')
    return ["--recipe", "base", "--hf-checkpoint", str(model), "--prompt-data", str(root / "data.jsonl"),
            "--rollout-batch-size", "4", *BF16]  # fmt: skip


def _problems(argv: list[str]) -> list[str]:
    with pytest.raises(ConfigErrors) as info:
        parse_job(argv)
    return info.value.problems


def test_a_budget_too_large_for_the_card_is_one_line_naming_the_budget_that_fits(user):
    argv = [*user, "--gpu-memory-gib", "80", "--use-dynamic-batch-size", "--max-tokens-per-gpu", "40960"]
    (line,) = [p for p in _problems(argv) if "memory plan" in p]
    assert "80.0 GiB GPU" in line and "--recompute-activations" in line and "--optimizer-cpu-offload" in line
    fits = int(re.search(r"--max-tokens-per-gpu (\d+) fits", line).group(1))
    assert 0 < fits < 40960
    # the named budget passes the same check, and one step of 128 tokens more does not
    parse_job([*user, "--gpu-memory-gib", "80", "--use-dynamic-batch-size", "--max-tokens-per-gpu", str(fits)])
    over = [*user, "--gpu-memory-gib", "80", "--use-dynamic-batch-size", "--max-tokens-per-gpu", str(fits + 128)]
    assert any("memory plan" in p for p in _problems(over))


def test_the_same_budget_fits_a_larger_card_or_with_recompute(user):
    big = [*user, "--use-dynamic-batch-size", "--max-tokens-per-gpu", "32768"]
    parse_job([*big, "--gpu-memory-gib", "141"])
    parse_job([*big, "--gpu-memory-gib", "80", "--recompute-activations"])


def test_log_prob_budget_is_planned_too(user):
    argv = [*user, "--gpu-memory-gib", "40", "--use-dynamic-batch-size", "--max-tokens-per-gpu", "2048"]
    problems = _problems([*argv, "--log-probs-max-tokens-per-gpu", "2000000"])
    (line,) = [p for p in problems if "memory plan" in p]
    assert "--log-probs-max-tokens-per-gpu" in line


def test_without_dynamic_batch_size_the_plan_names_the_micro_batch_size(user):
    argv = [*user, "--gpu-memory-gib", "80", "--micro-batch-size", "64", "--rollout-max-response-len", "4096"]
    (line,) = [p for p in _problems(argv) if "memory plan" in p]
    assert "lower --micro-batch-size" in line
    job = parse_job([*user, "--micro-batch-size", "2", "--rollout-max-response-len", "4096"])
    assert memory_inputs(job.parallel, job.actor, job.batching, job.rollout).train_tokens == 2 * (4096 + 1024)


def test_co_located_engines_take_their_share(user):
    argv = [*user, "--use-dynamic-batch-size", "--max-tokens-per-gpu", "8192", "--colocate"]
    job = parse_job(
        [*argv, "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1", "--sglang-mem-fraction-static", "0.5"]
    )
    plan = job_memory_plan(
        job.parallel, job.offload, job.actor, job.batching, job.rollout, job.placement, QWEN3_1_7B, 80 * GIB
    )
    assert plan.engine_bytes == 40 * GIB
    equals = parse_job([*argv, "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1",
                        "--sglang-mem-fraction-static=0.25"])  # fmt: skip
    assert engine_fraction(equals.offload, equals.rollout, equals.placement) == 0.25
    saver = parse_job(
        [*argv, "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1", "--sglang-enable-memory-saver"]
    )
    freed = job_memory_plan(
        saver.parallel, saver.offload, saver.actor, saver.batching, saver.rollout, saver.placement, QWEN3_1_7B, 80 * GIB
    )
    assert freed.engine_bytes == 0


def test_no_gpu_and_no_flag_means_no_verdict(user):
    job = parse_job([*user, "--use-dynamic-batch-size", "--max-tokens-per-gpu", "1000000"])  # nothing to check against
    plan = job_memory_plan(
        job.parallel, job.offload, job.actor, job.batching, job.rollout, job.placement, QWEN3_1_7B, None
    )
    assert plan.fits() is None
    shape = ModelShape.from_hf_config(QWEN3_1_7B)
    assert largest_fitting_tokens(shape, plan.inputs, gpu_bytes=80 * GIB) < 1000000
    assert not Path("memory_plan.json").exists()
