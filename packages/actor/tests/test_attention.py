import pytest
import torch
import torch.nn.functional as F
from tidal.actor.attention import (
    CUDNN_BUCKETS_PER_OCTAVE,
    HostPackedSeqParams,
    cudnn_bucket_length,
    packed_causal_attention,
    padded_segment_attention,
    route_by_length,
    sdpa_backend_error,
)


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


def test_bucket_lengths_pad_little_and_are_few_per_octave():
    for n in range(1, 40000, 7):
        b = cudnn_bucket_length(n)
        assert n <= b <= n * (1 + 1 / CUDNN_BUCKETS_PER_OCTAVE), n
    # a rollout's lengths vary every step; the shapes cuDNN builds plans for must not
    assert len({cudnn_bucket_length(n) for n in range(2048, 32769)}) <= 4 * CUDNN_BUCKETS_PER_OCTAVE + 1


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode, torch.enable_grad])
def test_the_backend_probe_runs_a_backward_whatever_the_callers_grad_mode(mode):
    """The first long segment often comes in a log-prob pass under no_grad; a probe that failed there turned cuDNN
    off for the whole run (seen on an H200). The math backend on CPU stands in for cuDNN."""
    from torch.nn.attention import SDPBackend

    with mode():
        assert sdpa_backend_error(torch.device("cpu"), SDPBackend.MATH) is None


def test_long_segments_routed_and_padded_give_the_packed_result_and_gradients():
    """The GPU's cuDNN route on CPU: long segments padded to their bucket through SDPA (math backend), runs of short
    ones through the packed path, one 2,100-token segment among short ones; fp64, outputs and gradients."""
    from torch.nn.attention import SDPBackend

    torch.manual_seed(0)
    lengths = [5, 2100, 3, 60, 64, 1, 50]  # long ones at 64 and 2100 tokens: padded to 64 and 2112
    total, heads, groups, dim, scale = sum(lengths), 4, 2, 8, 8**-0.5
    q, k, v = (torch.randn(total, h, dim, dtype=torch.float64, requires_grad=True) for h in (heads, groups, groups))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    grad = torch.randn(total, heads, dim, dtype=torch.float64)
    calls = {"long": [], "short": []}

    def long_fn(q, k, v):
        calls["long"].append(q.size(0))
        return padded_segment_attention(q, k, v, scale, backend=SDPBackend.MATH)

    def short_fn(q, k, v, cu, max_len):
        calls["short"].append(cu.tolist())
        return packed_causal_attention(q, k, v, cu, max_len, scale=scale)

    routed = route_by_length(q, k, v, tuple(cu.tolist()), 64, long_fn, short_fn)
    assert calls == {"long": [2100, 64], "short": [[0, 5], [0, 3, 63], [0, 1, 51]]}
    got = [routed.detach(), *torch.autograd.grad(routed, (q, k, v), grad)]
    packed = packed_causal_attention(q, k, v, cu, max(lengths), scale=scale)
    want = [packed.detach(), *torch.autograd.grad(packed, (q, k, v), grad)]
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)
    start = sum(lengths[:1])
    torch.testing.assert_close(
        got[0][start : start + 2100], reference(*(x[start : start + 2100] for x in (q, k, v)), scale)
    )


def test_the_route_plan_is_made_once_per_batch_and_reused_by_every_layer():
    """``HostPackedSeqParams.route_cache``: the first layer plans the routes and copies the runs' cu_seqlens to the
    device; the next layers take both from the cache (no host work, no copy per layer) and route alike."""
    torch.manual_seed(0)
    lengths = [5, 300, 3, 60]
    total = sum(lengths)
    q, k, v = (torch.randn(total, h, 8, dtype=torch.float64) for h in (4, 2, 2))
    bounds = (0, *torch.tensor(lengths).cumsum(0).tolist())
    runs = []

    def short_fn(q, k, v, cu, max_len):
        runs.append(cu)
        return packed_causal_attention(q, k, v, cu, max_len, scale=0.5)

    def long_fn(q, k, v):
        return packed_causal_attention(q, k, v, torch.tensor([0, q.size(0)]), q.size(0), scale=0.5)

    params = HostPackedSeqParams(qkv_format="thd", host_cu_seqlens=bounds)
    first = route_by_length(q, k, v, bounds, 64, long_fn, short_fn, cache=params.route_cache)
    second = route_by_length(q, k, v, bounds, 64, long_fn, short_fn, cache=params.route_cache)
    assert len(params.route_cache) == 1 and [r.tolist() for r in runs[:2]] == [[0, 5], [0, 3, 63]]
    assert runs[2] is runs[0] and runs[3] is runs[1]  # the same device tensors, not new copies
    torch.testing.assert_close(first, second, atol=0, rtol=0)
    torch.testing.assert_close(first, packed_causal_attention(q, k, v, torch.tensor(bounds), 300, scale=0.5))


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


def test_the_backend_probe_inside_a_recomputed_layer_leaves_the_layers_saved_tensors_alone():
    """First asked inside an activation checkpoint (a recomputed layer's first forward), the probe's saved tensors
    must not count as the layer's: the recomputation, which finds the answer cached, saves only the layer's."""
    from torch.nn.attention import SDPBackend
    from torch.utils.checkpoint import checkpoint

    asked = []

    def layer(x):
        if not asked:  # what functools.cache does for cudnn_attention_usable
            asked.append(sdpa_backend_error(torch.device("cpu"), SDPBackend.MATH))
        return (x * x).sin()

    x = torch.randn(8, requires_grad=True)
    checkpoint(layer, x, use_reentrant=False).sum().backward()
    assert asked == [None]
    torch.testing.assert_close(x.grad, (x * x).cos() * 2 * x)
