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


def test_auto_picks_a_budget_and_recompute_that_fit_and_records_them(user, tmp_path):
    from tidal.train.memory import write_memory_plan

    argv = [*user, "--use-dynamic-batch-size", "--rollout-max-response-len", "16384", "--output-dir", str(tmp_path)]
    job = parse_job(
        [*argv, "--gpu-memory-gib", "64", "--max-tokens-per-gpu", "auto", "--recompute-activations", "auto"]
    )
    choice = job.memory_choice
    assert choice is not None and job.batching.max_tokens_per_gpu == choice.max_tokens_per_gpu
    assert job.batching.max_tokens_per_gpu >= 16384 + 1024  # holds the longest sample
    assert (job.actor.recompute_activations, job.actor.recompute_num_layers) == (
        choice.recompute_activations,
        choice.recompute_num_layers,
    )
    # on 64 GiB the longest sample needs some layers recomputed, not all: the plan's own check passes them, and the
    # same budget without recompute does not fit
    assert job.actor.recompute_activations and 0 < job.actor.recompute_num_layers < 28
    fixed = ["--max-tokens-per-gpu", str(job.batching.max_tokens_per_gpu), "--gpu-memory-gib", "64"]
    layers = ["--recompute-activations", "--recompute-num-layers", str(job.actor.recompute_num_layers)]
    parse_job([*argv, *fixed, *layers])
    assert any("memory plan" in p for p in _problems([*argv, *fixed]))
    # a larger card needs no recompute
    roomy = parse_job(
        [*argv, "--gpu-memory-gib", "141", "--max-tokens-per-gpu", "auto", "--recompute-activations", "auto"]
    )
    assert not roomy.actor.recompute_activations
    plan = write_memory_plan(job, QWEN3_1_7B, tmp_path)
    record = json.loads((tmp_path / "memory_plan.json").read_text())
    assert plan is not None and record["auto"]["max_tokens_per_gpu"] == job.batching.max_tokens_per_gpu
    assert record["auto"]["alternatives"] and record["auto"]["reason"]


def test_auto_keeps_what_the_user_sets_and_refuses_a_recompute_count_with_auto(user):
    argv = [*user, "--use-dynamic-batch-size", "--gpu-memory-gib", "80"]
    job = parse_job([*argv, "--max-tokens-per-gpu", "4096", "--recompute-activations", "auto"])
    assert job.batching.max_tokens_per_gpu == 4096 and not job.actor.recompute_activations
    job = parse_job([*argv, "--max-tokens-per-gpu", "auto", "--recompute-activations"])
    assert job.actor.recompute_activations and job.actor.recompute_num_layers == 0
    problems = _problems([*argv, "--max-tokens-per-gpu", "auto", "--recompute-activations", "auto",
                          "--recompute-num-layers", "3"])  # fmt: skip
    assert any("--recompute-num-layers 3 is chosen by --recompute-activations auto" in p for p in problems)
    with pytest.raises(ValueError, match="--max-tokens-per-gpu: invalid integer or auto value: 'lots'"):
        parse_job([*argv, "--max-tokens-per-gpu", "lots"])


def test_auto_without_a_gpu_holds_the_longest_sample(user, monkeypatch):
    monkeypatch.setattr("tidal.train.memory.gpu_memory_bytes", lambda: None)
    job = parse_job([*user, "--use-dynamic-batch-size", "--rollout-max-response-len", "20000",
                     "--max-tokens-per-gpu", "auto", "--recompute-activations", "auto"])  # fmt: skip
    assert job.batching.max_tokens_per_gpu == 21120 and not job.actor.recompute_activations  # 20000 + 1024, aligned


def test_auto_refuses_a_sample_nothing_holds_naming_what_would(user):
    argv = [*user, "--use-dynamic-batch-size", "--gpu-memory-gib", "80", "--rollout-max-response-len", "500000"]
    problems = _problems([*argv, "--max-tokens-per-gpu", "auto", "--recompute-activations", "auto"])
    (line,) = [p for p in problems if "longest sample" in p]
    assert "501024 tokens" in line and re.search(r"--context-parallel-size \d|--tensor-model-parallel-size \d", line)
    assert not [p for p in problems if "memory plan needs" in p]  # no second line about the unresolved budget


def test_a_budget_the_plan_names_always_holds_the_longest_sample(user):
    # 48 GiB leaves room for fewer tokens than one 17408-token sample without recompute: the line names what holds it
    argv = [*user, "--gpu-memory-gib", "48", "--use-dynamic-batch-size", "--rollout-max-response-len", "16384"]
    (line,) = [p for p in _problems([*argv, "--max-tokens-per-gpu", "17408"]) if "memory plan" in p]
    assert "cannot hold the longest sample (17408 tokens" in line
    fits = int(re.search(r"the budget that fits \((\d+) tokens\)", line).group(1))
    assert 0 < fits < 17408 and "--max-tokens-per-gpu" not in line.split("longest sample")[1]
    fix = re.search(r"--context-parallel-size (\d+)", line)
    assert fix, line
    # the advice works: that CP holds the sample within the plan
    parse_job([*argv, "--max-tokens-per-gpu", str(17408 // int(fix.group(1))), "--context-parallel-size", fix.group(1),
               "--recompute-activations", "--actor-num-gpus-per-node", fix.group(1)])  # fmt: skip
