"""Rollout routing replay end to end on the real SGLang (CPU) and the real Megatron actor: the experts SGLang reports
for every token are the ones the actor's routers dispatch to under --use-rollout-routing-replay, and a sample resumed
in pieces carries the same rows as one generated at once.

One server for the module: the tiny Qwen3-MoE of test_moe_serving.py (every layer MoE), float32, launched as
``RolloutConfig(return_routed_experts=True)`` launches it (with ``--enable-return-routed-experts``).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
try:
    from test_moe_serving import _free_port, _tiny_moe_with_tokenizer
finally:
    sys.path.pop(0)

PROMPTS = [[3, 4, 5, 6], [7, 8], [9, 10, 11, 12, 13, 14]]


@pytest.fixture(scope="module")
def moe_engine(tmp_path_factory):
    from tidal.rollout import RolloutConfig, SGLangEngine

    model = _tiny_moe_with_tokenizer(tmp_path_factory.mktemp("moe"))
    cfg = RolloutConfig(return_routed_experts=True, sglang_server_args=("--dtype", "float32"),
                        rollout_temperature=0.0, rollout_max_response_len=8)  # fmt: skip
    engine = SGLangEngine.from_config(cfg, model, port=_free_port(), log_dir=tmp_path_factory.mktemp("logs"))
    engine.start()
    try:
        yield engine, cfg, model
    finally:
        engine.shutdown()


def _dispatched(model: torch.nn.Module, out: dict) -> list:
    from megatron.core.transformer.moe.router import TopKRouter

    def hook(module, _args, output) -> None:
        routing_map = output[1]
        out[module.layer_number - 1] = routing_map.nonzero()[:, 1].view(routing_map.shape[0], -1)

    return [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, TopKRouter)]


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU serving path (GPU runs SGLang's fused MoE kernels)")
def test_the_actor_routes_every_token_to_the_experts_sglang_reported(moe_engine):
    from tidal.actor import Actor, ActorConfig, destroy_distributed, init_distributed
    from tidal.actor.routing_replay import FIELD, routed_experts_field
    from tidal.batching import pack
    from tidal.rollout import generate_samples

    engine, cfg, model = moe_engine
    samples = generate_samples(engine, PROMPTS, cfg.sampling_params())
    layers, top_k = 3, 2  # the tiny model's
    for s in samples:
        assert s.rollout_routed_experts.shape == (len(s.tokens) - 1, layers * top_k)
        assert s.rollout_routed_experts.min() >= 0 and s.rollout_routed_experts.max() < 8

    init_distributed(rank=0, world_size=1, master_addr="127.0.0.1", master_port=_free_port())
    try:
        actor = Actor(ActorConfig(hf_checkpoint=str(model), use_rollout_routing_replay=True))
        rows = [routed_experts_field(s.rollout_routed_experts, len(s.tokens)) for s in samples]
        batch = pack([s.tokens for s in samples], token_fields={FIELD: rows}, pad_to_multiple_of=8)
        cu = batch.cu_seqlens.tolist()

        def log_probs_and_dispatched():
            seen: dict = {}
            handles = _dispatched(actor.model, seen)
            try:
                return actor.compute_log_probs(batch), seen
            finally:
                for h in handles:
                    h.remove()

        def assert_dispatched_as_sglang_reported(seen) -> None:
            for i, s in enumerate(samples):
                engine_rows = s.rollout_routed_experts.reshape(-1, layers, top_k)
                for layer in range(layers):
                    got = seen[layer][cu[i] : cu[i + 1] - 1].numpy()  # every token SGLang forwarded
                    assert np.array_equal(np.sort(got, -1), np.sort(engine_rows[:, layer], -1)), (i, layer)

        lp, seen = log_probs_and_dispatched()
        assert_dispatched_as_sglang_reported(seen)
        for i, s in enumerate(samples):
            mine = lp[cu[i] + len(s.prompt_ids) : cu[i + 1]]
            torch.testing.assert_close(mine, torch.tensor(s.response_log_probs), atol=1e-4, rtol=0)
        # the router's own choice, counted against SGLang's: float32 on both sides, the same experts
        assert actor.routing_replay.metrics(actor.device) == {"rollout/routing_mismatch_share": 0.0}

        # routers that would choose otherwise (their weights moved) still dispatch to SGLang's experts
        torch.manual_seed(0)
        with torch.no_grad():
            for router in actor.routing_replay.routers:
                router.weight.add_(torch.randn_like(router.weight))
        _, seen = log_probs_and_dispatched()
        assert_dispatched_as_sglang_reported(seen)
        assert actor.routing_replay.metrics(actor.device)["rollout/routing_mismatch_share"] > 0.1
    finally:
        destroy_distributed()


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU serving path (GPU runs SGLang's fused MoE kernels)")
def test_a_sample_resumed_in_pieces_carries_the_rows_of_one_generated_at_once(moe_engine):
    from tidal.rollout.dispatch import fresh_group, run_groups

    engine, cfg, _ = moe_engine
    params = {**cfg.sampling_params(), "n": 1}
    whole = [fresh_group(PROMPTS[2], 1)]
    run_groups(engine, whole, params)
    pieces = [fresh_group(PROMPTS[2], 1)]
    run_groups(engine, pieces, {**params, "max_new_tokens": 3})
    (cut,) = pieces[0]
    assert len(cut.response_ids) == 3 and cut.rollout_routed_experts.shape[0] == len(PROMPTS[2]) + 2
    pieces[0][0] = dataclasses.replace(cut, finish_reason="abort")  # as an abort leaves it: resumed next
    engine.flush_cache()  # the resumed prefix is computed again (no cached rows)
    run_groups(engine, pieces, params)
    (resumed,), (once,) = pieces[0], whole[0]
    assert resumed.response_ids == once.response_ids
    assert np.array_equal(resumed.rollout_routed_experts, once.rollout_routed_experts)
