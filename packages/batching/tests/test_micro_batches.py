import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tidal.batching import (
    BatchingConfig,
    BatchingError,
    alignment_multiple,
    pack,
    pack_micro_batches,
    plan_from_config,
    plan_micro_batches,
    unpack_micro_batches,
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    dp=st.integers(1, 4),
    per_rank=st.integers(1, 12),
    budget=st.integers(40, 200),
    multiple=st.sampled_from([1, 8]),
    seed=st.integers(0, 2**16),
)
def test_pack_then_unpack_restores_every_sample_once(dp, per_rank, budget, multiple, seed):
    rng = np.random.default_rng(seed)
    n = dp * per_rank
    lengths = rng.integers(1, budget - multiple + 1, size=n)
    seqs = [rng.integers(0, 1000, size=int(k)).tolist() for k in lengths]
    logp = [(-rng.random(int(k))).tolist() for k in lengths]
    rewards = rng.random(n).tolist()
    plan = plan_micro_batches(lengths, dp_size=dp, max_tokens_per_gpu=budget, pad_to_multiple_of=multiple)
    per_rank_batches = [
        pack_micro_batches(
            plan,
            r,
            seqs,
            token_fields={"old_log_probs": logp},
            sample_fields={"rewards": rewards},
            pad_to_multiple_of=multiple,
        )
        for r in range(dp)
    ]
    assert {len(b) for b in per_rank_batches} == {plan.num_micro_batches}
    flat = [b for rank in per_rank_batches for b in rank]
    assert all(b.num_tokens <= budget and b.num_tokens % multiple == 0 for b in flat)
    for b in flat:
        assert b.sample_fields["rewards"].tolist() == pytest.approx([rewards[i] for i in b.sample_indices.tolist()])
    # shuffle the micro-batches, as an all-gather over ranks may order them
    order = rng.permutation(len(flat))
    flat = [flat[i] for i in order]
    tokens = unpack_micro_batches([b.tokens for b in flat], flat, num_samples=n)
    assert [t.tolist() for t in tokens] == seqs
    back = unpack_micro_batches([b.token_fields["old_log_probs"] for b in flat], flat, num_samples=n)
    assert all(torch.allclose(t, torch.tensor(v, dtype=torch.float32)) for t, v in zip(back, logp, strict=True))


def test_tensor_fields_are_indexed_too():
    seqs = [torch.arange(k) for k in (3, 5, 2, 4)]
    plan = plan_micro_batches([3, 5, 2, 4], dp_size=2, micro_batch_size=1)
    batches = pack_micro_batches(plan, 1, seqs, sample_fields={"version": torch.tensor([10, 11, 12, 13])})
    for b in batches:
        assert b.sample_fields["version"].tolist() == [10 + i for i in b.sample_indices.tolist()]


def test_unpack_detects_missing_and_duplicate_samples():
    a = pack([[1, 2], [3]], sample_indices=[0, 1])
    b = pack([[4]], sample_indices=[1])
    with pytest.raises(BatchingError, match="sample 1 appears in more than one"):
        unpack_micro_batches([a.tokens, b.tokens], [a, b], num_samples=2)
    with pytest.raises(BatchingError, match="1 of 3 samples have no outputs"):
        unpack_micro_batches([a.tokens], [a], num_samples=3)
    with pytest.raises(BatchingError, match="outside"):
        unpack_micro_batches([a.tokens], [a], num_samples=1)


def test_pack_micro_batches_checks_its_arguments():
    plan = plan_micro_batches([3, 5], dp_size=2, micro_batch_size=1)
    with pytest.raises(ValueError, match="rank must be in"):
        pack_micro_batches(plan, 2, [[1, 2, 3], [1, 2, 3, 4, 5]])
    with pytest.raises(ValueError, match="covers 2 samples but 1"):
        pack_micro_batches(plan, 0, [[1, 2, 3]])


def test_alignment_multiple():
    assert alignment_multiple(8) == 8
    assert alignment_multiple(8, tensor_model_parallel_size=4) == 8  # no sequence parallelism: TP does not matter
    assert alignment_multiple(8, tensor_model_parallel_size=3, sequence_parallel=True) == 24
    assert alignment_multiple(128, tensor_model_parallel_size=8, sequence_parallel=True) == 128
    with pytest.raises(ValueError, match="--tensor-model-parallel-size"):
        alignment_multiple(8, tensor_model_parallel_size=0)


def test_plan_from_config_follows_the_mode():
    """--use-dynamic-batch-size packs under --max-tokens-per-gpu, aligned by --pad-to-multiple-of."""
    # without it: --micro-batch-size samples per micro-batch
    lengths = [100, 300, 50, 500, 20, 90, 400, 10]
    dynamic = BatchingConfig(
        rollout_batch_size=8, use_dynamic_batch_size=True, max_tokens_per_gpu=512, pad_to_multiple_of=8
    )
    plan = plan_from_config(dynamic, lengths, dp_size=2, tensor_model_parallel_size=3, sequence_parallel=True)
    assert plan.token_budget == 504  # 512 rounded down to lcm(8, 3) = 24
    assert plan.tokens().max() <= 504
    fixed = BatchingConfig(rollout_batch_size=8, micro_batch_size=2)
    plan = plan_from_config(fixed, lengths, dp_size=2)
    assert plan.token_budget is None and plan.num_micro_batches == 2
    assert plan_from_config(BatchingConfig(rollout_batch_size=8), lengths, dp_size=1).num_micro_batches == 8


def test_a_forward_only_plan_packs_under_its_own_budget_and_names_its_flag():
    lengths = [300, 300, 300, 300, 200, 100]
    cfg = BatchingConfig(
        rollout_batch_size=6, use_dynamic_batch_size=True, max_tokens_per_gpu=320, log_probs_max_tokens_per_gpu=640,
        pad_to_multiple_of=8, context_parallel_size=2,
    )  # fmt: skip
    assert cfg.micro_batch_token_budget == 640 and cfg.log_probs_token_budget == 1280
    train, forward = (
        plan_from_config(cfg, lengths, dp_size=1),
        plan_from_config(cfg, lengths, dp_size=1, forward_only=True),
    )
    assert (train.token_budget, forward.token_budget) == (640, 1280)
    assert (train.num_micro_batches, forward.num_micro_batches) == (3, 2)  # 1500 tokens: ceil(1500 / budget)
    without = BatchingConfig(rollout_batch_size=6, use_dynamic_batch_size=True, max_tokens_per_gpu=320)
    assert without.log_probs_token_budget is None
    assert plan_from_config(without, lengths, dp_size=1, forward_only=True).token_budget == 320  # the training one
    small = BatchingConfig(
        rollout_batch_size=6, use_dynamic_batch_size=True, max_tokens_per_gpu=512, log_probs_max_tokens_per_gpu=256
    )
    with pytest.raises(ValueError, match=r"300 tokens.*--log-probs-max-tokens-per-gpu 256.*raise --log-probs-max-tok"):
        plan_from_config(small, lengths, dp_size=1, forward_only=True)
    with pytest.raises(ValueError, match="--log-probs-max-tokens-per-gpu must be >= 1, got 0"):
        BatchingConfig(rollout_batch_size=6, log_probs_max_tokens_per_gpu=0)


def test_plan_from_config_scales_the_token_budget_by_the_configs_context_parallel_size():
    lengths = [300, 300, 300, 300]
    cfg = BatchingConfig(rollout_batch_size=4, use_dynamic_batch_size=True, max_tokens_per_gpu=320)
    cp2 = BatchingConfig(
        rollout_batch_size=4, use_dynamic_batch_size=True, max_tokens_per_gpu=320, context_parallel_size=2
    )
    assert cp2.micro_batch_token_budget == 640 and cfg.micro_batch_token_budget == 320
    assert plan_from_config(cfg, lengths, dp_size=1).num_micro_batches == 4
    plan = plan_from_config(cp2, lengths, dp_size=1)  # each GPU holds half of every sequence: two per micro-batch
    assert plan.token_budget == 640 and plan.num_micro_batches == 2
    assert plan_from_config(cp2, lengths, dp_size=1, context_parallel_size=1).num_micro_batches == 4  # explicit wins
    with pytest.raises(ValueError, match="--context-parallel-size must be >= 1"):
        BatchingConfig(rollout_batch_size=4, context_parallel_size=0)


# Two ranks whose best-fit packings need different micro-batch counts: the rank needing fewer is split to match.
UNEVEN = [30, 31, 19, 26, 33, 26, 15, 31, 20, 2, 19, 26, 21, 2, 25, 11, 21, 10, 37, 33, 28, 28]


def test_ranks_get_the_same_count_when_best_fit_packs_them_differently():
    plan = plan_micro_batches(UNEVEN, dp_size=2, max_tokens_per_gpu=42)
    tokens = plan.tokens()
    assert tokens.dtype == np.int64 and tokens.shape == (2, plan.num_micro_batches)
    assert (tokens > 0).all() and tokens.max() <= 42
    seen = []
    for rank in (0, 1):
        batches = plan.micro_batches(rank)
        assert len(batches) == plan.num_micro_batches
        assert all((np.diff(mb) > 0).all() for mb in batches)  # each micro-batch's samples in ascending order
        assert [sum(UNEVEN[i] for i in mb) for mb in batches] == tokens[rank].tolist()
        seen += [int(i) for mb in batches for i in mb]
    assert sorted(seen) == list(range(len(UNEVEN)))
    # fewest micro-batches the busier rank needs: its tokens over the budget, rounded up
    assert plan.num_micro_batches >= -(-max(sum(UNEVEN[i] for mb in plan.micro_batches(r) for i in mb)
                                            for r in (0, 1)) // 42)  # fmt: skip


@pytest.mark.parametrize("order", ["as planned", "reversed", "ranks interleaved"])
def test_masks_and_fields_come_back_per_sample_from_micro_batches_in_any_order(order):
    rng = np.random.default_rng(3)
    lengths = rng.integers(2, 30, size=12)
    seqs = [rng.integers(0, 1000, size=int(k)).tolist() for k in lengths]
    masks = [[0] * (len(s) // 2) + [1] * (len(s) - len(s) // 2) for s in seqs]
    adv = [[float(i)] * len(s) for i, s in enumerate(seqs)]
    plan = plan_micro_batches(lengths, dp_size=2, max_tokens_per_gpu=48)
    per_rank = [pack_micro_batches(plan, r, seqs, loss_masks=masks, token_fields={"adv": adv}, pad_to_multiple_of=8)
                for r in (0, 1)]  # fmt: skip
    batches = {
        "as planned": per_rank[0] + per_rank[1],
        "reversed": (per_rank[0] + per_rank[1])[::-1],
        "ranks interleaved": [b for pair in zip(per_rank[1], per_rank[0], strict=True) for b in pair],
    }[order]
    got_masks = unpack_micro_batches([b.loss_mask for b in batches], batches, num_samples=12)
    got_adv = unpack_micro_batches([b.token_fields["adv"] for b in batches], batches, num_samples=12)
    got_tokens = unpack_micro_batches([b.tokens for b in batches], batches, num_samples=12)
    for i in range(12):
        assert got_tokens[i].tolist() == seqs[i]
        assert got_masks[i].tolist() == masks[i]
        assert got_adv[i].tolist() == adv[i]


def test_unpack_micro_batches_refuses_mismatched_outputs():
    plan = plan_micro_batches([3, 4, 5, 6], dp_size=1, micro_batch_size=2)
    batches = pack_micro_batches(plan, 0, [[1] * 3, [2] * 4, [3] * 5, [4] * 6])
    assert [b.num_padding_tokens for b in batches] == [0, 0]  # no alignment unless asked for
    with pytest.raises(ValueError, match=r"^got 1 value tensors for 2 batches; pass one per batch$"):
        unpack_micro_batches([batches[0].tokens], batches, num_samples=4)
    with pytest.raises(ValueError):
        unpack_micro_batches([b.tokens[:-1] for b in batches], batches, num_samples=4)


def test_alignment_defaults_and_sequence_parallel():
    assert alignment_multiple() == 1
    assert alignment_multiple(8) == 8
    assert alignment_multiple(8, tensor_model_parallel_size=3) == 8  # no sequence parallelism: TP does not matter
    assert alignment_multiple(8, tensor_model_parallel_size=3, sequence_parallel=True) == 24
    assert alignment_multiple(tensor_model_parallel_size=3, sequence_parallel=True) == 3


def test_plan_from_config_defaults_and_the_flag_it_names():
    cfg = BatchingConfig(rollout_batch_size=2, n_samples_per_prompt=2, use_dynamic_batch_size=True,
                         max_tokens_per_gpu=10, pad_to_multiple_of=4)  # fmt: skip
    plan = plan_from_config(cfg, [3, 5, 2, 7], dp_size=1)  # TP 1, no SP: alignment 4 only
    assert plan.tokens().max() <= 8
    with pytest.raises(ValueError, match="--max-tokens-per-gpu 10"):
        plan_from_config(cfg, [3, 5, 2, 11], dp_size=1)
    fixed = BatchingConfig(rollout_batch_size=2, n_samples_per_prompt=2, micro_batch_size=2)
    assert plan_from_config(fixed, [3, 5, 2, 7], dp_size=1).num_micro_batches == 2


def test_unpack_names_the_first_eight_missing_samples():
    plan = plan_micro_batches([3, 4], dp_size=1, micro_batch_size=2)
    batches = pack_micro_batches(plan, 0, [[1] * 3, [2] * 4])
    with pytest.raises(
        BatchingError, match=r"^10 of 12 samples have no outputs \(first: \[2, 3, 4, 5, 6, 7, 8, 9\]\)$"
    ):
        unpack_micro_batches([b.tokens for b in batches], batches, num_samples=12)


def test_sequence_parallel_alone_adds_no_alignment():
    assert alignment_multiple(sequence_parallel=True) == 1 and alignment_multiple(4, sequence_parallel=True) == 4


def test_fixed_micro_batches_plan_the_context_parallel_padded_lengths():
    # CP 2 pads each sequence to a multiple of 4: 3 and 4 tie (stable order), unpadded 4 is the longer one
    cfg = BatchingConfig(rollout_batch_size=1, n_samples_per_prompt=2, micro_batch_size=1, context_parallel_size=2)
    padded = plan_from_config(cfg, [3, 4], dp_size=2)
    assert [mb.tolist() for mb in padded.micro_batches(0)] == [[0]]
    assert [
        mb.tolist() for mb in plan_from_config(cfg, [3, 4], dp_size=2, context_parallel_size=1).micro_batches(0)
    ] == [[1]]
