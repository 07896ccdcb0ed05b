import numpy as np
import pytest
from tidal.batching import pack, plan_micro_batches, plan_stats
from tidal.batching.stats import token_stats


def test_token_stats_values():
    real = np.array([[6, 4], [5, 5]])
    computed = np.array([[8, 8], [8, 8]])
    s = token_stats(real, computed, token_budget=10)
    assert s["batching/efficiency"] == pytest.approx(20 / 32)
    assert s["batching/num_micro_batches"] == 2
    assert s["batching/padding_tokens"] == 12
    assert s["batching/rank_imbalance"] == 0
    assert s["batching/budget_fill"] == pytest.approx(0.8)
    assert all(k.startswith("batching/") and isinstance(v, float) for k, v in s.items())


def batch_stats(micro_batches, *, token_budget):
    """The statistics of packed micro-batches ``micro_batches[rank][k]``, counted from the batches themselves."""
    real = np.array([[b.num_real_tokens for b in rank] for rank in micro_batches], dtype=np.int64)
    computed = np.array([[b.num_tokens for b in rank] for rank in micro_batches], dtype=np.int64)
    return token_stats(real, computed, token_budget=token_budget)


def test_batch_stats_match_plan_stats(rl_lengths):
    lengths = rl_lengths[:64]
    plan = plan_micro_batches(lengths, dp_size=2, max_tokens_per_gpu=16384, pad_to_multiple_of=128)
    batches = [
        [pack([[1] * int(lengths[i]) for i in mb], pad_to_multiple_of=128) for mb in plan.micro_batches(r)]
        for r in range(2)
    ]
    from_plan = plan_stats(plan, pad_to_multiple_of=128)
    from_batches = batch_stats(batches, token_budget=plan.token_budget)
    assert from_plan == pytest.approx(from_batches)
    assert 0.95 < from_plan["batching/efficiency"] <= 1
    assert from_plan["batching/tokens_per_micro_batch/max"] <= 16384


def test_plan_stats_count_context_parallel_padding():
    plan = plan_micro_batches([3, 5], dp_size=1, max_tokens_per_gpu=8, context_parallel_size=2)
    s = plan_stats(plan, context_parallel_size=2)
    assert s["batching/real_tokens"] == 8
    assert s["batching/padding_tokens"] == 4  # 3 -> 4 and 5 -> 8
