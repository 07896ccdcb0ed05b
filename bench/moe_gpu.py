"""Qwen3-30B-A3B- or GLM-4.5-Air-shaped MoE on one GPU: tidal-actor against HF transformers, and fp32/bf16 parity.

Run on the device machine like bench_actor_gpu.py (megatron-core carried in ``.carry/site``):
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
    PYTHONPATH=.carry/site:packages/actor/src:packages/batching/src:packages/ckpt/src \
        python3 bench/moe_gpu.py --out $OUT
Debug on CPU with a tiny model: uv run python bench/moe_gpu.py --tiny --out /tmp/moe_bench

The model: Qwen3-30B-A3B's shape (hidden 2048, 128 experts, top-8, expert FFN 768, 32 query / 4 KV heads of 128,
vocab 151936, norm_topk_prob), or with ``--family glm4_moe`` GLM-4.5-Air's (hidden 4096, 128 routed experts of FFN
1408 and one shared, top-8 by sigmoid scores with the score-correction bias, the first layer dense, 96 query / 8 KV
heads of 128 with biases, half the head dim rotary, vocab 151552), with ``--layers`` layers (default: as many as the
estimate below fits in the GPU's memory for training), random bf16 weights saved with transformers and loaded by both
sides from the same files.

Sections (progress lines as they go; the JSON report is rewritten after each):
  experts:  one MoE layer's experts at the dispatched row count of 32k tokens x top-8, forward + backward, as
            tidal's ``GroupedExperts`` runs them on CUDA in bf16 (``torch.nn.functional.grouped_mm``, one grouped
            GEMM per projection) and as a loop of one GEMM pair per expert (what megatron-core 0.19's
            ``SequentialMLP`` does without Transformer Engine or the grouped_gemm package); time and max difference.
  tidal:    ``Actor`` (bf16 parameters, AdamW state in bf16, Triton kernels, ``--recompute`` optional) on the long
            RL mix packed into micro-batches of ``--tokens`` tokens: one ``train_step`` over all of them (PPO-clip
            loss, optimizer step included) and a ``compute_log_probs`` pass; peak memory; then one more training step
            under torch's profiler (kernels by device time in ``profile_moe_train.txt``; ``--no-profile`` skips it).
  tidal_megatron_permute: the tidal section again with megatron-core's own unfused permute/unpermute in the token
            dispatcher (index_select / scatter_add, atomic adds in backward and forward) instead of
            ``tidal.actor.moe_permute`` (gathers by the permutation and its inverse): the A/B of that change.
  hf:       transformers' ``Qwen3MoeForCausalLM`` (bf16, SDPA, its default experts implementation, printed) on the
            same sequences one at a time (no padding), the same loss, AdamW(bf16) step; log-prob pass.
  parity:   a ``--parity-layers`` model of the same shape; a 16k sequence packed beside short ones: tidal fp32 vs HF
            fp32 (both loaded from the same bf16 files, never cast; HF fp32's attention exact math 1k queries at a time
            and its LM head 2k positions at a time, HF bf16 with SDPA),
            tidal bf16 and HF bf16 vs HF fp32, per position bucket (mean and max |log-prob difference|).

MFU = model FLOPs / time / 989e12 (H100 SXM and H200 bf16 dense peak). Model FLOPs on the ACTIVE parameters, per
sequence of length s: forward = 2 * N_active * s + 2 * L * s^2 * d (N_active: every matmul a token uses: q/k/v/o,
the router, its top-k experts' gate/up/down, a dense layer's MLP, the LM head; d = heads * head_dim; causal);
training = 3 * forward (recompute not counted). Every contender is credited with real tokens only.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from bench_actor_gpu import CUDA, DEV, PEAK_FLOPS, log, long_mix, model_flops, peak_gib, ppo_loss, reset_peak, sync

QWEN3_30B_A3B = dict(
    vocab_size=151936,
    hidden_size=2048,
    intermediate_size=6144,
    moe_intermediate_size=768,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    num_experts=128,
    num_experts_per_tok=8,
    norm_topk_prob=True,
    max_position_embeddings=40960,
    rope_theta=1e6,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)
TINY = QWEN3_30B_A3B | dict(
    vocab_size=512, hidden_size=64, moe_intermediate_size=32, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, num_experts=8, num_experts_per_tok=2, max_position_embeddings=4096,
)  # fmt: skip
GLM45_AIR = dict(  # zai-org/GLM-4.5-Air's config.json (layers set per run)
    model_type="glm4_moe",
    vocab_size=151552,
    hidden_size=4096,
    intermediate_size=10944,
    moe_intermediate_size=1408,
    num_attention_heads=96,
    num_key_value_heads=8,
    head_dim=128,
    n_routed_experts=128,
    n_shared_experts=1,
    num_experts_per_tok=8,
    first_k_dense_replace=1,
    n_group=1,
    topk_group=1,
    routed_scaling_factor=1.0,
    norm_topk_prob=True,
    partial_rotary_factor=0.5,
    attention_bias=True,
    use_qk_norm=False,
    max_position_embeddings=131072,
    rope_theta=1e6,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)
TINY_GLM = GLM45_AIR | dict(
    vocab_size=512, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, n_routed_experts=8, num_experts_per_tok=2, max_position_embeddings=4096,
)  # fmt: skip
FAMILIES = {"qwen3_moe": (QWEN3_30B_A3B, TINY), "glm4_moe": (GLM45_AIR, TINY_GLM)}
REPORT: dict = {}


def num_experts(cfg: dict) -> int:
    return cfg.get("num_experts") or cfg["n_routed_experts"]


def _attention_params(cfg: dict) -> int:
    h, d = cfg["hidden_size"], cfg["head_dim"]
    return h * d * (cfg["num_attention_heads"] * 2 + cfg["num_key_value_heads"] * 2)


def _dense_layers(cfg: dict, layers: int) -> int:
    return min(int(cfg.get("first_k_dense_replace") or 0), layers)


def active_matmul_params(cfg: dict, layers: int) -> int:
    """Parameters of every matmul one token goes through (top-k and shared experts only, the first dense layers'
    MLP), LM head included."""
    h, f = cfg["hidden_size"], cfg["moe_intermediate_size"]
    moe = num_experts(cfg) * h + (cfg["num_experts_per_tok"] + int(cfg.get("n_shared_experts") or 0)) * 3 * f * h
    dense = _dense_layers(cfg, layers)
    mlp = dense * 3 * cfg["intermediate_size"] * h + (layers - dense) * moe
    return layers * _attention_params(cfg) + mlp + cfg["vocab_size"] * h


def layer_params(cfg: dict) -> int:
    """One MoE layer's parameters (every expert, the shared ones, the router)."""
    h, f = cfg["hidden_size"], cfg["moe_intermediate_size"]
    experts = num_experts(cfg) + int(cfg.get("n_shared_experts") or 0)
    return _attention_params(cfg) + num_experts(cfg) * h + experts * 3 * f * h


def default_layers(cfg: dict, tokens: int, recompute: bool) -> int:
    """Layers that fit: bf16 weights + gradients + AdamW's two bf16 moments (8 bytes a parameter) and ~170 KB of
    saved activations per token and layer (one layer's with --recompute), next to the embedding and head."""
    total = torch.cuda.get_device_properties(0).total_memory if CUDA else 80 * 2**30
    fixed = 2 * cfg["vocab_size"] * cfg["hidden_size"] * 8 + 6 * 2**30
    act = 170e3 * tokens
    per_layer = layer_params(cfg) * 8 + (4 * cfg["hidden_size"] * tokens if recompute else act)
    return max(1, int((0.92 * total - fixed - (act if recompute else 0)) // per_layer))


def save_model(cfg: dict, layers: int, out: Path, seed: int = 0) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    fields = {k: v for k, v in cfg.items() if k != "model_type"}
    config = AutoConfig.for_model(cfg.get("model_type", "qwen3_moe"), **fields, num_hidden_layers=layers)
    with torch.device(DEV):
        model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.05)
            elif "mlp.gate." in name:
                p.normal_(0.0, 0.1)
            else:
                p.normal_(0.0, 0.02)
    model.save_pretrained(out)
    del model
    reset_peak()


def workload(n: int, seed: int, vocab: int, scale: float) -> dict:
    rng = np.random.default_rng(seed)
    lengths = np.maximum((long_mix(rng, n) * scale).astype(np.int64), 8)
    gen = torch.Generator().manual_seed(seed)
    tokens = [torch.randint(0, vocab, (int(k),), generator=gen) for k in lengths]
    prompts = [min(int(k) // 4, 500) for k in lengths]
    masks = [torch.cat([torch.zeros(p), torch.ones(int(k) - p)]) for p, k in zip(prompts, lengths, strict=True)]
    adv = torch.randn(n, generator=gen)
    old = [torch.full((int(k),), -3.0) for k in lengths]
    return {"lengths": lengths, "tokens": tokens, "masks": masks, "adv": adv, "old": old}


def timed(fn, steps: int) -> float:
    fn()
    sync()
    times = []
    for _ in range(steps):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def experts_section(cfg: dict, tokens: int, steps: int) -> dict:
    """tidal's GroupedExperts on CUDA bf16 (grouped_mm) against a per-expert loop (SequentialMLP's way)."""
    from megatron.core.transformer.transformer_config import TransformerConfig
    from tidal.actor import moe_experts

    e, k = num_experts(cfg), cfg["num_experts_per_tok"]
    dtype = torch.bfloat16 if CUDA else torch.float32
    tc = TransformerConfig(
        num_layers=1, hidden_size=cfg["hidden_size"], num_attention_heads=cfg["num_attention_heads"],
        num_moe_experts=e, moe_ffn_hidden_size=cfg["moe_intermediate_size"], params_dtype=dtype,
        use_cpu_initialization=not CUDA, perform_initialization=False, add_bias_linear=False,
    )  # fmt: skip
    experts = moe_experts.GroupedExperts(e, tc)
    with torch.no_grad():
        experts.weight1.normal_(0, 0.02)
        experts.weight2.normal_(0, 0.02)
    gen = torch.Generator().manual_seed(0)
    counts = torch.bincount(torch.randint(0, e, (tokens * k,), generator=gen), minlength=e)
    x = torch.randn(tokens * k, cfg["hidden_size"], device=DEV, dtype=dtype, requires_grad=True)
    probs = torch.rand(tokens * k, device=DEV)
    grad = torch.randn_like(x)

    def run():
        x.grad = None
        experts.zero_grad(set_to_none=True)
        out, _ = experts(x, counts, probs)
        out.backward(grad)
        return out.detach(), x.grad.detach(), experts.weight1.grad.detach()

    results, out = {}, {}
    available = moe_experts.grouped_gemm_available
    for name, use_grouped in (("grouped_mm", True), ("loop", False)):
        if use_grouped and not available(torch.device(DEV), dtype):
            continue
        moe_experts.grouped_gemm_available = (lambda *a: True) if use_grouped else (lambda *a: False)
        try:
            results[name] = timed(run, steps)
            out[name] = [t.float() for t in run()]
        finally:
            moe_experts.grouped_gemm_available = available
        log(f"experts {name}: {results[name] * 1e3:.1f} ms forward+backward ({tokens * k} rows, {e} experts)")
    if len(out) == 2:
        diff = [float((a - b).abs().max() / b.abs().max()) for a, b in zip(out["grouped_mm"], out["loop"], strict=True)]
        results["max_rel_diff_out_dx_dw1"] = diff
        log(f"experts grouped_mm vs loop: max relative difference (out, dx, dw1) {diff}")
    results["chosen"] = min((v, n) for n, v in results.items() if isinstance(v, float))[1]
    log(f"experts: the faster correct path is {results['chosen']}")
    return results  # the caller frees the experts (reset_peak)


def micro_batches(work: dict, tokens: int):
    from tidal.batching import pack_micro_batches, plan_micro_batches

    fields = {"old_log_probs": work["old"], "advantages": [torch.full((len(t),), float(a)) for t, a in
              zip(work["tokens"], work["adv"], strict=True)]}  # fmt: skip
    plan = plan_micro_batches(work["lengths"], dp_size=1, max_tokens_per_gpu=tokens)
    return pack_micro_batches(plan, 0, work["tokens"], loss_masks=work["masks"], token_fields=fields)


def tidal_section(args, ckpt: Path, work: dict, flops: dict) -> dict:
    from tidal.actor import Actor, ActorConfig

    cfg = ActorConfig(
        hf_checkpoint=str(ckpt), params_dtype="bfloat16", lr=1e-6, log_probs_chunk_size=4096,
        recompute_activations=args.recompute,
    )  # fmt: skip
    t0 = time.perf_counter()
    actor = Actor(cfg)
    allocated = torch.cuda.memory_allocated() / 2**30 if CUDA else 0.0
    log(f"tidal: actor built and loaded in {time.perf_counter() - t0:.1f}s; {allocated:.1f} GiB allocated")
    mbs = micro_batches(work, args.tokens)
    log(f"tidal: {len(mbs)} micro-batches of <= {args.tokens} tokens")
    reset_peak()
    train_s = timed(lambda: actor.train_step(mbs), args.steps)
    train_peak = peak_gib()
    log(f"tidal: train step {train_s:.2f}s, peak {train_peak:.1f} GiB")
    reset_peak()
    lp_s = timed(lambda: [actor.compute_log_probs(mb) for mb in mbs], args.steps)
    if not args.no_profile:
        profile_step(lambda: actor.train_step(mbs), Path(args.out, "profile_moe_train.txt"))
    real = int(work["lengths"].sum())
    out = {
        "train_s": train_s, "train_tokens_per_s": real / train_s, "train_mfu": flops["train"] / train_s / PEAK_FLOPS,
        "logprob_s": lp_s, "logprob_tokens_per_s": real / lp_s, "logprob_mfu": flops["fwd"] / lp_s / PEAK_FLOPS,
        "train_peak_gib": train_peak, "logprob_peak_gib": peak_gib(), "micro_batches": len(mbs),
    }  # fmt: skip
    log(f"tidal: {out['train_tokens_per_s']:.0f} tok/s train (MFU {out['train_mfu']:.1%}), "
        f"{out['logprob_tokens_per_s']:.0f} tok/s log-probs (MFU {out['logprob_mfu']:.1%})")  # fmt: skip
    return out  # the caller frees the actor (reset_peak)


def megatron_permute_section(args, ckpt: Path, work: dict, flops: dict) -> dict:
    """The tidal section again with megatron-core's own permute/unpermute in the token dispatcher (the A/B of
    ``tidal.actor.moe_permute``), unprofiled."""
    from megatron.core.transformer.moe import token_dispatcher
    from tidal.actor import moe_permute

    install, profile = moe_permute.install, args.no_profile
    moe_permute.install, args.no_profile = (lambda: None), True
    saved = token_dispatcher.permute, token_dispatcher.unpermute
    megatron = moe_permute._megatron_permute, moe_permute._megatron_unpermute
    token_dispatcher.permute, token_dispatcher.unpermute = megatron
    try:
        return tidal_section(args, ckpt, work, flops)
    finally:
        moe_permute.install, args.no_profile = install, profile
        token_dispatcher.permute, token_dispatcher.unpermute = saved


def profile_step(fn, out: Path) -> None:
    """One call of ``fn`` under torch's profiler; the kernels by total device time to ``out``, the top 8 logged."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if CUDA else [])
    with profile(activities=activities) as prof:
        fn()
        sync()
    key = "self_cuda_time_total" if CUDA else "self_cpu_time_total"  # as bench_actor_gpu.py's profiles
    table = prof.key_averages().table(sort_by=key, row_limit=40, max_name_column_width=60)
    out.write_text(table)
    log(f"profile of one tidal training step ({out.name}), top rows by {key}:")
    for line in table.splitlines()[:16]:
        print(line, flush=True)


def hf_log_probs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    lp = torch.log_softmax(logits[:-1].float(), dim=-1).gather(-1, ids[1:, None]).squeeze(-1)
    return torch.cat([lp.new_zeros(1), lp])


def hf_section(args, ckpt: Path, work: dict, flops: dict) -> dict:
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if CUDA else torch.float32
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=dtype, attn_implementation="sdpa").to(DEV)
    impl = getattr(model.config, "_experts_implementation", None)
    log(f"hf: loaded; experts implementation {impl!r}, attention sdpa")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, betas=(0.9, 0.98), eps=1e-8, fused=CUDA)
    num_loss = float(sum(float(m.sum()) for m in work["masks"]))

    def step():
        model.train()
        for ids, mask, old, adv in zip(work["tokens"], work["masks"], work["old"], work["adv"], strict=True):
            ids = ids.to(DEV)
            lp = hf_log_probs(model(input_ids=ids[None]).logits[0], ids)
            ppo_loss(lp, old.to(DEV), float(adv), mask.to(DEV), num_loss).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    @torch.no_grad()
    def logprobs():
        model.eval()
        for ids in work["tokens"]:
            ids = ids.to(DEV)
            hf_log_probs(model(input_ids=ids[None]).logits[0], ids).cpu()

    reset_peak()
    train_s = timed(step, args.steps)
    train_peak = peak_gib()
    log(f"hf: train step {train_s:.2f}s, peak {train_peak:.1f} GiB")
    reset_peak()
    lp_s = timed(logprobs, args.steps)
    real = int(work["lengths"].sum())
    out = {
        "experts_implementation": impl, "train_s": train_s, "train_tokens_per_s": real / train_s,
        "train_mfu": flops["train"] / train_s / PEAK_FLOPS, "logprob_s": lp_s, "logprob_tokens_per_s": real / lp_s,
        "logprob_mfu": flops["fwd"] / lp_s / PEAK_FLOPS, "train_peak_gib": train_peak, "logprob_peak_gib": peak_gib(),
    }  # fmt: skip
    log(f"hf: {out['train_tokens_per_s']:.0f} tok/s train (MFU {out['train_mfu']:.1%}), "
        f"{out['logprob_tokens_per_s']:.0f} tok/s log-probs (MFU {out['logprob_mfu']:.1%})")  # fmt: skip
    return out  # the caller frees the model (reset_peak)


def chunked_causal_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Exact causal attention of one unpadded sequence, 1024 queries at a time, in the inputs' dtype: HF's
    attention-interface signature (``query [b, h, s, d]``, key/value with grouped heads). The fp32 reference at 16k
    cannot use SDPA, whose fp32 path materialises every head's 16k x 16k scores (out of memory on 80 GB)."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    n, out = query.shape[2], []
    for lo in range(0, n, 1024):
        hi = min(lo + 1024, n)
        scores = query[:, :, lo:hi] @ key[:, :, :hi].transpose(-1, -2) * scaling
        rows = torch.arange(lo, hi, device=query.device)[:, None]
        scores.masked_fill_(torch.arange(hi, device=query.device)[None, :] > rows, float("-inf"))
        out.append(scores.softmax(-1) @ value[:, :, :hi])
    return torch.cat(out, dim=2).transpose(1, 2).contiguous(), None


def hf_chunked_log_probs(model, ids: torch.Tensor, chunk: int = 2048) -> torch.Tensor:
    """HF's log-probs with the LM head applied ``chunk`` positions at a time (a 16k x 152k fp32 logit tensor is
    10 GB, twice over with its log-softmax): the decoder's hidden states once, the head in the model's dtype."""
    hidden = model.model(input_ids=ids[None]).last_hidden_state[0, :-1]
    out = [hidden.new_zeros(1, dtype=torch.float32)]
    for lo in range(0, hidden.shape[0], chunk):
        logits = model.lm_head(hidden[lo : lo + chunk]).float()
        out.append(torch.log_softmax(logits, dim=-1).gather(-1, ids[lo + 1 : lo + 1 + chunk, None]).squeeze(-1))
    return torch.cat(out)


BUCKETS = [(1, 512), (512, 2048), (2048, 8192), (8192, 16384)]


def parity_section(args, cfg: dict, tmp: Path) -> dict:
    from tidal.actor import Actor, ActorConfig
    from tidal.batching import pack
    from transformers import AttentionInterface, AutoModelForCausalLM

    ckpt = tmp / "parity"
    save_model(cfg, args.parity_layers, ckpt, seed=1)
    gen = torch.Generator().manual_seed(1)
    lengths = [args.parity_len, 300, 40]
    seqs = [torch.randint(0, cfg["vocab_size"], (n,), generator=gen).tolist() for n in lengths]
    n = sum(lengths)

    AttentionInterface.register("chunked_causal", chunked_causal_attention)

    def hf(dtype):
        attention = "chunked_causal" if dtype == torch.float32 else "sdpa"
        model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=dtype, attn_implementation=attention).to(DEV).eval()
        with torch.no_grad():
            out = [hf_chunked_log_probs(model, torch.tensor(s, device=DEV)) for s in seqs]
        del model
        reset_peak()
        return torch.cat(out).double().cpu()

    def tidal(dtype):
        actor = Actor(ActorConfig(hf_checkpoint=str(ckpt), params_dtype=dtype, log_probs_chunk_size=4096))
        out = actor.compute_log_probs(pack(seqs))[:n].double()
        del actor
        reset_peak()
        return out

    ref = hf(torch.float32)
    log("parity: HF fp32 reference done")
    runs = {"tidal_fp32": tidal("float32"), "tidal_bf16": tidal("bfloat16"), "hf_bf16": hf(torch.bfloat16)}
    pos = torch.cat([torch.arange(k) for k in lengths])
    out = {}
    for name, lp in runs.items():
        diff = (lp - ref).abs()
        out[name] = {f"{lo}-{hi}": {"mean": float(diff[(pos >= lo) & (pos < hi)].mean()),
                                    "max": float(diff[(pos >= lo) & (pos < hi)].max())}
                     for lo, hi in BUCKETS if lo < args.parity_len}  # fmt: skip
        log(f"parity {name} vs HF fp32: " + ", ".join(f"{b} mean {v['mean']:.2e} max {v['max']:.2e}"
                                                      for b, v in out[name].items()))  # fmt: skip
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--tiny", action="store_true", help="tiny model and lengths, on CPU")
    p.add_argument("--family", choices=sorted(FAMILIES), default="qwen3_moe",
                   help="qwen3_moe: Qwen3-30B-A3B's shape; glm4_moe: GLM-4.5-Air's")  # fmt: skip
    p.add_argument("--layers", type=int, default=0, help="decoder layers (0: as many as fit for training)")
    p.add_argument("--tokens", type=int, default=32768, help="tokens per micro-batch (per GPU)")
    p.add_argument("--samples", type=int, default=40, help="sequences of the long RL mix")
    p.add_argument("--steps", type=int, default=2, help="timed repeats after one warm-up")
    p.add_argument("--recompute", action="store_true", help="recompute each layer in backward")
    p.add_argument("--no-profile", action="store_true", help="skip the profiled tidal training step")
    p.add_argument("--parity-layers", type=int, default=2)
    p.add_argument("--parity-len", type=int, default=16384)
    p.add_argument("--skip", nargs="*", default=[],
                   help="sections to skip: experts tidal tidal_megatron_permute hf parity")  # fmt: skip
    args = p.parse_args()
    cfg = FAMILIES[args.family][1 if args.tiny else 0]
    if args.tiny:
        args.tokens, args.samples, args.parity_len = min(args.tokens, 2048), min(args.samples, 8), 1500
    layers = args.layers or (2 if args.tiny else default_layers(cfg, args.tokens, args.recompute))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    REPORT.update(
        argv=sys.argv,
        family=args.family,
        torch=torch.__version__,
        date_utc=time.strftime("%Y-%m-%d %H:%M"),
        layers=layers,
    )
    REPORT["device"] = torch.cuda.get_device_name() if CUDA else "cpu"
    REPORT["mfu_formula"] = ("model FLOPs on active parameters / time / 989e12 (H100 SXM / H200 bf16 dense peak); "
                             "forward = 2*N_active*s + 2*L*s^2*d per sequence, training = 3*forward")  # fmt: skip
    dump = lambda: Path(args.out, "moe_bench.json").write_text(json.dumps(REPORT, indent=2))  # noqa: E731
    from tidal.actor import init_distributed

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    init_distributed(rank=0, world_size=1, master_addr="127.0.0.1", master_port=port)
    work = workload(args.samples, 0, cfg["vocab_size"], 0.02 if args.tiny else 1.0)
    lengths = work["lengths"]
    n_active = active_matmul_params(cfg, layers)
    d_attn = cfg["num_attention_heads"] * cfg["head_dim"]
    flops = {"fwd": model_flops(lengths, n_active, layers, d_attn, train=False),
             "train": model_flops(lengths, n_active, layers, d_attn, train=True)}  # fmt: skip
    REPORT["model"] = {"layers": layers, "active_matmul_params": n_active, "params_per_layer": layer_params(cfg)}
    REPORT["workload"] = {"samples": len(lengths), "real_tokens": int(lengths.sum()), "longest": int(lengths.max())}
    log(f"model: {layers} layers, {layer_params(cfg) * layers / 1e9:.2f}B layer params, {n_active / 1e6:.0f}M active "
        f"matmul params a token; workload {REPORT['workload']}")  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        sections = [
            ("experts", lambda: experts_section(cfg, args.tokens, args.steps)),
            ("tidal", lambda: tidal_section(args, tmp / "model", work, flops)),
            ("tidal_megatron_permute", lambda: megatron_permute_section(args, tmp / "model", work, flops)),
            ("hf", lambda: hf_section(args, tmp / "model", work, flops)),
            ("parity", lambda: parity_section(args, cfg, tmp)),
        ]
        if {"tidal", "hf"} - set(args.skip):
            t0 = time.perf_counter()
            save_model(cfg, layers, tmp / "model")
            log(f"saved the random bf16 checkpoint in {time.perf_counter() - t0:.1f}s")
        for name, fn in sections:
            if name in args.skip:
                continue
            try:
                REPORT[name] = fn()
            except Exception as e:  # keep going: the report says what failed
                import traceback

                traceback.print_exc()
                REPORT.setdefault("errors", []).append(f"{name}: {e!r}"[:500])
            reset_peak()
            dump()
    if "tidal" in REPORT and "hf" in REPORT:
        for what in ("train", "logprob"):
            REPORT[f"{what}_speedup_vs_hf"] = REPORT["tidal"][f"{what}_s"] and (
                REPORT["hf"][f"{what}_s"] / REPORT["tidal"][f"{what}_s"]
            )
        speedups = REPORT["train_speedup_vs_hf"], REPORT["logprob_speedup_vs_hf"]
        log("tidal vs HF: train x{:.2f}, log-probs x{:.2f}".format(*speedups))
    dump()
    log(f"report: {Path(args.out, 'moe_bench.json')}")


if __name__ == "__main__":
    main()
