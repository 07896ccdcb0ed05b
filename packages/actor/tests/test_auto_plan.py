from dataclasses import replace

import pytest
from tidal.actor.auto_plan import (
    AUTO_MARGIN,
    CPU_BUDGET,
    FULL_FT,
    LORA,
    StepTimeModel,
    choose_memory_config,
    layer_share,
    step_time_model,
)
from tidal.actor.memory_plan import MemoryInputs, ModelShape, largest_fitting_tokens, plan_memory

GIB = 2**30
LLAMA_8B_8L = ModelShape(
    vocab_size=128256,
    hidden_size=4096,
    ffn_hidden_size=14336,
    num_layers=8,  # 2.8B parameters: 50 GiB of weights, gradients and AdamW state in full fine-tuning
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    tie_word_embeddings=False,
)
QWEN3_1_7B = ModelShape(
    vocab_size=151936,
    hidden_size=2048,
    ffn_hidden_size=6144,
    num_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    tie_word_embeddings=True,
    qk_norm=True,
)
BF16 = dict(params_dtype="bfloat16", fp32_main_params=True, log_probs_chunk_size=4096)


def inputs(**kw) -> MemoryInputs:
    return MemoryInputs(**dict(train_tokens=8192, logprob_tokens=8192, longest_sequence=9216) | BF16 | kw)


def peak_of(shape, base: MemoryInputs, choice) -> int:
    chosen = replace(
        base,
        train_tokens=choice.max_tokens_per_gpu,
        logprob_tokens=choice.log_probs_max_tokens_per_gpu or choice.max_tokens_per_gpu,
        recompute_activations=choice.recompute_activations,
        recompute_num_layers=choice.recompute_num_layers,
    )
    return plan_memory(shape, chosen).train_peak, plan_memory(shape, chosen).logprob_peak


def test_the_model_prefers_larger_budgets_and_less_recompute():
    m, kw = FULL_FT, dict(step_tokens=65536, layers=8, layer_share=0.8)
    assert m.tokens_per_time(**kw, budget=32768, recomputed=0) > m.tokens_per_time(**kw, budget=8192, recomputed=0)
    assert m.tokens_per_time(**kw, budget=8192, recomputed=0) > m.tokens_per_time(**kw, budget=8192, recomputed=4)
    # the H100 sweep: every layer of the 4-layer 8B-width model recomputed took 1.196x as long, half of them 1.100x
    share = layer_share(replace(LLAMA_8B_8L, num_layers=4))
    all4 = m.step_time(step_tokens=82366, budget=27904, recomputed=4, layers=4, layer_share=share)
    off4 = m.step_time(step_tokens=82366, budget=27904, recomputed=0, layers=4, layer_share=share)
    assert all4 / off4 == pytest.approx(1.196, abs=0.02)
    assert step_time_model(inputs(lora_rank=16)) is LORA and step_time_model(inputs()) is FULL_FT


def test_no_gpu_known_means_no_recompute_and_at_least_the_longest_sample():
    got = choose_memory_config(QWEN3_1_7B, inputs(), gpu_bytes=None, longest_sample=500)
    assert (got.max_tokens_per_gpu, got.recompute_activations) == (CPU_BUDGET, False)
    got = choose_memory_config(QWEN3_1_7B, inputs(), gpu_bytes=None, longest_sample=20000)
    assert got.max_tokens_per_gpu == 20096  # 20000 aligned up to 128


def test_a_roomy_card_takes_no_recompute_and_the_steps_tokens():
    got = choose_memory_config(QWEN3_1_7B, inputs(), gpu_bytes=141 * GIB, longest_sample=4096, step_tokens=16384)
    assert not got.recompute_activations
    assert got.max_tokens_per_gpu == 16384  # capped at what one step holds: a larger budget buys nothing


def test_the_choice_fits_with_its_margin_and_is_the_fastest_candidate():
    base = inputs()
    got = choose_memory_config(LLAMA_8B_8L, base, gpu_bytes=80 * GIB, longest_sample=20000, step_tokens=1 << 20)
    train, logprob = peak_of(LLAMA_8B_8L, base, got)
    limit = 80 * GIB * (1 - AUTO_MARGIN) * 0.95
    assert train <= limit and logprob <= limit
    assert got.max_tokens_per_gpu >= 20000
    speeds = [c.relative_speed for c in got.candidates]
    assert speeds == sorted(speeds, reverse=True) and speeds[0] > 0
    # each candidate's budget is the largest that fits: 128 tokens more does not
    first = got.candidates[0]
    trial = replace(
        base,
        recompute_activations=first.recompute_num_layers is not None,
        recompute_num_layers=first.recompute_num_layers or 0,
    )
    assert largest_fitting_tokens(LLAMA_8B_8L, trial, gpu_bytes=int(80 * GIB * (1 - AUTO_MARGIN))) >= first.train_tokens


def test_recompute_is_chosen_when_the_longest_sample_needs_it():
    # an 8B model's full fine-tuning on an 80 GB card: the resident state leaves little room for activations
    base = inputs()
    without = largest_fitting_tokens(LLAMA_8B_8L, base, gpu_bytes=int(80 * GIB * (1 - AUTO_MARGIN)))
    longest = without + 4096
    got = choose_memory_config(LLAMA_8B_8L, base, gpu_bytes=80 * GIB, longest_sample=longest, step_tokens=1 << 20)
    assert got.recompute_activations and got.max_tokens_per_gpu >= longest
    no_recompute = next(c for c in got.candidates if c.recompute_num_layers is None)
    assert no_recompute.relative_speed == 0.0 and "longest sample needs" in no_recompute.note


def test_a_user_budget_is_kept_and_only_recompute_chosen():
    base = inputs(train_tokens=16384)
    got = choose_memory_config(
        QWEN3_1_7B, base, gpu_bytes=80 * GIB, longest_sample=4096, choose_budget=False, choose_logprob_budget=False
    )
    assert got.max_tokens_per_gpu == 16384 and not got.recompute_activations


def test_nothing_fits_names_what_would():
    with pytest.raises(ValueError, match=r"longest sample \(200000 tokens.*--context-parallel-size|recompute"):
        choose_memory_config(LLAMA_8B_8L, inputs(), gpu_bytes=80 * GIB, longest_sample=200000)


def test_a_fitted_model_ranks_by_predicted_time():
    slow_recompute = StepTimeModel(forward_share=2.0, overhead_tokens=0.0)
    assert slow_recompute.step_time(step_tokens=100, budget=100, recomputed=1, layers=1, layer_share=1.0) == 300.0
    overhead = StepTimeModel(forward_share=0.0, overhead_tokens=50.0)
    assert overhead.step_time(step_tokens=100, budget=30, recomputed=0, layers=1, layer_share=1.0) == 100 + 4 * 50
