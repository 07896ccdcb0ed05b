import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tidal.batching import PackedBatch, pack, unpack

seqs_strategy = st.lists(st.lists(st.integers(0, 50_000), min_size=1, max_size=40), min_size=1, max_size=12)


def test_layout_of_a_small_batch():
    batch = pack(
        [[5, 6, 7], [8, 9]],
        loss_masks=[[0, 1, 1], [0, 1]],
        token_fields={"old_log_probs": [[0.0, -0.5, -1.0], [0.0, -2.0]]},
        sample_fields={"rewards": [1.0, 0.0], "version": [3, 3]},
        sample_indices=[7, 2],
        pad_to_multiple_of=8,
    )
    assert batch.tokens.tolist() == [5, 6, 7, 8, 9, 0, 0, 0]
    assert batch.tokens.dtype == torch.int64
    assert batch.position_ids.tolist() == [0, 1, 2, 0, 1, 0, 1, 2]
    assert batch.cu_seqlens.tolist() == [0, 3, 5, 8] and batch.cu_seqlens.dtype == torch.int32
    assert batch.max_seqlen == 3
    assert batch.loss_mask.tolist() == [0, 1, 1, 0, 1, 0, 0, 0] and batch.loss_mask.dtype == torch.float32
    assert batch.token_fields["old_log_probs"].tolist() == [0.0, -0.5, -1.0, 0.0, -2.0, 0.0, 0.0, 0.0]
    assert batch.sample_fields["rewards"].dtype == torch.float32
    assert batch.sample_fields["version"].dtype == torch.int64
    assert batch.sample_indices.tolist() == [7, 2]
    assert (batch.num_sequences, batch.num_tokens, batch.num_padding_tokens, batch.num_real_tokens) == (2, 8, 3, 5)
    assert batch.seq_lengths.tolist() == [3, 2]


def test_no_padding_when_already_aligned_and_default_loss_mask():
    batch = pack([[1, 2, 3, 4], [5, 6, 7, 8]], pad_to_multiple_of=4)
    assert batch.num_padding_tokens == 0
    assert batch.cu_seqlens.tolist() == [0, 4, 8]
    # default: every token counts except each sequence's first (it has no prediction)
    assert batch.loss_mask.tolist() == [0, 1, 1, 1, 0, 1, 1, 1]


def test_tensor_and_array_inputs_match_lists():
    lists = [[1, 2, 3], [4, 5]]
    a = pack(lists)
    b = pack([torch.tensor(s) for s in lists])
    c = pack([np.array(s) for s in lists])
    for other in (b, c):
        assert torch.equal(a.tokens, other.tokens)
        assert torch.equal(a.cu_seqlens, other.cu_seqlens)


def test_batch_is_frozen():
    batch = pack([[1]])
    with pytest.raises(AttributeError):
        batch.max_seqlen = 3  # type: ignore[misc]
    assert isinstance(batch, PackedBatch)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"sequences": []}, r"^pack\(\) needs at least one sequence, got none$"),
        ({"sequences": [[1], []]}, "sequence 1 is empty"),
        ({"sequences": [[1, 2]], "loss_masks": [[1]]}, r"loss_masks\[0\] has 1 values but sequence 0 has 2"),
        ({"sequences": [[1, 2]], "loss_masks": [[1, 1], [1]]}, "2 entries but there are 1 sequences"),
        ({"sequences": [[1, 2]], "token_fields": {"adv": [[1.0]]}}, "token_fields"),
        (
            {"sequences": [[1, 2]], "sample_fields": {"rewards": [1.0, 2.0]}},
            r"sample_fields\['rewards'\] must have one",
        ),
        ({"sequences": [[1, 2]], "sample_indices": [0, 1]}, "sample_indices has 2 entries"),
        ({"sequences": [[1, 2]], "pad_to_multiple_of": 0}, "pad_to_multiple_of must be >= 1"),
    ],
)
def test_bad_input_raises_value_error(kwargs, match):
    rest = {k: v for k, v in kwargs.items() if k != "sequences"}  # the parameter dict is shared between runs
    with pytest.raises(ValueError, match=match):
        pack(kwargs["sequences"], **rest)


def test_unpack_rejects_values_of_the_wrong_length():
    batch = pack([[1, 2], [3]], pad_to_multiple_of=4)
    with pytest.raises(ValueError, match="4 tokens") as e:
        unpack(torch.zeros(3), batch)
    assert str(e.value) == (
        "unpack() got values of shape (3,) for a batch of 4 tokens; "
        "pass the per-token outputs computed on this very batch (first dim T)"
    )
    with pytest.raises(ValueError, match=r"shape \(\) for a batch of 4 tokens"):
        unpack(torch.tensor(1.0), batch)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seqs=seqs_strategy, multiple=st.sampled_from([1, 2, 8, 128]))
def test_pack_unpack_round_trip_and_invariants(seqs, multiple):
    advantages = [[float(i + 10 * k) for i in range(len(s))] for k, s in enumerate(seqs)]
    batch = pack(seqs, token_fields={"advantages": advantages}, pad_to_multiple_of=multiple)
    assert batch.num_tokens % multiple == 0
    assert batch.num_padding_tokens < multiple
    assert batch.num_real_tokens == sum(map(len, seqs))
    # every sequence comes back exactly, in order
    assert [t.tolist() for t in unpack(batch.tokens, batch)] == seqs
    assert [t.tolist() for t in unpack(batch.token_fields["advantages"], batch)] == advantages
    # position ids restart at every segment boundary and count up inside a segment
    starts = batch.cu_seqlens[:-1].long()
    assert (batch.position_ids[starts] == 0).all()
    inside = torch.ones(batch.num_tokens, dtype=torch.bool)
    inside[starts] = False
    assert (batch.position_ids[inside] == batch.position_ids[torch.nonzero(inside).squeeze(1) - 1] + 1).all()
    assert batch.max_seqlen == int(torch.diff(batch.cu_seqlens).max())
    assert batch.cu_seqlens[-1] == batch.num_tokens
    # padding never counts in the loss
    assert batch.loss_mask[batch.num_real_tokens :].sum() == 0


def test_unpack_keeps_trailing_dims():
    batch = pack([[1, 2, 3], [4]], pad_to_multiple_of=8)
    values = torch.arange(16.0).reshape(8, 2)
    parts = unpack(values, batch)
    assert [p.shape for p in parts] == [(3, 2), (1, 2)]
    assert parts[1].tolist() == [[6.0, 7.0]]


def test_sample_fields_keep_their_kind():
    batch = pack([[1], [2, 3]], sample_fields={"reward": [1, 2.5], "count": [3, 4], "ok": [True, False]})
    assert batch.sample_fields["reward"].dtype == torch.float32
    assert batch.sample_fields["count"].dtype == torch.int64 and batch.sample_fields["count"].tolist() == [3, 4]
    assert batch.sample_fields["ok"].dtype == torch.bool and batch.sample_fields["ok"].tolist() == [True, False]
    small = pack([[1], [2]], sample_fields={"n": torch.tensor([1, 2], dtype=torch.int16)})
    assert small.sample_fields["n"].dtype == torch.int64
    wide = pack([[1], [2]], sample_fields={"r": torch.tensor([0.5, 1.5], dtype=torch.float64)})
    assert wide.sample_fields["r"].dtype == torch.float32


def test_default_loss_mask_drops_each_first_token_even_of_a_one_token_sequence():
    assert pack([[5], [6, 7], [8, 9, 1]]).loss_mask.tolist() == [0.0, 0.0, 1.0, 0.0, 1.0, 1.0]


@pytest.mark.parametrize(
    "kind",
    [
        list,
        lambda s: torch.tensor(s, dtype=torch.int32),
        lambda s: np.asarray(s, dtype=np.int32),
    ],
    ids=["lists", "int32 tensors", "int32 arrays"],
)
def test_every_input_kind_packs_to_the_same_dtypes(kind):
    seqs, masks, adv = [[3, 4], [5, 6, 7]], [[0, 1], [0, 1, 1]], [[0.5, 0.5], [1.5, 1.5, 1.5]]
    batch = pack([kind(s) for s in seqs], loss_masks=[kind(m) for m in masks], token_fields={"adv": adv},
                 sample_indices=np.asarray([[4, 9]], dtype=np.int32))  # fmt: skip
    assert batch.tokens.dtype == torch.int64 and batch.tokens.tolist() == [3, 4, 5, 6, 7]
    assert batch.loss_mask.dtype == torch.float32 and batch.loss_mask.tolist() == [0, 1, 0, 1, 1]
    assert batch.token_fields["adv"].dtype == torch.float32
    assert batch.position_ids.dtype == torch.int64 and batch.position_ids.tolist() == [0, 1, 0, 1, 2]
    assert batch.sample_indices.dtype == torch.int64 and batch.sample_indices.tolist() == [4, 9]


def test_a_token_field_of_per_token_arrays_keeps_its_trailing_dims():
    ids = [np.arange(3 * 2 * 2).reshape(3, 2, 2), np.arange(2 * 2 * 2).reshape(2, 2, 2) + 100]
    batch = pack([[5, 6, 7], [8, 9]], token_fields={"experts": ids, "lp": [[0.0, -1.0, -2.0], [0.0, -3.0]]},
                 pad_to_multiple_of=8)  # fmt: skip
    field = batch.token_fields["experts"]
    assert field.shape == (8, 2, 2) and field.dtype == torch.float32
    assert field[:5].tolist() == np.concatenate(ids).tolist()
    assert not field[5:].any()  # the padding tail is 0
    assert batch.token_fields["lp"].shape == (8,)
    with pytest.raises(ValueError, match=r"token_fields\['experts'\]"):
        pack([[5, 6, 7], [8, 9]], token_fields={"experts": [ids[0], np.zeros((2, 3, 2))]})
