from dataclasses import replace

import pytest
import torch
from tidal.actor import Actor, ActorConfig
from tidal.actor.memory_plan import ALIGN, GIB, MemoryInputs, ModelShape, largest_fitting_tokens, plan_memory
from tidal.ckpt import read_hf_config_json
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

SMALL = dict(
    vocab_size=1000,
    hidden_size=96,
    intermediate_size=160,
    num_hidden_layers=3,
    num_attention_heads=6,
    num_key_value_heads=2,
)
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
BUDGETS = dict(train_tokens=32768, logprob_tokens=65536, longest_sequence=16384)


@pytest.mark.parametrize(
    ("config_cls", "model_cls", "extra"),
    [
        (Qwen2Config, Qwen2ForCausalLM, {"tie_word_embeddings": True}),
        (Qwen3Config, Qwen3ForCausalLM, {"head_dim": 32, "tie_word_embeddings": False}),
        (LlamaConfig, LlamaForCausalLM, {"tie_word_embeddings": False}),
    ],
    ids=["qwen2", "qwen3", "llama"],
)
def test_parameter_count_matches_the_hf_model(config_cls, model_cls, extra):
    config = config_cls(**SMALL, **extra)
    model = model_cls(config)
    expected = sum(p.numel() for p in model.parameters())
    assert ModelShape.from_hf_config(config.to_dict()).num_params() == expected


def test_resident_rows_match_the_actor_built_from_the_same_folder(dist_env, qwen3_dir):
    actor = Actor(ActorConfig(hf_checkpoint=str(qwen3_dir), lr=1e-3))
    shape = ModelShape.from_hf_config(read_hf_config_json(qwen3_dir))
    inputs = MemoryInputs.from_actor_config(actor.cfg, train_tokens=256, logprob_tokens=256, longest_sequence=64)
    rows = dict(plan_memory(shape, inputs).rows)
    params = sum(p.numel() * p.element_size() for p in actor.params)
    assert rows["parameters (float32)"] == params
    assert rows["gradients"] == params
    assert rows["AdamW moments"] == 2 * params


def test_options_move_the_peak_the_right_way():
    shape = ModelShape.from_hf_config(QWEN3_1_7B)
    base = MemoryInputs(**BUDGETS)
    peak = plan_memory(shape, base).train_peak
    assert plan_memory(shape, replace(base, train_tokens=16384)).train_peak < peak
    assert plan_memory(shape, replace(base, recompute_activations=True)).train_peak < peak
    partial = replace(base, recompute_activations=True, recompute_num_layers=4)
    assert (
        plan_memory(shape, replace(base, recompute_activations=True)).train_peak
        < plan_memory(shape, partial).train_peak
    )
    assert plan_memory(shape, partial).train_peak < peak
    assert plan_memory(shape, replace(base, recompute_lm_head=False)).train_peak > peak
    assert plan_memory(shape, replace(base, cudnn_attention_min_tokens=0)).train_peak < peak
    assert plan_memory(shape, replace(base, tensor_parallel=2)).train_peak < peak
    assert plan_memory(shape, replace(base, context_parallel=2)).train_peak < peak
    offload = plan_memory(shape, replace(base, optimizer_cpu_offload=True))
    assert dict(offload.rows)["AdamW moments (host)"] == 0 and offload.train_peak < peak
    assert plan_memory(shape, replace(base, reference_model=True)).train_peak > peak
    assert plan_memory(shape, replace(base, critic=True)).train_peak > peak
    # the critic holds what the policy trains with, whatever else is resident (fp32 parameters: no main copies)
    fp32 = replace(base, params_dtype="float32", fp32_main_params=False, critic=True)
    critic = dict(plan_memory(shape, fp32).rows)["critic (weights, gradients, AdamW)"]
    assert (
        dict(plan_memory(shape, replace(fp32, reference_model=True)).rows)["critic (weights, gradients, AdamW)"]
        == critic
    )
    # the forward-only pass keeps no activations: far below training at the same tokens
    assert plan_memory(shape, base).logprob_peak < peak / 2


def test_rows_add_up_and_the_table_names_the_verdict():
    shape = ModelShape.from_hf_config(QWEN3_1_7B)
    plan = plan_memory(shape, MemoryInputs(**BUDGETS), gpu_bytes=80 * GIB)
    assert sum(size for _, size in plan.rows) == plan.train_peak
    assert plan.fits() is False and "DOES NOT FIT" in plan.table()
    assert plan_memory(shape, MemoryInputs(**BUDGETS)).fits() is None
    assert plan_memory(shape, MemoryInputs(**BUDGETS), gpu_bytes=141 * GIB).fits() is True


@pytest.mark.parametrize("logprob", [False, True])
def test_largest_fitting_budget_is_the_bound(logprob):
    shape = ModelShape.from_hf_config(QWEN3_1_7B)
    inputs = MemoryInputs(**BUDGETS)
    gpu = 80 * GIB
    fits = largest_fitting_tokens(shape, inputs, gpu_bytes=gpu, logprob=logprob)
    assert fits > 0 and fits % ALIGN == 0
    key = "logprob_tokens" if logprob else "train_tokens"

    def peak(tokens):
        plan = plan_memory(shape, replace(inputs, **{key: tokens}), gpu_bytes=gpu)
        return plan.logprob_peak if logprob else plan.train_peak

    limit = plan_memory(shape, inputs, gpu_bytes=gpu).limit
    assert peak(fits) <= limit < peak(fits + ALIGN)
    # co-located engines taking half the card leave less
    assert largest_fitting_tokens(shape, inputs, gpu_bytes=gpu, engine_fraction=0.5, logprob=logprob) < fits
    # nothing fits when the weights alone exceed the card
    assert largest_fitting_tokens(shape, inputs, gpu_bytes=8 * GIB, logprob=logprob) == 0


def test_shape_from_config_reads_head_dim_and_groups():
    shape = ModelShape.from_hf_config(QWEN3_1_7B)
    assert shape.head_dim == 128 and shape.qk_norm and shape.qkv_width == (16 + 16) * 128
    no_kv = ModelShape.from_hf_config({**QWEN3_1_7B, "model_type": "llama", "num_key_value_heads": None})
    assert no_kv.num_key_value_heads == 16 and not no_kv.qk_norm
    assert torch.tensor(0).numel() == 1  # torch import is the test's own, the plan needs none


def test_moe_shape_counts_experts_router_and_dense_layers(tmp_path):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    try:
        from moe_models import save_tiny_moe
    finally:
        sys.path.pop(0)
    from transformers import AutoModelForCausalLM

    path = save_tiny_moe(tmp_path / "moe", num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=[3])
    shape = ModelShape.from_hf_config(read_hf_config_json(path))
    assert shape.num_moe_layers == 1 and shape.num_experts == 8 and shape.qk_norm  # layer 1 only (3 is dense)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert shape.num_params() == sum(p.numel() for p in model.parameters())
    # each expert-parallel rank holds 1/EP of the experts, the rest whole
    experts = 8 * 3 * shape.hidden_size * shape.moe_ffn_hidden_size
    assert shape.moe_layer_params(1) - shape.moe_layer_params(2) == experts // 2


def test_moe_plan_matches_the_actor_and_counts_routed_activations(dist_env, tmp_path):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    try:
        from moe_models import save_tiny_moe
    finally:
        sys.path.pop(0)
    path = save_tiny_moe(tmp_path / "moe", mlp_only_layers=[1])
    actor = Actor(ActorConfig(hf_checkpoint=str(path), lr=1e-3))
    shape = ModelShape.from_hf_config(read_hf_config_json(path))
    inputs = MemoryInputs.from_actor_config(actor.cfg, train_tokens=256, logprob_tokens=256, longest_sequence=64)
    rows = dict(plan_memory(shape, inputs).rows)
    assert rows["parameters (float32)"] == sum(p.numel() * p.element_size() for p in actor.params)
    # routing each token to more experts keeps more activations; a dense model of the same attention keeps fewer
    more = plan_memory(replace(shape, experts_per_token=4), inputs).train_peak
    assert more > plan_memory(shape, inputs).train_peak
    kept = next(k for k in rows if k.startswith("activations"))
    dense = dict(plan_memory(replace(shape, num_moe_layers=0, num_experts=0), inputs).rows)[kept]
    assert rows[kept] > dense  # top-2 copies of (h + 4F) per token against the dense MLP's 3 x intermediate


def test_moe_log_prob_pass_grows_per_token_as_measured_on_an_h100():
    # Qwen3-30B-A3B's width, 4 layers, bf16 with --log-probs-chunk-size 4096 (bench/auto_plan_gpu.py, the MoE rows
    # of bench/RESULTS.md): the measured peak rose 10.92 GiB from 32,768 to 131,072 tokens in one micro-batch.
    config = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                  num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                  num_hidden_layers=4, model_type="qwen3_moe", tie_word_embeddings=False)  # fmt: skip
    shape = ModelShape.from_hf_config(config)

    def peak(tokens: int) -> int:
        inputs = MemoryInputs(train_tokens=tokens, logprob_tokens=tokens, longest_sequence=12672,
                              log_probs_chunk_size=4096)  # fmt: skip
        return plan_memory(shape, inputs).logprob_peak

    measured = 66.909 - 55.991  # GiB, H100 80GB, 2026-12-07
    assert (peak(131072) - peak(32768)) / GIB == pytest.approx(measured, rel=0.05)


LLAMA_8B_WIDTH = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                      num_key_value_heads=8, head_dim=128, model_type="llama", tie_word_embeddings=False)  # fmt: skip
QWEN3_30B_A3B_WIDTH = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                           num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                           num_experts_per_tok=8, model_type="qwen3_moe", tie_word_embeddings=False)  # fmt: skip
RECOMPUTE_ALL_ON_AN_H100 = {  # (config, layers, LoRA rank): [(largest micro-batch's tokens, measured peak GiB)]
    "dense": (LLAMA_8B_WIDTH, 4, 0, [(14592, 35.683), (25472, 38.163), (33792, 40.087), (50432, 43.898)]),
    "lora": (LLAMA_8B_WIDTH, 8, 16, [(14592, 9.676), (25472, 12.787), (33792, 15.189), (100736, 34.374)]),
    "moe": (QWEN3_30B_A3B_WIDTH, 4, 0, [(14592, 56.059), (25472, 58.854), (33792, 61.010), (50432, 65.289)]),
}


@pytest.mark.parametrize("family", RECOMPUTE_ALL_ON_AN_H100)
def test_every_layer_recomputed_holds_only_each_layers_input_as_measured_on_an_h100(family):
    # bench/auto_plan_gpu.py's sweep with --recompute all, H100 80GB, 2026-12-08 (bench/RESULTS.md): bf16 parameters
    # with fp32 main copies, --log-probs-chunk-size 4096, 48 samples of 100,652 tokens, the longest 12,614. With
    # torch's checkpoint early stop (or an MoE dispatcher's kept routing graph) far more than the input stayed held.
    config, layers, rank, rows = RECOMPUTE_ALL_ON_AN_H100[family]
    shape = ModelShape.from_hf_config(config | dict(num_hidden_layers=layers))
    lora = dict(lora_rank=rank, lora_target_modules=("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"))
    for tokens, measured in rows:
        inputs = MemoryInputs(params_dtype="bfloat16", fp32_main_params=True, recompute_activations=True,
                              train_tokens=tokens, logprob_tokens=tokens, longest_sequence=12614,
                              log_probs_chunk_size=4096, **(lora if rank else {}))  # fmt: skip
        ratio = plan_memory(shape, inputs).train_peak / GIB / measured
        assert 0.98 <= ratio <= 1.105, (tokens, ratio)
