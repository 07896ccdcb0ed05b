"""A Qwen3-MoE served by the real SGLang (CPU) and trained by the real Megatron actor: same log-probs, and after each
training step and a weight hand-off (an HF checkpoint on disk, then tensors in small buckets: the experts split across
them), the engine serves the actor's new weights. A GLM-4.5 too: same log-probs, and its score-correction bias synced.

SGLang 0.5.23 runs ``qwen3_moe`` on the CPU through its native MoE path (``moe_forward_native``); tidal-rollout's
``sgl_kernel`` import stand-in is all it needs (no fused-MoE kernel is called). Its ``qwen3_moe`` makes every layer
an MoE layer (it reads neither ``mlp_only_layers`` nor ``decoder_sparse_step``), as every released Qwen3-MoE is, so
the model here is too (``train`` refuses the other kind with engines).
"""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import pytest
import requests
import torch

ACTOR_TESTS = Path(__file__).resolve().parents[1] / "packages" / "actor" / "tests"
CORPUS = ["the answer is 0 1 2 3 4 5 6 7 8 9", "what is two plus two ? four", "a b c d e f g h i j k l m n o p"]
PROMPTS = [[3, 4, 5, 6], [7, 8], [9, 10, 11, 12, 13, 14]]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tiny_moe_with_tokenizer(out: Path, family: str = "qwen3_moe") -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    sys.path.insert(0, str(ACTOR_TESTS))
    try:
        from moe_models import save_tiny_glm, save_tiny_moe
    finally:
        sys.path.pop(0)
    tokenizer = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator(CORPUS, trainers.WordLevelTrainer(special_tokens=["<unk>", "<pad>", "<eos>"]))
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", pad_token="<pad>", eos_token="<eos>")
    fast.save_pretrained(out)
    ids = dict(eos_token_id=fast.eos_token_id, pad_token_id=fast.pad_token_id)
    if family == "glm4_moe":  # grouped biased sigmoid routing, shared expert, a dense layer, partial RoPE
        return save_tiny_glm(out, vocab_size=tokenizer.get_vocab_size(), **ids, max_position_embeddings=512)
    return save_tiny_moe(
        out, vocab_size=tokenizer.get_vocab_size(), norm_topk_prob=True, **ids,
        max_position_embeddings=512,
    )  # fmt: skip


def _generate(port: int) -> list[tuple[list[int], list[float]]]:
    """Greedy responses to PROMPTS and SGLang's log-prob of each response token."""
    body = {"input_ids": PROMPTS, "sampling_params": {"max_new_tokens": 8, "temperature": 0.0}, "return_logprob": True}
    out = requests.post(f"http://127.0.0.1:{port}/generate", json=body, timeout=120)
    out.raise_for_status()
    return [(r["output_ids"], [lp for lp, _, _ in r["meta_info"]["output_token_logprobs"]]) for r in out.json()]


def _actor_log_probs(actor, responses) -> list[torch.Tensor]:
    from tidal.batching import pack, unpack

    seqs = [p + ids for p, (ids, _) in zip(PROMPTS, responses, strict=True)]
    batch = pack(seqs)
    per_seq = unpack(actor.compute_log_probs(batch), batch)
    return [lp[len(p) :] for p, lp in zip(PROMPTS, per_seq, strict=True)]


@pytest.fixture(scope="module")
def glm_engine(tmp_path_factory):
    """``(engine, model dir)`` of a tiny GLM-4.5 served by SGLang, started without waiting for it: asked for by the
    Qwen3-MoE test too, so that the two servers start side by side rather than one after the other."""
    from tidal.rollout import SGLangEngine

    root = tmp_path_factory.mktemp("glm")
    model = _tiny_moe_with_tokenizer(root / "glm", family="glm4_moe")
    engine = SGLangEngine(
        model, port=_free_port(), log_dir=root / "logs", extra_server_args=["--dtype", "float32"],
        startup_timeout_s=600,
    )  # fmt: skip
    engine.start(wait=False)
    yield engine, model
    engine.shutdown()


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU serving path (GPU runs SGLang's fused MoE kernels)")
@pytest.mark.usefixtures("glm_engine")  # started here, checked by the GLM test below
def test_sglang_serves_the_actors_moe_before_and_after_a_step(tmp_path):
    from tidal.actor import Actor, ActorConfig, destroy_distributed, init_distributed
    from tidal.batching import pack
    from tidal.ckpt import save_hf_checkpoint
    from tidal.rollout import SGLangEngine
    from tidal.rollout.weight_sync import update_weights_from_tensor

    model = _tiny_moe_with_tokenizer(tmp_path / "moe")
    engine = SGLangEngine(
        model, port=_free_port(), log_dir=tmp_path / "logs", extra_server_args=["--dtype", "float32"],
        startup_timeout_s=600,
    )  # fmt: skip
    engine.start(wait=False)
    init_distributed(rank=0, world_size=1, master_addr="127.0.0.1", master_port=_free_port())
    try:
        actor = Actor(ActorConfig(hf_checkpoint=str(model), lr=0.05, clip_grad=0.0))  # built while SGLang starts
        engine.wait_healthy()
        before = _generate(engine.port)
        ours = _actor_log_probs(actor, before)
        for (_, theirs), mine in zip(before, ours, strict=True):
            torch.testing.assert_close(torch.tensor(theirs), mine, atol=1e-4, rtol=0)

        def step(responses, advantages) -> None:
            seqs = [p + ids for p, (ids, _) in zip(PROMPTS, responses, strict=True)]
            masks = [[0] * len(p) + [1] * len(ids) for p, (ids, _) in zip(PROMPTS, responses, strict=True)]
            old = [[0.0] * len(p) + lps for p, (_, lps) in zip(PROMPTS, responses, strict=True)]
            fields = {"old_log_probs": old, "advantages": [[a] * len(s) for a, s in zip(advantages, seqs, strict=True)]}
            actor.train_step([pack(seqs, loss_masks=masks, token_fields=fields)])

        def served_equals_actor(previous):
            now = _generate(engine.port)
            for (_, theirs), mine in zip(now, _actor_log_probs(actor, now), strict=True):
                torch.testing.assert_close(torch.tensor(theirs), mine, atol=1e-4, rtol=0)
            # the engine really serves new weights: the first response or its log-probs moved
            moved = (torch.tensor(now[0][1]) - torch.tensor(previous[0][1])).abs().max()
            assert now[0][0] != previous[0][0] or moved > 1e-2, moved
            return now

        step(before, (1.0, -1.0, -1.0))  # the weights go to the engine through disk (--update-weight-transport disk)
        synced = save_hf_checkpoint(tmp_path / "synced", actor.named_hf_tensors(), source_dir=model)
        engine.update_weights_from_disk(synced)
        after = served_equals_actor(before)
        step(after, (-1.0, 1.0, 1.0))  # then as tensors in 64 KiB buckets (--update-weight-transport tensor)
        metrics = update_weights_from_tensor(engine, actor.named_hf_tensors(), bucket_bytes=2**16)
        assert metrics["weight_sync/num_buckets"] > 3
        served_equals_actor(after)
    finally:
        engine.shutdown()
        destroy_distributed()


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU serving path (GPU runs SGLang's fused MoE kernels)")
def test_sglang_serves_the_actors_glm_and_its_score_correction_bias(glm_engine):
    """GLM-4.5 (glm4_moe): the engine's log-probs equal the actor's; a tensor sync carries a changed bias.

    SGLang 0.5.23's glm4_moe runs on the CPU as its qwen3_moe does (the native MoE path, its grouped biased top-k in
    torch ops): the ``sgl_kernel`` stand-in is all it needs.
    """
    from tidal.actor import Actor, ActorConfig, destroy_distributed, init_distributed
    from tidal.rollout.weight_sync import update_weights_from_tensor

    engine, model = glm_engine
    init_distributed(rank=0, world_size=1, master_addr="127.0.0.1", master_port=_free_port())
    try:
        actor = Actor(ActorConfig(hf_checkpoint=str(model), lr=0.05, clip_grad=0.0))  # built while SGLang starts
        engine.wait_healthy()
        before = _generate(engine.port)
        for (_, theirs), mine in zip(before, _actor_log_probs(actor, before), strict=True):
            torch.testing.assert_close(torch.tensor(theirs), mine, atol=1e-4, rtol=0)
        # a new score-correction bias on both sides (as a resumed or bias-updating run would have): the sync carries
        # it, and the engine routes with it as the actor does
        with torch.no_grad():
            for name, bias in actor.model.named_buffers():
                if name.endswith("router.expert_bias"):
                    bias.copy_(torch.linspace(0.6, -0.6, bias.numel()))
        update_weights_from_tensor(engine, actor.named_hf_tensors(), bucket_bytes=2**16)
        now = _generate(engine.port)
        for (_, theirs), mine in zip(now, _actor_log_probs(actor, now), strict=True):
            torch.testing.assert_close(torch.tensor(theirs), mine, atol=1e-4, rtol=0)
        moved = (torch.tensor(now[0][1]) - torch.tensor(before[0][1])).abs().max()
        assert now[0][0] != before[0][0] or moved > 1e-3, moved
    finally:
        destroy_distributed()
