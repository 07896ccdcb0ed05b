"""Train/inference mismatch of a mixture-of-experts model with and without rollout routing replay (R3), on CPU.

One real SGLang server serves the embedded MoE model (``--recipe embedded-moe``'s: 4 layers, 8 experts, top-2) in
``--dtype`` (bfloat16 by default) with ``--enable-return-routed-experts``; it samples ``--n`` responses to each of
``--prompts`` prompts of the shipped addition task (temperature 1). The Megatron actor loads the same checkpoint in
float32 (as tidal's trainer keeps its weights) and computes the log-prob of every response token twice, on the same
samples: routing every token itself (R3 off), then to the experts SGLang reported (R3 on). Reported per mode:

* ``rollout/logprob_abs_diff/mean`` and ``/max``: |engine log-prob - actor log-prob| over the response tokens
  (``tidal.actor.agreement``, what ``train`` logs every rollout);
* ``rollout/routing_mismatch_share``: share of (token, MoE layer) decisions, over every token SGLang forwarded
  (prompt and response), where the actor's router's own top-k set differs from SGLang's (the same in both modes:
  with R3 on those tokens are dispatched to SGLang's set instead);
* ``token_mismatch_share``: share of those tokens with a differing set in at least one layer;
* ``affected_logprob_abs_diff/mean`` and ``/max``: the log-prob gap on the response tokens whose log-prob a differing
  decision reaches (one of the tokens forwarded before them was routed otherwise), ``affected_response_tokens`` of them.

    uv run python bench/routing_replay_mismatch.py --out /tmp/r3.json              # ~40 s on two cores
    uv run python bench/routing_replay_mismatch.py --dtype float32 --out /tmp/r3_fp32.json
"""

from __future__ import annotations

import argparse
import json
import logging
import socket
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _samples(model: Path, args, log_dir: Path) -> list:
    from tidal.rollout import RolloutConfig, SGLangEngine, generate_samples
    from tidal.train.task_data import TRAIN_FILE, read_jsonl, shipped_path
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    records = read_jsonl(shipped_path(TRAIN_FILE))[: args.prompts]
    prompts = [tokenizer.encode(r["prompt"]) for r in records]
    cfg = RolloutConfig(
        return_routed_experts=True,
        sglang_server_args=("--dtype", args.dtype),
        n_samples_per_prompt=args.n,
        rollout_max_response_len=args.max_new_tokens,
        rollout_temperature=1.0,
    )
    engine = SGLangEngine.from_config(cfg, model, port=_free_port(), log_dir=log_dir)
    engine.start()
    try:
        start = time.monotonic()
        samples = generate_samples(engine, prompts, cfg.sampling_params())
        print(f"generated {len(samples)} samples in {time.monotonic() - start:.1f} s", flush=True)
        return samples
    finally:
        engine.shutdown()


def _measure(actor, samples: list, batch) -> dict[str, float]:
    import torch
    from megatron.core.transformer.moe.router import TopKRouter
    from tidal.actor.agreement import agreement_metrics, agreement_sums

    own: dict[int, np.ndarray] = {}  # the router's own top-k, whatever it dispatched to

    def hook(module, args, _output) -> None:
        logits = module.gating(args[0]).view(-1, module.config.num_moe_experts)
        own[module.layer_number - 1] = np.sort(logits.topk(module.topk, dim=-1).indices.numpy(), -1)

    handles = [m.register_forward_hook(hook) for m in actor.model.modules() if isinstance(m, TopKRouter)]
    try:
        lp = actor.compute_log_probs(batch)
    finally:
        for h in handles:
            h.remove()
    engine = np.concatenate([[0.0] * len(s.prompt_ids) + list(s.response_log_probs) for s in samples])
    n = batch.num_real_tokens
    mask = batch.loss_mask[:n]
    metrics = agreement_metrics(agreement_sums(lp[:n], torch.as_tensor(engine, dtype=torch.float32), mask))
    metrics |= actor.routing_replay.metrics(actor.device)
    cu = batch.cu_seqlens.tolist()
    differs, affected = [], []
    for i, s in enumerate(samples):
        rows = s.rollout_routed_experts.reshape(len(s.tokens) - 1, len(own), -1)
        mine = np.stack([own[layer][cu[i] : cu[i + 1] - 1] for layer in sorted(own)], axis=1)
        token_differs = (np.sort(rows, -1) != mine).any(-1).any(-1)  # per forwarded token 0..n-2
        differs.append(token_differs)
        # the log-prob of token t comes from forwarding tokens 0..t-1: affected once any of them was routed otherwise
        seen = np.concatenate([[False], np.logical_or.accumulate(token_differs)])
        affected.append(seen & (np.asarray(s.loss_mask) > 0))
    metrics["token_mismatch_share"] = float(np.concatenate(differs).mean())
    hit = torch.as_tensor(np.concatenate(affected))
    gap = (lp[:n] - torch.as_tensor(engine, dtype=torch.float32)).abs()[hit]
    metrics["affected_response_tokens"] = int(hit.sum())
    if gap.numel():
        metrics["affected_logprob_abs_diff/mean"] = float(gap.mean())
        metrics["affected_logprob_abs_diff/max"] = float(gap.max())
    return metrics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=128)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--dtype", default="bfloat16", help="SGLang --dtype of the engine")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    from tidal.actor import Actor, ActorConfig, destroy_distributed, init_distributed
    from tidal.actor.routing_replay import FIELD, routed_experts_field
    from tidal.batching import pack
    from tidal.train.embedded_model import MOE_SPEC, ensure_embedded_model

    model = ensure_embedded_model(spec=MOE_SPEC)
    with tempfile.TemporaryDirectory() as logs:
        samples = _samples(model, args, Path(logs))
    init_distributed(rank=0, world_size=1, master_addr="127.0.0.1", master_port=_free_port())
    try:
        actor = Actor(ActorConfig(hf_checkpoint=str(model)))
        fields = {FIELD: [routed_experts_field(s.rollout_routed_experts, len(s.tokens)) for s in samples]}
        masks = [s.loss_mask for s in samples]
        batch = pack([s.tokens for s in samples], loss_masks=masks, token_fields=fields)
        results = {}
        for mode, replay in (("r3_off", False), ("r3_on", True)):
            actor.routing_replay.replay = replay
            results[mode] = _measure(actor, samples, batch)
            print(mode, json.dumps(results[mode]), flush=True)
    finally:
        destroy_distributed()
    out = {
        "engine_dtype": args.dtype,
        "actor_dtype": "float32",
        "model": "embedded MoE (4 layers, 8 experts, top-2)",
        "samples": len(samples),
        "response_tokens": int(sum(len(s.response_ids) for s in samples)),
        "forwarded_tokens": int(sum(len(s.tokens) - 1 for s in samples)),
        **results,
    }
    print(json.dumps(out, indent=1))
    if args.out:
        args.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
