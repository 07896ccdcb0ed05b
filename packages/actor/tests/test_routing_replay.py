"""Rollout routing replay in the actor: the routers dispatch to the replayed experts (every token that has them, in
packed batches), replaying the routers' own choice changes nothing, the routers still get gradient, the mismatch
metric, and the refusals."""

import dataclasses
import itertools
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from megatron.core.transformer.moe.router import TopKRouter
from tidal.actor import Actor, ActorConfig, train_on_rollout
from tidal.actor.routing_replay import FIELD, routed_experts_field
from tidal.batching import BatchingConfig, pack

sys.path.insert(0, str(Path(__file__).parent))
try:
    from moe_models import TINY_MOE, save_tiny_moe
finally:
    sys.path.pop(0)

SEQS = [[5, 17, 99, 3, 42, 7, 64], [1, 2, 3], [120, 0, 33, 33, 8, 90, 12, 101, 4, 56, 77]]
LAYERS, TOP_K, EXPERTS = TINY_MOE["num_hidden_layers"], TINY_MOE["num_experts_per_tok"], TINY_MOE["num_experts"]


@pytest.fixture(scope="module")
def actor(tmp_path_factory, dist_env):
    """norm_topk_prob true and layer 1 dense: the engine's rows still hold a (never read) block for it."""
    model = save_tiny_moe(tmp_path_factory.mktemp("moe"), norm_topk_prob=True, mlp_only_layers=[1])
    return Actor(ActorConfig(hf_checkpoint=str(model), lr=0.05, clip_grad=0.0))


class _Dispatched:
    """The experts each router dispatched each token to (from its routing map), sorted, by layer index."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.seen: dict[int, torch.Tensor] = {}
        self.handles = [m.register_forward_hook(self._hook) for m in model.modules() if isinstance(m, TopKRouter)]

    def _hook(self, module, _args, output) -> None:
        routing_map = output[1]
        self.seen[module.layer_number - 1] = routing_map.nonzero()[:, 1].view(routing_map.shape[0], -1).cpu()

    def rows(self) -> torch.Tensor:
        """``[T, layers x top-k]`` as the engine lays them out (a dense layer's block: -1)."""
        out = torch.full((next(iter(self.seen.values())).shape[0], LAYERS * TOP_K), -1, dtype=torch.long)
        for layer, ids in self.seen.items():
            out[:, layer * TOP_K : (layer + 1) * TOP_K] = ids
        return out

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def _log_probs(actor, batch, *, grad: bool = False):
    if not grad:
        return actor.compute_log_probs(batch)
    actor.model.train()
    actor.model.zero_grad(set_to_none=True)
    lp, _ = actor._forward(batch, with_entropy=False)
    (-lp.float() * batch.loss_mask).sum().backward()
    routers = [m for m in actor.model.modules() if isinstance(m, TopKRouter)]
    return lp.detach().float().cpu(), [r.weight.grad.clone() for r in routers]


def _spans(batch) -> list[tuple[int, int]]:
    cu = batch.cu_seqlens[: batch.num_sequences + 1].tolist()
    return list(itertools.pairwise(cu))


def _engine_rows(rows: torch.Tensor, batch) -> list[np.ndarray]:
    """Per sequence, rows of every token but its last (what SGLang returns)."""
    return [rows[a : b - 1].numpy().copy() for a, b in _spans(batch)]


def _batch(engine: list[np.ndarray] | None, **kw):
    fields = {FIELD: [routed_experts_field(r, len(s)) for r, s in zip(engine, SEQS, strict=True)]} if engine else None
    return pack(SEQS, token_fields=fields, **kw)


def test_replayed_routing_is_dispatched_and_replaying_the_routers_choice_changes_nothing(actor):
    plain = pack(SEQS, pad_to_multiple_of=8)
    spy = _Dispatched(actor.model)
    try:
        natural_lp, natural_grads = _log_probs(actor, plain, grad=True)
        natural = spy.rows()
        engine = _engine_rows(natural, plain)
        actor.routing_replay.replay = True
        same = _batch(engine, pad_to_multiple_of=8)
        lp, grads = _log_probs(actor, same, grad=True)
        torch.testing.assert_close(lp, natural_lp, atol=1e-6, rtol=0)
        for g, g0 in zip(grads, natural_grads, strict=True):
            torch.testing.assert_close(g, g0, atol=1e-6, rtol=1e-5)

        # other experts: a shifted choice (still k distinct ones) for every token that has engine rows
        shifted = [np.where(r >= 0, (r + 3) % EXPERTS, r) for r in engine]
        other = _batch(shifted, pad_to_multiple_of=8)
        lp, grads = _log_probs(actor, other, grad=True)
        dispatched = spy.rows()
        for (a, b), want in zip(_spans(other), shifted, strict=True):
            got = dispatched[a : b - 1]
            moe = want[0] >= 0  # the dense layer's block is -1
            assert np.array_equal(np.sort(got.numpy()[:, moe].reshape(len(got), -1, TOP_K), -1),
                                  np.sort(want[:, moe].reshape(len(want), -1, TOP_K), -1))  # fmt: skip
            assert torch.equal(dispatched[b - 1], natural[b - 1])  # the last token: the router's own choice
        mask = other.loss_mask.bool()
        assert (lp - natural_lp)[mask].abs().max() > 1e-3  # the replayed experts computed these log-probs
        for g, g0 in zip(grads, natural_grads, strict=True):  # the routers learn from the replayed experts' probs
            assert torch.isfinite(g).all() and g.abs().sum() > 0
            assert (g - g0).abs().max() > 1e-6
    finally:
        actor.routing_replay.replay = False
        spy.close()


def _natural_rows(actor) -> list[np.ndarray]:
    """The routers' own choice for SEQS under the current weights, laid out as the engine returns it."""
    plain = pack(SEQS)
    spy = _Dispatched(actor.model)
    try:
        actor.compute_log_probs(plain)
        return _engine_rows(spy.rows(), plain)
    finally:
        spy.close()


def test_mismatch_metric_and_train_on_rollout_under_replay(actor):
    plain = pack(SEQS)
    engine = _natural_rows(actor)
    batching = BatchingConfig(rollout_batch_size=1, n_samples_per_prompt=3)
    kw = dict(loss_masks=[[0] + [1] * (len(s) - 1) for s in SEQS], rewards=[1.0, 0.0, 0.5], group_size=3)
    # the same routing: nothing differs; experts of one of the 2 MoE layers swapped in sample 0: 1 in 2 of its rows
    metrics = train_on_rollout(actor, batching, tokens=SEQS, routed_experts=engine, reuse_step_log_probs=False, **kw)
    assert metrics["rollout/routing_mismatch_share"] == 0.0
    changed = _natural_rows(actor)  # the step moved the weights
    changed[0][:, :TOP_K] = (changed[0][:, :TOP_K] + 3) % EXPERTS
    decisions = 2 * sum(len(s) - 1 for s in SEQS)
    metrics = train_on_rollout(actor, batching, tokens=SEQS, routed_experts=changed, reuse_step_log_probs=False, **kw)
    assert metrics["rollout/routing_mismatch_share"] == pytest.approx((len(SEQS[0]) - 1) / decisions)
    cfg = actor.cfg
    actor.cfg, actor.routing_replay.replay = dataclasses.replace(cfg, use_rollout_routing_replay=True), True
    try:
        metrics = train_on_rollout(actor, batching, tokens=SEQS, routed_experts=changed, **kw)  # reused log-probs
        assert "rollout/routing_mismatch_share" in metrics and np.isfinite(metrics["train/loss"])
        with pytest.raises(ValueError, match="sample 1 carries no routed experts but --use-rollout-routing-replay"):
            train_on_rollout(actor, batching, tokens=SEQS, routed_experts=[engine[0], None, engine[2]], **kw)
        with pytest.raises(ValueError, match="--use-rollout-routing-replay: the micro-batch carries no routed"):
            actor.compute_log_probs(plain)
    finally:
        actor.cfg, actor.routing_replay.replay = cfg, False


def test_a_dense_model_is_refused(qwen2_dir, dist_env):
    with pytest.raises(ValueError, match="--use-rollout-routing-replay replays the experts of a mixture-of-experts"):
        Actor(ActorConfig(hf_checkpoint=str(qwen2_dir), use_rollout_routing_replay=True))
