import logging
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tidal.batching import plan_micro_batches
from tidal.batching.partition import MicroBatchPlan, assign_ranks


@st.composite
def dynamic_cases(draw):
    dp = draw(st.integers(1, 6))
    per_rank = draw(st.integers(1, 20))
    budget = draw(st.integers(16, 400))
    lengths = draw(st.lists(st.integers(1, budget), min_size=dp * per_rank, max_size=dp * per_rank))
    return np.array(lengths), dp, budget


def _check_common(plan: MicroBatchPlan, n: int, dp: int) -> None:
    assert plan.dp_size == dp
    everything = np.concatenate([mb for r in range(dp) for mb in plan.micro_batches(r)])
    # every sample appears exactly once
    assert np.array_equal(np.sort(everything), np.arange(n))
    # equal micro-batch counts on every rank, none empty, equal sample counts
    assert all(len(plan.micro_batches(r)) == plan.num_micro_batches for r in range(dp))
    assert all(mb.size > 0 for r in range(dp) for mb in plan.micro_batches(r))
    assert {sum(mb.size for mb in plan.micro_batches(r)) for r in range(dp)} == {n // dp}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(dynamic_cases())
def test_dynamic_plan_invariants(case):
    lengths, dp, budget = case
    plan = plan_micro_batches(lengths, dp_size=dp, max_tokens_per_gpu=budget)
    _check_common(plan, lengths.size, dp)
    tokens = plan.tokens()
    assert tokens.shape == (dp, plan.num_micro_batches)
    assert tokens.max() <= budget  # no micro-batch exceeds the limit
    assert tokens.sum() == lengths.sum()
    # never more micro-batches than needed one sequence at a time, never fewer than the volume bound
    per_rank_tokens = tokens.sum(axis=1)
    assert plan.num_micro_batches >= math.ceil(per_rank_tokens.max() / budget)
    assert plan.num_micro_batches <= lengths.size // dp


def _first_fit_decreasing_count(sizes, budget):
    free = []
    for size in sorted(sizes, reverse=True):
        for i, room in enumerate(free):
            if size <= room:
                free[i] -= size
                break
        else:
            free.append(budget - size)
    return len(free)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(dynamic_cases())
def test_dynamic_plan_count_is_near_minimal(case):
    lengths, dp, budget = case
    plan = plan_micro_batches(lengths, dp_size=dp, max_tokens_per_gpu=budget)
    ranks = assign_ranks(lengths, dp)
    reference = max(_first_fit_decreasing_count(lengths[row].tolist(), budget) for row in ranks)
    assert plan.num_micro_batches <= reference + 1


def test_fewest_micro_batches_when_balanced_packing_overflows():
    # Two micro-batches suffice ({15, 12} and {10, 9, 6}); greedy balancing (LPT) into two overflows.
    plan = plan_micro_batches([15, 12, 10, 9, 6], dp_size=1, max_tokens_per_gpu=27)
    assert plan.num_micro_batches == 2
    assert sorted(plan.tokens()[0].tolist()) == [25, 27]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(dynamic_cases(), st.sampled_from([2, 3, 4]), st.sampled_from([1, 8]))
def test_dynamic_plan_with_context_parallel_and_alignment(case, cp, multiple):
    lengths, dp, budget = case
    budget = max(budget, multiple)
    lengths = np.minimum(lengths, (budget // multiple) * multiple * cp - 2 * cp + 1)
    lengths = np.maximum(lengths, 1)
    padded = -(-lengths // (2 * cp)) * (2 * cp)
    plan = plan_micro_batches(
        lengths, dp_size=dp, max_tokens_per_gpu=budget, context_parallel_size=cp, pad_to_multiple_of=multiple
    )
    _check_common(plan, lengths.size, dp)
    for r in range(dp):
        for mb in plan.micro_batches(r):
            per_gpu = padded[mb].sum() // cp  # what one context-parallel rank computes
            assert -(-per_gpu // multiple) * multiple <= budget


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.integers(1, 5).flatmap(
        lambda dp: st.tuples(st.just(dp), st.lists(st.integers(1, 5000), min_size=dp, max_size=dp * 30))
    ),
    st.integers(1, 7),
)
def test_fixed_plan_invariants(case, mbs):
    dp, lengths = case
    lengths = np.array(lengths[: len(lengths) // dp * dp])
    plan = plan_micro_batches(lengths, dp_size=dp, micro_batch_size=mbs)
    _check_common(plan, lengths.size, dp)
    assert plan.num_micro_batches == math.ceil(lengths.size // dp / mbs)
    assert all(mb.size <= mbs for r in range(dp) for mb in plan.micro_batches(r))
    assert plan.token_budget is None


def test_rank_balance_beats_round_robin(rl_lengths):
    dp = 8
    ranks = assign_ranks(rl_lengths, dp)
    loads = rl_lengths[ranks].sum(axis=1)
    round_robin = np.array([rl_lengths[r::dp].sum() for r in range(dp)])
    imbalance = loads.max() / loads.mean() - 1
    assert imbalance < 0.002
    assert imbalance < round_robin.max() / round_robin.mean() - 1
    # each row is in descending length order (the micro-batch packer relies on it)
    assert (np.diff(rl_lengths[ranks], axis=1) <= 0).all()


def test_dynamic_plan_is_near_minimal_on_rl_lengths(rl_lengths):
    plan = plan_micro_batches(rl_lengths, dp_size=8, max_tokens_per_gpu=16384)
    lower = math.ceil(plan.tokens().sum(axis=1).max() / 16384)
    assert plan.num_micro_batches <= lower + 1
    assert plan.tokens().max() <= 16384


def test_large_items_use_bin_packing_and_stay_within_budget(caplog):
    # Sequences just over a third of the budget: two fit per micro-batch, three do not; LPT into the volume
    # bound of bins must overflow, so the best-fit-decreasing path runs.
    rng = np.random.default_rng(0)
    lengths = rng.integers(340, 500, size=4 * 25)
    with caplog.at_level(logging.DEBUG, logger="tidal.batching.partition"):
        plan = plan_micro_batches(lengths, dp_size=4, max_tokens_per_gpu=1000)
    assert "best-fit-decreasing" in caplog.text
    assert plan.tokens().max() <= 1000
    assert plan.num_micro_batches <= 13  # 25 sequences, two per micro-batch where they fit
    assert {len(plan.micro_batches(r)) for r in range(4)} == {plan.num_micro_batches}


def test_plan_is_deterministic(rl_lengths):
    a = plan_micro_batches(rl_lengths, dp_size=4, max_tokens_per_gpu=16384)
    b = plan_micro_batches(rl_lengths, dp_size=4, max_tokens_per_gpu=16384)
    assert np.array_equal(a.sample_indices, b.sample_indices) and np.array_equal(a.boundaries, b.boundaries)


def test_too_long_sequence_names_both_numbers_and_the_flags():
    with pytest.raises(ValueError) as info:
        plan_micro_batches([100, 9000, 50, 20], dp_size=2, max_tokens_per_gpu=8192)
    msg = str(info.value)
    assert "9000" in msg and "8192" in msg
    assert "--max-tokens-per-gpu" in msg and "--context-parallel-size" in msg


def test_context_parallel_raises_the_budget():
    plan = plan_micro_batches([100, 9000, 50, 20], dp_size=2, max_tokens_per_gpu=8192, context_parallel_size=2)
    assert plan.token_budget == 2 * 8192


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"lengths": [1, 2, 3], "dp_size": 2, "micro_batch_size": 1}, "3 samples does not split evenly over 2"),
        ({"lengths": [1, 2], "dp_size": 1}, "exactly one of"),
        ({"lengths": [1, 2], "dp_size": 1, "micro_batch_size": 1, "max_tokens_per_gpu": 9}, "exactly one of"),
        ({"lengths": [], "dp_size": 1, "micro_batch_size": 1}, "at least one sample"),
        ({"lengths": [3, 0], "dp_size": 1, "micro_batch_size": 1}, "sample 1 has length 0"),
        ({"lengths": [3], "dp_size": 0, "micro_batch_size": 1}, "dp_size must be >= 1"),
        ({"lengths": [3], "dp_size": 1, "micro_batch_size": 0}, "--micro-batch-size must be >= 1"),
        ({"lengths": [3], "dp_size": 1, "max_tokens_per_gpu": 4, "pad_to_multiple_of": 8}, "smaller than the align"),
    ],
)
def test_bad_arguments(kwargs, match):
    rest = {k: v for k, v in kwargs.items() if k != "lengths"}  # the parameter dict is shared between runs
    with pytest.raises(ValueError, match=match):
        plan_micro_batches(kwargs["lengths"], **rest)


def test_fixed_micro_batches_follow_round_wise_lpt(rl_lengths):
    """Each round of ``num_bins`` samples (longest first) gives its longest to the lightest micro-batch so far."""
    lengths, dp, mbs = rl_lengths[:60], 2, 7
    plan = plan_micro_batches(lengths, dp_size=dp, micro_batch_size=mbs)
    ranks = assign_ranks(lengths, dp)
    num_bins = math.ceil(ranks.shape[1] / mbs)
    for rank in range(dp):
        loads, members = [0] * num_bins, [[] for _ in range(num_bins)]
        row = ranks[rank].tolist()
        for start in range(0, len(row), num_bins):
            chunk = row[start : start + num_bins]
            lightest = sorted(range(num_bins), key=lambda b: (loads[b], b))[: len(chunk)]
            for b, i in zip(lightest, chunk, strict=True):
                loads[b] += int(lengths[i])
                members[b].append(i)
        expected = sorted(sorted(m) for m in members)
        assert sorted(sorted(mb.tolist()) for mb in plan.micro_batches(rank)) == expected
        assert sorted(plan.tokens()[rank].tolist()) == sorted(loads)


def test_argument_errors_name_the_argument_and_bounds_are_inclusive():
    with pytest.raises(ValueError, match=r"^give exactly one of max_tokens_per_gpu \(dynamic batch size\) and micro"):
        plan_micro_batches([3], dp_size=1)
    for name in ("context_parallel_size", "pad_to_multiple_of"):
        with pytest.raises(ValueError, match=rf"^{name} must be >= 1, got 0$"):
            plan_micro_batches([3], dp_size=1, micro_batch_size=1, **{name: 0})
    with pytest.raises(ValueError, match=r"^plan_micro_batches\(\) needs at least one sample, got none$"):
        plan_micro_batches([], dp_size=1, micro_batch_size=1)
    for flag in ("--max-tokens-per-gpu", "--log-probs-max-tokens-per-gpu"):
        kw = {} if flag == "--max-tokens-per-gpu" else {"flag": flag}
        with pytest.raises(ValueError, match=rf"^{flag} must be >= 1, got 0$"):
            plan_micro_batches([1], dp_size=1, max_tokens_per_gpu=0, **kw)
        with pytest.raises(ValueError, match=rf"^{flag} 3 is smaller than the alignment multiple 4; raise {flag} to"):
            plan_micro_batches([1], dp_size=1, max_tokens_per_gpu=3, pad_to_multiple_of=4, **kw)
    # the smallest budgets are valid
    assert plan_micro_batches([1, 1], dp_size=1, max_tokens_per_gpu=1).num_micro_batches == 2
    assert plan_micro_batches([1, 1], dp_size=1, max_tokens_per_gpu=2, pad_to_multiple_of=2).num_micro_batches == 1


@pytest.mark.parametrize(("multiple", "aligned"), [(1, ""), (2, " (aligned to 2)")])
def test_too_long_sequence_mentions_the_alignment_only_when_there_is_one(multiple, aligned):
    with pytest.raises(ValueError) as e:
        plan_micro_batches([3, 9], dp_size=1, max_tokens_per_gpu=8, pad_to_multiple_of=multiple)
    assert str(e.value) == (
        f"sample 1 has 9 tokens, more than fits in one micro-batch: --max-tokens-per-gpu 8 × --context-parallel-size 1"
        f"{aligned} = 8 tokens; raise --max-tokens-per-gpu to at least {10 if multiple == 2 else 9} or raise "
        "--context-parallel-size"
    )
