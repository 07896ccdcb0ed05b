import pytest
import torch
import torch.nn.functional as F
from tidal.actor.attention import packed_causal_attention


def reference(q, k, v, scale):
    """Plain causal attention with explicit GQA expansion and a hand-built mask."""
    rep = q.size(1) // k.size(1)
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    n = q.size(0)
    scores = scores.masked_fill(torch.triu(torch.ones(n, n, dtype=torch.bool), 1), float("-inf"))
    return torch.einsum("hqk,khd->qhd", F.softmax(scores, dim=-1), v)


@pytest.mark.parametrize("lengths", [[5], [3, 1, 7], [4, 4, 2, 9]])
def test_packed_equals_unpacked(lengths):
    torch.manual_seed(0)
    total, heads, groups, dim = sum(lengths), 4, 2, 8
    q, k, v = (torch.randn(total, h, dim) for h in (heads, groups, groups))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    out = packed_causal_attention(q, k, v, cu, max(lengths), scale=dim**-0.5)
    assert out.shape == (total, heads, dim)
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        torch.testing.assert_close(out[s:e], reference(q[s:e], k[s:e], v[s:e], dim**-0.5), atol=1e-5, rtol=1e-5)


def test_segments_do_not_see_each_other():
    torch.manual_seed(0)
    q, k, v = torch.randn(6, 2, 4), torch.randn(6, 2, 4), torch.randn(6, 2, 4)
    cu = torch.tensor([0, 3, 6], dtype=torch.int32)
    base = packed_causal_attention(q, k, v, cu, 3, scale=0.5)
    k2, v2 = k.clone(), v.clone()
    k2[:3] += 10.0  # change the first segment's keys/values only
    v2[:3] += 10.0
    changed = packed_causal_attention(q, k2, v2, cu, 3, scale=0.5)
    assert not torch.allclose(base[:3], changed[:3])
    torch.testing.assert_close(base[3:], changed[3:])


@pytest.mark.parametrize(
    ("cls_path", "name", "cp"),
    [
        ("tidal.actor.attention:PackedCoreAttention", "PackedCoreAttention", 1),
        ("tidal.actor.cp_attention:ContextParallelCoreAttention", "context-parallel attention", 2),
    ],
)
def test_core_attention_modules_share_the_constructor_checks(cls_path, name, cp):
    """Both core-attention modules refuse dropout and non-causal masks at construction, naming themselves."""
    import importlib

    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    module, attr = cls_path.split(":")
    cls = getattr(importlib.import_module(module), attr)
    config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, context_parallel_size=cp)
    with pytest.raises(ValueError, match=f"{name} has no attention dropout; set attention_dropout=0, got 0.1"):
        cls(config, 1, AttnMaskType.causal, "self", attention_dropout=0.1)
    with pytest.raises(ValueError, match=f"{name} is causal only"):
        cls(config, 1, AttnMaskType.padding, "self", attention_dropout=0.0)


def test_packed_core_attention_refuses_context_parallelism():
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig
    from tidal.actor.attention import PackedCoreAttention

    config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, context_parallel_size=2)
    with pytest.raises(ValueError, match="context_parallel_size 1 only, got 2"):
        PackedCoreAttention(config, 1, AttnMaskType.causal, "self")
