"""The all-to-all dispatcher's permutation without atomic adds equals megatron-core's own, values and gradients."""

import pytest
import torch
from megatron.core.transformer.moe import moe_utils, token_dispatcher
from tidal.actor import moe_permute


def _routing(tokens: int, experts: int, k: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, experts, generator=gen)
    top = logits.topk(k, dim=1)
    probs = torch.zeros_like(logits).scatter(1, top.indices, top.values.softmax(-1))
    return probs, probs > 0


@pytest.mark.parametrize(("tokens", "experts", "k"), [(37, 8, 2), (300, 16, 8), (5, 4, 4)])
def test_permute_and_unpermute_equal_megatrons_with_their_gradients(tokens, experts, k):
    probs, routing_map = _routing(tokens, experts, k, seed=tokens)
    x = torch.randn(tokens, 24, dtype=torch.float64, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    weight = torch.randn(tokens * k, 24, dtype=torch.float64)

    ours = moe_permute.permute(x, routing_map, probs=probs, num_out_tokens=tokens * k)
    ref = moe_utils.permute(x_ref, routing_map, probs=probs, num_out_tokens=tokens * k)
    assert torch.equal(ours[0], ref[0]) and torch.equal(ours[1], ref[1]) and torch.equal(ours[2], ref[2])

    # an expert's "output" per permuted row, then the sum back per token
    out = moe_permute.unpermute(ours[0] * weight, ours[2], x.shape, routing_map=routing_map)
    out_ref = moe_utils.unpermute(ref[0] * weight, ref[2], x_ref.shape, routing_map=routing_map)
    torch.testing.assert_close(out, out_ref, rtol=1e-12, atol=1e-12)
    grad = torch.randn_like(out)
    out.backward(grad)
    out_ref.backward(grad)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-12, atol=1e-12)


def test_other_calls_go_to_megatron_unchanged():
    _, routing_map = _routing(20, 8, 2, seed=0)
    x = torch.randn(20, 6)
    # no probabilities (the all-gather dispatcher's call): megatron's function, no inverse attached
    permuted, _, sorted_indices, _, _ = moe_permute.permute(x, routing_map, num_out_tokens=40)
    assert not hasattr(sorted_indices, moe_permute._INVERSE)
    back = moe_permute.unpermute(permuted, sorted_indices, x.shape, routing_map=routing_map)
    torch.testing.assert_close(back, 2 * x)


def test_install_replaces_the_names_megatrons_dispatcher_calls():
    """Fails when megatron-core's token dispatcher stops calling module-level permute/unpermute (re-check the patch)."""
    moe_permute.install()
    assert token_dispatcher.permute is moe_permute.permute
    assert token_dispatcher.unpermute is moe_permute.unpermute
    source = token_dispatcher.MoEAlltoAllTokenDispatcher.dispatch_preprocess.__code__.co_names
    assert "permute" in source
    assert "unpermute" in token_dispatcher.MoEAlltoAllTokenDispatcher.combine_postprocess.__code__.co_names
