import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tidal.batching import gather_from_context_parallel, pack, split_for_context_parallel


def test_zigzag_chunk_assignment():
    # one sequence of 8 tokens, cp=2: 4 chunks of 2; rank 0 gets chunks 0 and 3, rank 1 chunks 1 and 2
    batch = pack([[10, 11, 12, 13, 14, 15, 16, 17]])
    r0 = split_for_context_parallel(batch, cp_size=2, cp_rank=0)
    r1 = split_for_context_parallel(batch, cp_size=2, cp_rank=1)
    assert r0.tokens.tolist() == [10, 11, 16, 17]
    assert r1.tokens.tolist() == [12, 13, 14, 15]
    assert r0.position_ids.tolist() == [0, 1, 6, 7]
    assert r1.position_ids.tolist() == [2, 3, 4, 5]
    assert r0.cu_seqlens.tolist() == [0, 4] and r0.cu_seqlens_padded.tolist() == [0, 8]


def test_sequences_are_padded_to_a_multiple_of_2cp():
    batch = pack([[1, 2, 3, 4, 5], [6, 7, 8]], loss_masks=[[0, 1, 1, 1, 1], [0, 1, 1]])
    shards = [split_for_context_parallel(batch, cp_size=2, cp_rank=r) for r in range(2)]
    assert shards[0].cu_seqlens_padded.tolist() == [0, 8, 12]
    assert shards[0].max_seqlen == 8
    for shard in shards:
        assert shard.cu_seqlens.tolist() == [0, 4, 6]
        pad = shard.source_index < 0
        assert (shard.tokens[pad] == 0).all() and (shard.loss_mask[pad] == 0).all()
    # rank 0: seq 0 chunks 0 ([1, 2]) and 3 (padding), seq 1 chunks 0 ([6]) and 3 (padding)
    assert shards[0].tokens.tolist() == [1, 2, 0, 0, 6, 0]
    assert shards[1].tokens.tolist() == [3, 4, 5, 0, 7, 8]
    assert shards[1].loss_mask.tolist() == [1, 1, 1, 0, 1, 1]


@st.composite
def cp_cases(draw):
    seqs = draw(st.lists(st.lists(st.integers(1, 1000), min_size=1, max_size=30), min_size=1, max_size=8))
    return seqs, draw(st.integers(1, 4)), draw(st.sampled_from([1, 2, 8])), draw(st.sampled_from([1, 8]))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cp_cases())
def test_split_then_gather_is_identity(case):
    seqs, cp, batch_multiple, local_multiple = case
    fields = {"adv": [[float(t) / 7 for t in s] for s in seqs]}
    batch = pack(seqs, token_fields=fields, pad_to_multiple_of=batch_multiple)
    shards = [
        split_for_context_parallel(batch, cp_size=cp, cp_rank=r, pad_to_multiple_of=local_multiple) for r in range(cp)
    ]
    assert len({s.num_tokens for s in shards}) == 1  # every rank computes the same number of tokens
    assert all(s.num_tokens % local_multiple == 0 for s in shards)
    # each real token lives on exactly one rank
    sources = torch.cat([s.source_index[s.source_index >= 0] for s in shards])
    assert torch.equal(torch.sort(sources).values, torch.arange(batch.num_tokens))
    for name, values in [("tokens", batch.tokens), ("adv", batch.token_fields["adv"])]:
        local = [s.tokens if name == "tokens" else s.token_fields[name] for s in shards]
        assert torch.equal(gather_from_context_parallel(local, batch, pad_to_multiple_of=local_multiple), values)
    # a rank's positions are the tokens' positions in their full sequence
    for s in shards:
        real = s.source_index >= 0
        assert torch.equal(s.position_ids[real], batch.position_ids[s.source_index[real]])
    # per-token outputs with a trailing dim come back too
    outs = [torch.stack([s.position_ids.float(), -s.position_ids.float()], dim=1) for s in shards]
    back = gather_from_context_parallel(outs, batch, pad_to_multiple_of=local_multiple)
    assert torch.equal(back[:, 0], batch.position_ids.float())


def test_cp1_is_the_identity():
    batch = pack([[1, 2, 3], [4, 5]])
    shard = split_for_context_parallel(batch, cp_size=1, cp_rank=0)
    assert shard.tokens.tolist() == [1, 2, 3, 0, 4, 5]  # each sequence padded to a multiple of 2
    assert shard.source_index.tolist() == [0, 1, 2, -1, 3, 4]


def test_errors():
    batch = pack([[1, 2, 3]])
    with pytest.raises(ValueError, match="cp_rank must be in"):
        split_for_context_parallel(batch, cp_size=2, cp_rank=2)
    with pytest.raises(ValueError, match="--context-parallel-size must be >= 1"):
        split_for_context_parallel(batch, cp_size=0, cp_rank=0)
    with pytest.raises(ValueError, match="rank 1 gave 3 values"):
        gather_from_context_parallel([torch.zeros(2), torch.zeros(3)], batch)


def test_a_token_field_with_trailing_dims_is_split_row_by_row():
    rows = torch.arange(11 * 3, dtype=torch.float32).reshape(11, 3)
    batch = pack([list(range(7)), list(range(4))], token_fields={"experts": [rows[:7], rows[7:]]})
    for rank in range(2):
        shard = split_for_context_parallel(batch, cp_size=2, cp_rank=rank)
        field = shard.token_fields["experts"]
        assert field.shape == (shard.num_tokens, 3)
        real = shard.source_index >= 0
        assert torch.equal(field[real], rows[shard.source_index[real]])
        assert not field[~real].any()
