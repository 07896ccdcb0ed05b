"""Actor throughput on one GPU: tidal-actor (packed, dynamic batch size) against Hugging Face transformers (issue 11).

Run on the device machine (torch and transformers from its image, megatron-core carried): copy the venv's
``megatron/`` and ``megatron_core-0.19.2.dist-info/`` into ``.carry/site`` (git-excluded), carry ``.carry``, then
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
    PYTHONPATH=.carry/site:packages/actor/src:packages/batching/src:packages/ckpt/src \
        python3 bench/bench_actor_gpu.py --out $OUT --profile --ab-fused --skip hf
Debug on CPU with a tiny model: uv run python bench/bench_actor_gpu.py --tiny --out /tmp/bab

One run measures, on a Qwen2-1.5B-shaped random bf16 model and the RL-shaped length mix of
bench_batching.py (``lognormal_mix``, fixed seed, same samples for every contender):
  (a) tidal-actor: ``plan_micro_batches(max_tokens_per_gpu=...)`` + ``pack``; ``train_step`` / ``compute_log_probs``
      (the log-prob pass packed under ``--max-tokens-logprob``: ``train``'s ``--log-probs-max-tokens-per-gpu``, the
      training steps under each ``--max-tokens-train``: ``train``'s ``--max-tokens-per-gpu``);
  (b) HF transformers, SDPA, padded micro-batches (arrival order, micro-batch size 2 to train, 8 for log-probs);
  (c) HF transformers on packed rows (the same plan as (a)) with ``position_ids`` and a varlen attention function.
tidal-actor (default ``--precision bf16-main``): bf16 parameters with fp32 main copies and fp32 AdamW state, no
autocast, Triton kernels for q/k/v split + RoPE, SwiGLU, RMSNorm and the LM head's log-softmax (``fused_kernels``);
``--precision autocast`` is the earlier setting (fp32 weights under bf16 autocast). HF contenders: fp32 weights and
AdamW state, bf16 autocast. All: the same PPO-clip loss over response tokens.

Figures (median over ``--steps`` repeats after one warm-up): real tokens/s of one optimizer step over the whole
batch, of a log-prob pass over the whole batch, MFU, peak memory, and the time to export every weight as
HF-named bf16 tensors.

MFU = model FLOPs / time / 989e12 (H200 bf16 dense datasheet peak). Model FLOPs, per sequence of length s:
    forward  = 2 * N * s + 2 * L * s^2 * d      (N: parameters of every matmul incl. the LM head, embedding
                                                lookup excluded; L layers; d = heads * head_dim; causal QK^T and
                                                AV: 2 * (2 * s^2 * d) / 2 per layer)
    training = 3 * forward                      (recomputation not counted)
Padding is never counted: every contender is credited only with its real tokens.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from bench_batching import lognormal_mix  # the RL-shaped length mix of the batching benchmark

torch.set_num_threads(os.cpu_count() or 1)  # bench_batching pins one thread for its own timings

PEAK_FLOPS = 989e12
DUMP = lambda: None  # noqa: E731  (main sets it: write the report so far, so a killed run keeps what it measured)
CUDA = torch.cuda.is_available()
DEV = torch.device("cuda" if CUDA else "cpu")

QWEN2_1_5B = dict(
    vocab_size=151936,
    hidden_size=1536,
    intermediate_size=8960,
    num_hidden_layers=28,
    num_attention_heads=12,
    num_key_value_heads=2,
    max_position_embeddings=32768,
    rope_theta=1e6,
    tie_word_embeddings=True,
)
QWEN2_7B = dict(  # Qwen2-7B's shape: the memory-headroom case of issue 11
    vocab_size=152064,
    hidden_size=3584,
    intermediate_size=18944,
    num_hidden_layers=28,
    num_attention_heads=28,
    num_key_value_heads=4,
    max_position_embeddings=32768,
    rope_theta=1e6,
    tie_word_embeddings=False,
)
QWEN3_1_7B = dict(  # Qwen3-1.7B's shape (issue 24): qk-norm, head_dim 128, GQA 16/8
    model_type="qwen3",
    vocab_size=151936,
    hidden_size=2048,
    intermediate_size=6144,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=40960,
    rope_theta=1e6,
    tie_word_embeddings=True,
)
LLAMA_3_2_3B = dict(  # Llama-3.2-3B's shape (issue 24): llama3 rope scaling, GQA 24/8, tied
    model_type="llama",
    vocab_size=128256,
    hidden_size=3072,
    intermediate_size=8192,
    num_hidden_layers=28,
    num_attention_heads=24,
    num_key_value_heads=8,
    max_position_embeddings=131072,
    rope_parameters=dict(
        rope_type="llama3",
        rope_theta=5e5,
        factor=32.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=8192,
    ),
    tie_word_embeddings=True,
)
MODELS = {"1.5b": None, "7b": None, "qwen3-1.7b": QWEN3_1_7B, "llama-3.2-3b": LLAMA_3_2_3B}
TINY = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    tie_word_embeddings=True,
)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def reset_peak() -> None:
    gc.collect()
    if CUDA:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak_gib() -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if CUDA else float("nan")


def timed_median(fn, steps: int) -> tuple[float, list[float]]:
    """Run ``fn`` once to warm up, then ``steps`` times; the median seconds and all times."""
    fn()
    sync()
    times = []
    for _ in range(steps):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), times


# ----------------------------------------------------------------------------------------------- workload


def long_mix(rng: np.random.Generator, n: int) -> np.ndarray:
    """Issue 24's long RL mix: responses log-normal around 2k (mean >= 2k), one of 12.5k; prompts 50-500."""
    response = np.clip(rng.lognormal(np.log(1700), 0.8, n), 10, 12288).astype(np.int64)
    response[0] = 12288
    return response + rng.integers(50, 501, n)


def make_workload(n: int, seed: int, vocab: int, scale: float, mix: str = "rl") -> dict:
    """Lengths from lognormal_mix (or long_mix), random tokens, prompt/response loss masks, per-sample advantages."""
    rng = np.random.default_rng(seed)
    lengths = (long_mix if mix == "long" else lognormal_mix)(rng, n)
    if scale != 1.0:
        lengths = np.maximum((lengths * scale).astype(np.int64), 8)
    prompts = np.minimum(rng.integers(50, 501, n) if scale == 1.0 else np.full(n, 4), lengths - 1)
    gen = torch.Generator().manual_seed(seed)
    tokens = [torch.randint(0, vocab, (int(k),), generator=gen) for k in lengths]
    masks = [torch.cat([torch.zeros(int(p)), torch.ones(int(k - p))]) for p, k in zip(prompts, lengths, strict=True)]
    adv = torch.randn(n, generator=gen)
    return {"lengths": lengths, "tokens": tokens, "loss_masks": masks, "advantages": adv}


def model_flops(lengths, n_matmul: int, layers: int, d_attn: int, *, train: bool) -> float:
    s = np.asarray(lengths, dtype=np.float64)
    fwd = float((2 * n_matmul * s + 2 * layers * s**2 * d_attn).sum())
    return 3 * fwd if train else fwd


def ppo_loss(lp, old, adv, mask, num_loss_tokens, eps=0.2, eps_high=0.28):
    """The PPO-clip policy loss (sum over loss tokens / tokens of the step), as tidal's GRPO loss computes it."""
    ratio = torch.exp(lp - old)
    loss = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - eps, 1 + eps_high))
    return (loss * mask).sum() / num_loss_tokens


# ----------------------------------------------------------------------------------------------- ceilings


def copy_tb_s() -> float:
    """Device-to-device copy bandwidth (read + write) of a 4 GiB fp32 tensor."""
    x = torch.randn(2**30, device=DEV, dtype=torch.float32)
    y = torch.empty_like(x)
    t, _ = timed_median(lambda: y.copy_(x), 5)
    return 2 * x.numel() * 4 / t / 1e12


def ceilings(report: dict) -> None:
    if not CUDA:
        return
    a, b = (torch.randn(8192, 8192, device=DEV, dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    t, _ = timed_median(lambda: [a @ b for _ in range(10)], 3)
    report["ceiling_matmul_bf16_tflops"] = 10 * 2 * 8192**3 / t / 1e12
    report["ceiling_d2d_copy_tb_s"] = copy_tb_s()


# ----------------------------------------------------------------------------------------------- tidal actor


def actor_config(args, ckpt: Path):
    from tidal.actor import ActorConfig

    if args.precision == "bf16-main":  # bf16 parameters, fp32 main copies in the optimizer (no autocast)
        precision = dict(params_dtype="bfloat16", fp32_main_params=True)
    else:  # the shipped default before issue 11's second pass: fp32 weights under bf16 autocast
        precision = dict(bf16=True)
    return ActorConfig(
        hf_checkpoint=str(ckpt),
        lr=1e-6,
        log_probs_chunk_size=args.chunk,
        fused_kernels=not args.no_fused,
        recompute_lm_head=not args.keep_lm_head,
        optimizer_cpu_offload=args.optimizer_cpu_offload,
        **({} if args.cudnn_min_segment is None else {"cudnn_attention_min_tokens": args.cudnn_min_segment}),
        **precision,
    )


def offload_check(report: dict) -> None:
    """CPUOffloadAdamW against torch's fused AdamW on this device: three steps of the same random parameters."""
    from tidal.actor.offload import CPUOffloadAdamW

    gen = torch.Generator(device=DEV).manual_seed(0)
    shapes = [(4096, 1000), (777,), (3, 5000)]
    ref = [torch.nn.Parameter(torch.randn(s, device=DEV, generator=gen)) for s in shapes]
    off = [torch.nn.Parameter(p.detach().clone()) for p in ref]
    hyper = {"lr": 1e-3, "betas": (0.9, 0.98), "eps": 1e-8, "weight_decay": 0.1}
    opts = [torch.optim.AdamW(ref, fused=CUDA, **hyper), CPUOffloadAdamW(off, staging_bytes=2**20, **hyper)]
    for _ in range(3):
        grads = [torch.randn(s, device=DEV, generator=gen) for s in shapes]
        for params, opt in zip((ref, off), opts, strict=True):
            for p, g in zip(params, grads, strict=True):
                p.grad = g.clone()
            opt.step()
    diff = max(float((a - b).abs().max()) for a, b in zip(ref, off, strict=True))
    report["offload_adamw_vs_fused_adamw_max_abs_diff"] = diff
    log(f"CPUOffloadAdamW vs fused AdamW on {DEV}: max abs diff {diff}")


def logprob_transient_estimate(cfg: dict, tokens: int, chunk: int, fused: bool) -> float:
    """Bytes a no-grad forward of ``tokens`` tokens needs beyond what is resident: the larger of one layer's MLP
    (fc1 output [T, 2F], SwiGLU output [T, F], three [T, h] tensors: residual, norm output, fc2 output) and one
    LM-head chunk (bf16 logits [c, V], plus an fp32 log-softmax [c, V] unless fused), plus the final hidden
    states [T, h] kept while the head runs; all bf16 (2 bytes)."""
    h, f, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    layer = tokens * (3 * f + 3 * h) * 2
    head = chunk * v * 2 + (0 if fused else chunk * v * 4)
    return max(layer, head) + tokens * h * 2


def allocated_gib() -> float:
    return torch.cuda.memory_allocated() / 2**30 if CUDA else float("nan")


def _max_diff(results: list[list[torch.Tensor]]) -> float:
    return max(float((a.detach().float() - b.detach().float()).abs().max()) for a, b in zip(*results, strict=True))


def _against_eager(fns, inputs: list[torch.Tensor], grad_of, differentiable: int | None = None) -> float:
    """Max abs difference of outputs and input gradients between ``fns[0]`` (eager) and ``fns[1]`` (Triton), on
    the same ``inputs`` (the first ``differentiable`` of them get gradients; all by default)."""
    res = []
    n = len(inputs) if differentiable is None else differentiable
    for fn in fns:
        leaves = [t.clone().requires_grad_(i < n) for i, t in enumerate(inputs)]
        out = fn(*leaves)
        out = out if isinstance(out, tuple) else (out,)
        grad_of(out).backward()
        res.append([*out, *(t.grad for t in leaves[:n])])
    return _max_diff(res)


def smoke_fused(report: dict, args) -> None:
    """Run each Triton kernel once against the eager function it replaces; on failure run unfused."""
    try:
        from tidal.actor.fused import split_rope_qkv
        from tidal.actor.logprobs import local_log_probs
        from tidal.actor.logsumexp_kernel import fused_log_probs
        from tidal.actor.norm_kernel import rms_norm
        from tidal.actor.rope_kernel import split_rope_qkv_triton
        from tidal.actor.swiglu_kernel import swiglu

        gen = torch.Generator(device=DEV).manual_seed(0)
        diffs = {}
        for dt in (torch.float32, torch.bfloat16):  # the q/k/v split + RoPE (fp32: exact up to fma)
            diffs[f"split_rope_{dt}"] = _against_eager(
                [lambda m, b, c, s, fn=fn: fn(m, b, c, s, 6) for fn in (split_rope_qkv, split_rope_qkv_triton)],
                [
                    torch.randn(*shape, device=DEV, generator=gen).to(dt)
                    for shape in ((3000, 2, 1024), (2048,), (3000, 1, 128), (3000, 1, 128))
                ],
                lambda out: sum((o.float() * (i + 1)).sum() for i, o in enumerate(out)),
                differentiable=2,  # the projection and its bias; cos/sin are tables
            )
        x = torch.randn(256, 151936, device=DEV, generator=gen).mul(4).to(torch.bfloat16)
        t = torch.randint(0, 151936, (256,), device=DEV, generator=gen)
        w_lp, w_ent = torch.randn(256, device=DEV, generator=gen), torch.randn(256, device=DEV, generator=gen)
        diffs["log_probs_entropy_and_grads_bf16"] = _against_eager(
            [lambda a, fn=fn: fn(a, t, with_entropy=True) for fn in (local_log_probs, fused_log_probs)],
            [x],
            lambda out: (out[0] * w_lp).sum() + (out[1] * w_ent).sum(),
        )
        with torch.no_grad():
            diffs["log_probs_no_grad_bf16"] = float((fused_log_probs(x, t)[0] - local_log_probs(x, t)[0]).abs().max())
        y = torch.randn(4096, 2 * 8960, device=DEV, generator=gen).to(torch.bfloat16)
        g = torch.randn(4096, 8960, device=DEV, generator=gen).to(torch.bfloat16)

        def eager_swiglu(a):
            a1, a2 = torch.chunk(a, 2, -1)
            return torch.nn.functional.silu(a1) * a2

        diffs["swiglu_bf16"] = _against_eager([eager_swiglu, swiglu], [y], lambda out: (out[0] * g).sum())
        h = torch.randn(8192, 1536, device=DEV, generator=gen).to(torch.bfloat16)
        w = (1 + torch.randn(1536, device=DEV, generator=gen) / 4).to(torch.bfloat16)
        gh = torch.randn(8192, 1536, device=DEV, generator=gen).to(torch.bfloat16)
        diffs["rms_norm_bf16"] = _against_eager(
            [lambda a, b: torch.nn.functional.rms_norm(a, (1536,), b, 1e-6), lambda a, b: rms_norm(a, b, 1e-6)],
            [h, w],
            lambda out: (out[0].float() * gh.float()).sum(),
        )
        report["triton_vs_eager_max_abs_diff"] = diffs
        log(f"Triton kernels vs eager (max abs diff of outputs and gradients): {diffs}")
    except Exception as e:
        report.setdefault("errors", []).append(f"Triton smoke test failed, running unfused: {e!r}"[:500])
        report["fused_kernels"] = False  # summary() flags every tidal figure of this run as unfused
        args.no_fused = True


def time_optimizer_steps(actor) -> list[float]:
    """Wrap ``actor.optimizer.step`` to record its wall time (the offloaded update runs on the CPU)."""
    step_times: list[float] = []
    optimizer_step = actor.optimizer.step

    def timed_optimizer_step(*a, **kw):
        sync()
        start = time.perf_counter()
        out = optimizer_step(*a, **kw)
        sync()
        step_times.append(time.perf_counter() - start)
        return out

    actor.optimizer.step = timed_optimizer_step
    return step_times


def actor_section(report: dict, args, ckpt: Path, work: dict, flops: dict) -> None:  # noqa: C901
    from tidal.actor import Actor, attention
    from tidal.actor.bridge import enable_layer_recompute
    from tidal.batching import pack_micro_batches, plan_micro_batches, unpack

    lengths, tokens, masks = work["lengths"], work["tokens"], work["loss_masks"]
    if CUDA and not args.no_fused:  # a torch.compile / Triton failure must not cost the run: fall back to eager
        smoke_fused(report, args)
    cfg = actor_config(args, ckpt)
    report["cudnn_min_segment"] = cfg.cudnn_attention_min_tokens
    if cfg.optimizer_cpu_offload:
        offload_check(report)
    t0 = time.perf_counter()
    actor = Actor(cfg)
    report["actor_build_s"] = time.perf_counter() - t0
    keys = ("params_dtype", "fp32_main_params", "bf16", "fused_kernels", "recompute_lm_head", "log_probs_chunk_size")
    report["actor_config"] = {k: getattr(cfg, k) for k in (*keys, "optimizer_cpu_offload")}
    step_times = time_optimizer_steps(actor)
    real = int(lengths.sum())
    resident = allocated_gib()
    report["actor_resident_gib_after_build"] = resident

    # Log-prob pass over the whole batch, micro-batches of --max-tokens-logprob.
    plan = plan_micro_batches(lengths, dp_size=1, max_tokens_per_gpu=args.max_tokens_logprob, pad_to_multiple_of=128)
    mbs = pack_micro_batches(plan, 0, tokens, loss_masks=masks, pad_to_multiple_of=128)
    outs: list = []

    def logprob_pass():
        outs.clear()
        outs.extend(actor.compute_log_probs(mb) for mb in mbs)

    def measure_logprob(tag: str) -> None:
        reset_peak()
        before = allocated_gib()
        t, times = timed_median(logprob_pass, args.steps)
        est = logprob_transient_estimate(args.model_cfg, max(mb.num_tokens for mb in mbs), args.chunk, actor._fused)
        report[tag] = {
            "max_tokens": args.max_tokens_logprob,
            "micro_batches": len(mbs),
            "tokens_per_s": real / t,
            "mfu": flops["fwd"] / t / PEAK_FLOPS,
            "peak_gib": peak_gib(),
            "resident_gib": before,
            "transient_gib": peak_gib() - before,
            "transient_estimate_gib": est / 2**30,
            "times_s": times,
        }
        log(f"{tag}: {report[tag]}")
        DUMP()

    measure_logprob("tidal_logprob")
    old = [None] * len(tokens)
    for mb, lp in zip(mbs, outs, strict=True):
        for i, v in zip(mb.sample_indices.tolist(), unpack(lp, mb), strict=True):
            old[i] = v
    work["old_log_probs"] = old
    fields = {
        "old_log_probs": old,
        "advantages": [torch.full((len(t),), float(a)) for t, a in zip(tokens, work["advantages"], strict=True)],
    }

    def train_mbs(max_tokens: int):
        plan = plan_micro_batches(lengths, dp_size=1, max_tokens_per_gpu=max_tokens, pad_to_multiple_of=128)
        return pack_micro_batches(plan, 0, tokens, loss_masks=masks, token_fields=fields, pad_to_multiple_of=128)

    def train(max_tokens: int, tag: str) -> bool:
        mbs = train_mbs(max_tokens)
        reset_peak()
        try:
            t, times = timed_median(lambda: actor.train_step(mbs), args.steps)
        except torch.OutOfMemoryError as e:
            report[tag] = {"max_tokens": max_tokens, "error": f"OOM: {str(e)[:200]}", "peak_gib": peak_gib()}
            actor._zero_grad()
            log(f"{tag}: OOM")
            return False
        report[tag] = {
            "max_tokens": max_tokens,
            "micro_batches": len(mbs),
            "padded_tokens": sum(mb.num_tokens for mb in mbs),
            "tokens_per_s": real / t,
            "mfu": flops["train"] / t / PEAK_FLOPS,
            "peak_gib": peak_gib(),
            "times_s": times,
            "optimizer_step_s": statistics.median(step_times[-len(times) :]) if step_times else None,
        }
        log(f"{tag}: {report[tag]}")
        DUMP()
        return True

    fits = [m for m in args.max_tokens_train if train(m, f"tidal_train_{m}")]
    if args.ab_lm_head and fits:  # the largest fitting size again with the other LM-head setting
        actor._recompute_lm_head = not actor._recompute_lm_head
        try:
            train(max(fits), f"tidal_train_{max(fits)}_recompute_lm_head_{actor._recompute_lm_head}")
        finally:
            actor._recompute_lm_head = not actor._recompute_lm_head
    if args.ab_wgrad_fusion and fits and actor._fused:  # the fusion is on with fused kernels (CUDA)
        wgrad_fusion_ab(
            report, actor, train_mbs(max(fits)), lambda: train(max(fits), f"tidal_train_{max(fits)}_no_wgrad_fusion")
        )
    for threshold in args.ab_cudnn if fits else []:  # the same passes with other segments on cuDNN's kernel
        first = [lp.clone() for lp in outs]
        attention.set_cudnn_min_segment(actor.model, threshold)
        tag = f"cudnn_min_segment_{threshold}"
        try:
            measure_logprob(f"tidal_logprob_{tag}")
            report[f"logprob_max_abs_diff_{tag}"] = max(
                float((a - b).abs().max()) for a, b in zip(first, outs, strict=True)
            )
            train(max(fits), f"tidal_train_{max(fits)}_{tag}")
        finally:
            attention.set_cudnn_min_segment(actor.model, cfg.cudnn_attention_min_tokens)
    if CUDA:  # whether the long segments really went to cuDNN (False: every figure above is FlashAttention-2's)
        report["cudnn_attention_usable"] = attention.cudnn_attention_usable(torch.cuda.current_device())
    if args.ab_fused and actor._fused:  # the same passes with SwiGLU, RoPE and the log-softmax unfused (eager)
        from tidal.actor import fused

        first = [lp.clone() for lp in outs]
        actor._fused = False
        actor.model.config.bias_activation_fusion = False
        fused.set_fused_kernels(actor.model, False)
        try:
            measure_logprob("tidal_logprob_unfused")
            report["fused_vs_unfused_logprob_max_abs_diff"] = max(
                float((a - b).abs().max()) for a, b in zip(first, outs, strict=True)
            )
            train(args.max_tokens_train[0], f"tidal_train_{args.max_tokens_train[0]}_unfused")
        finally:
            actor._fused = True
            actor.model.config.bias_activation_fusion = True
            fused.set_fused_kernels(actor.model, True)
    if args.sync_debug and CUDA:  # where the host waits for the GPU inside a step (it cannot run ahead there)
        biggest = train_mbs(max(fits or args.max_tokens_train[:1]))
        report["sync_sites_train"] = sync_sites(lambda: actor.train_step(biggest))
        # a site hit once per micro-batch (or more) makes the GPU drain and idle inside the step
        sites = report["sync_sites_train"]
        report["sync_sites_per_micro_batch"] = {k: n for k, n in sites.items() if n >= len(biggest) > 1}
        report["sync_sites_logprob"] = sync_sites(logprob_pass)
        log(f"sync sites: {json.dumps({k: report[k] for k in ('sync_sites_train', 'sync_sites_logprob')}, indent=1)}")
    if args.profile and CUDA:
        biggest = train_mbs(max(fits or args.max_tokens_train[:1]))
        profile(report, args, lambda: actor.train_step(biggest), "train")
        profile(report, args, logprob_pass, "logprob")
    if args.max_tokens_recompute:
        enable_layer_recompute(actor.model, args.recompute_num_layers)
        layers = f"_{args.recompute_num_layers}_layers" if args.recompute_num_layers else ""
        for max_tokens in args.max_tokens_recompute:
            train(max_tokens, f"tidal_train_recompute{layers}_{max_tokens}")
    export_section(report, args, actor)


def wgrad_fusion_ab(report: dict, actor, mbs, time_without) -> None:
    """The same step with megatron's gradient-accumulation fusion on and off: gradients agree, time without it."""
    from tidal.actor.compat import WgradAccum

    x, g = (torch.randn(8192, n, device=DEV, dtype=torch.bfloat16) for n in (1536, 4096))
    main_grad = torch.randn(4096, 1536, device=DEV)
    want = main_grad + g.float().t() @ x.float()
    WgradAccum.wgrad_gemm_accum_fp32(x, g, main_grad)
    report["wgrad_accum_max_rel_diff"] = float((main_grad - want).abs().max() / want.abs().max())
    linears = [m for m in actor.model.modules() if hasattr(m, "gradient_accumulation_fusion")]
    norms = {}
    for on in (True, False):
        for m in linears:
            m.gradient_accumulation_fusion = on
        norms[on] = actor.train_step(mbs)["train/grad_norm"]
    report["wgrad_fusion_grad_norm_on_off"] = [norms[True], norms[False]]
    log(f"wgrad fusion: accum rel diff {report['wgrad_accum_max_rel_diff']:.2e}, grad norm on/off {norms}")
    try:
        time_without()
    finally:
        for m in linears:
            m.gradient_accumulation_fusion = True


def export_section(report: dict, args, actor) -> None:
    """Weight export: the checkpoint API (CPU, fp32) and the weight-sync buckets (bf16, on the device)."""

    def export_api():
        return sum(tensor.numel() for _, tensor in actor.named_hf_tensors())

    def export_buckets(reuse: bool):
        buckets = actor.hf_tensor_buckets(bucket_bytes=args.bucket_mb * 2**20, reuse_buffers=reuse)
        return sum(b.flat.numel() for b in buckets)

    numel = export_buckets(False)
    t_api, _ = timed_median(export_api, args.steps)
    src_bytes = next(actor.model.parameters()).element_size()
    moved = numel * (src_bytes + 2)  # read the parameter, write bf16
    report["tidal_export"] = {
        "hf_elements": numel,
        "bucket_mb": args.bucket_mb,
        "named_hf_tensors_cpu_fp32_s": t_api,
    }
    # the copy ceiling again, right before the timed exports: the clock state drifts over a run
    copy = copy_tb_s() if CUDA else math.nan
    report["tidal_export"]["d2d_copy_tb_s_at_export"] = copy
    for reuse in (False, True):
        t, times = timed_median(lambda reuse=reuse: export_buckets(reuse), max(args.steps, 10))
        tag = "reused" if reuse else "fresh"
        report["tidal_export"] |= {
            f"buckets_{tag}_s": t,
            f"buckets_{tag}_times_s": times,
            f"buckets_{tag}_tb_s_read_plus_write": moved / t / 1e12,
            f"buckets_{tag}_fraction_of_copy_ceiling": moved / t / 1e12 / report.get("ceiling_d2d_copy_tb_s", math.nan),
            f"buckets_{tag}_fraction_of_copy_at_export": moved / t / 1e12 / copy,
        }
    log(f"tidal export: {report['tidal_export']}")


def profile(report: dict, args, fn, tag: str) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        t0 = time.perf_counter()
        fn()
        sync()
        wall = time.perf_counter() - t0
    cuda = torch.autograd.DeviceType.CUDA
    kernels = sum(e.self_device_time_total for e in prof.key_averages() if e.device_type == cuda) / 1e6
    report[f"profile_{tag}"] = {"wall_s": wall, "kernel_s": kernels, **gpu_idle(prof)}
    log(f"profile {tag}: {kernels:.3f} s of kernels in {wall:.3f} s (under the profiler): {report[f'profile_{tag}']}")
    table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=40, max_name_column_width=60)
    shapes = prof.key_averages(group_by_input_shape=True).table(
        sort_by="self_cuda_time_total", row_limit=40, max_name_column_width=40, max_shapes_column_width=90
    )
    Path(args.out, f"profile_{tag}.txt").write_text(table + "\n\nby input shape (aten ops):\n" + shapes)
    print(f"--- profile {tag} (top by CUDA time) ---\n" + "\n".join(table.splitlines()[:22]), flush=True)


def gpu_idle(prof, min_gap_us: float = 50.0, top: int = 12) -> dict:
    """Where the GPU waited: idle time between the first and last kernel, the longest gaps and the host calls
    (CPU ops and CUDA runtime calls) that started inside each, and the time the host spent in synchronizing calls."""
    cuda = torch.autograd.DeviceType.CUDA
    events = prof.events()
    kernels = sorted((e.time_range.start, e.time_range.end) for e in events if e.device_type == cuda)
    if not kernels:
        return {}
    busy, gaps, (cur_start, cur_end) = 0.0, [], kernels[0]
    for start, end in kernels[1:]:
        if start > cur_end:
            busy += cur_end - cur_start
            if start - cur_end >= min_gap_us:
                gaps.append((start - cur_end, cur_end, start))
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    busy += cur_end - cur_start
    span = cur_end - kernels[0][0]
    host = [e for e in events if e.device_type != cuda]
    longest = []
    for gap, start, end in sorted(gaps, reverse=True)[:top]:
        inside: dict[str, int] = {}
        for e in host:
            if start <= e.time_range.start < end:
                inside[e.name] = inside.get(e.name, 0) + 1
        names = sorted(inside, key=inside.get, reverse=True)[:6]
        longest.append({"gap_us": round(gap), "host_calls": {n: inside[n] for n in names}})
    sync = {}
    for e in host:
        if "Synchronize" in e.name or e.name.startswith("cudaMemcpy") or e.name == "cudaHostAlloc":
            count, total = sync.get(e.name, (0, 0.0))
            sync[e.name] = (count + 1, total + e.time_range.elapsed_us())
    return {
        "kernel_span_s": span / 1e6,
        "gpu_idle_s": (span - busy) / 1e6,
        "gaps_over_50us": len(gaps),
        "idle_in_gaps_over_50us_s": sum(g for g, _, _ in gaps) / 1e6,
        "longest_gaps": longest,
        "host_sync_calls": {k: {"calls": c, "ms": round(t / 1e3, 2)} for k, (c, t) in sync.items()},
    }


def sync_sites(fn, depth: int = 8) -> dict[str, int]:
    """The call stacks at which ``fn`` synchronizes the host with the GPU (``torch.cuda.set_sync_debug_mode``)."""
    import traceback
    import warnings

    sites: dict[str, int] = {}
    original = warnings.showwarning

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" not in str(message).lower():
            return original(message, category, filename, lineno, file, line)
        frames = [f for f in traceback.extract_stack()[:-1] if "warnings" not in f.filename]
        key = " <- ".join(f"{Path(f.filename).name}:{f.lineno}:{f.name}" for f in reversed(frames[-depth:]))
        sites[key] = sites.get(key, 0) + 1

    with warnings.catch_warnings():  # restores showwarning and the filters on exit
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
            sync()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return dict(sorted(sites.items(), key=lambda kv: -kv[1]))


# ----------------------------------------------------------------------------------------------- Hugging Face


def varlen_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """HF attention function for packed rows: ``[1, h, T, d]`` q/k/v, segments from ``cu_seq_lens_q``."""
    from tidal.actor.attention import packed_causal_attention

    out = packed_causal_attention(
        query[0].transpose(0, 1),
        key[0].transpose(0, 1),
        value[0].transpose(0, 1),
        kwargs["cu_seq_lens_q"],
        int(kwargs["max_length_q"]),
        scale=scaling,
    )
    return out.unsqueeze(0), None


def hf_row_log_probs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """log p(ids[t+1] | ...) per row position of one row, fp32, one row's logits at a time (TRL's selective way)."""
    lp = torch.log_softmax(logits[:-1].float(), dim=-1).gather(-1, ids[1:, None]).squeeze(-1)
    return torch.cat([lp.new_zeros(1), lp])


def hf_section(report: dict, args, ckpt: Path, work: dict, flops: dict) -> None:  # noqa: C901
    from tidal.batching import pack_micro_batches, plan_micro_batches
    from transformers import AttentionInterface, AutoModelForCausalLM
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    AttentionInterface.register("tidal_varlen", varlen_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register("tidal_varlen", lambda *a, **k: None)
    lengths, tokens, masks = work["lengths"], work["tokens"], work["loss_masks"]
    old, adv = work["old_log_probs"], work["advantages"]
    real = int(lengths.sum())
    num_loss_tokens = float(sum(float(m.sum()) for m in masks))
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32, attn_implementation="sdpa").to(DEV)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, betas=(0.9, 0.98), eps=1e-8, weight_decay=0.0)
    autocast = torch.autocast(DEV.type, dtype=torch.bfloat16, enabled=CUDA)

    def padded(idx):
        n = max(int(lengths[i]) for i in idx)
        ids = torch.zeros(len(idx), n, dtype=torch.long)
        att = torch.zeros(len(idx), n, dtype=torch.long)
        for r, i in enumerate(idx):
            ids[r, : lengths[i]] = tokens[i]
            att[r, : lengths[i]] = 1
        return ids.to(DEV), att.to(DEV)

    groups = lambda mbs: [list(range(s, min(s + mbs, len(tokens)))) for s in range(0, len(tokens), mbs)]  # noqa: E731

    def padded_step(mbs):
        model.train()
        for idx in groups(mbs):
            ids, att = padded(idx)
            with autocast:
                logits = model(input_ids=ids, attention_mask=att).logits
            loss = 0.0
            for r, i in enumerate(idx):
                k = int(lengths[i])
                lp = hf_row_log_probs(logits[r, :k], ids[r, :k])
                loss = loss + ppo_loss(lp, old[i].to(DEV), float(adv[i]), masks[i].to(DEV), num_loss_tokens)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    @torch.no_grad()
    def padded_logprobs(mbs):
        model.eval()
        for idx in groups(mbs):
            ids, att = padded(idx)
            with autocast:
                logits = model(input_ids=ids, attention_mask=att).logits
            for r, i in enumerate(idx):
                hf_row_log_probs(logits[r, : lengths[i]], ids[r, : lengths[i]]).cpu()

    def packed_rows(max_tokens):
        fields = {
            "old_log_probs": old,
            "advantages": [torch.full((len(t),), float(a)) for t, a in zip(tokens, adv, strict=True)],
        }
        plan = plan_micro_batches(lengths, dp_size=1, max_tokens_per_gpu=max_tokens)
        return pack_micro_batches(plan, 0, tokens, loss_masks=masks, token_fields=fields)

    def packed_forward(mb):
        cu = mb.cu_seqlens.to(DEV)
        with autocast:
            logits = model(
                input_ids=mb.tokens[None].to(DEV),
                position_ids=mb.position_ids[None].to(DEV),
                cu_seq_lens_q=cu,
                cu_seq_lens_k=cu,
                max_length_q=mb.max_seqlen,
                max_length_k=mb.max_seqlen,
            ).logits[0]
        ids = mb.tokens.to(DEV)
        lp = torch.log_softmax(logits[:-1].float(), -1).gather(-1, ids[1:, None]).squeeze(-1)
        starts = torch.zeros(len(ids), dtype=torch.bool, device=DEV)
        starts[cu[:-1].long()] = True
        return torch.where(starts, 0.0, torch.cat([lp.new_zeros(1), lp]))

    def packed_step(rows):
        model.train()
        for mb in rows:
            lp = packed_forward(mb)
            f = {k: v.to(DEV) for k, v in mb.token_fields.items()}
            ppo_loss(lp, f["old_log_probs"], f["advantages"], mb.loss_mask.to(DEV), num_loss_tokens).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    @torch.no_grad()
    def packed_logprobs(rows):
        model.eval()
        for mb in rows:
            packed_forward(mb).cpu()

    def measure(tag, fn, flop):
        reset_peak()
        try:
            t, times = timed_median(fn, args.steps)
        except torch.OutOfMemoryError as e:
            opt.zero_grad(set_to_none=True)
            report[tag] = {"error": f"OOM: {str(e)[:200]}", "peak_gib": peak_gib()}
            log(f"{tag}: OOM")
            return
        report[tag] = {"tokens_per_s": real / t, "mfu": flop / t / PEAK_FLOPS, "peak_gib": peak_gib(), "times_s": times}
        log(f"{tag}: {report[tag]}")

    model.config._attn_implementation = "tidal_varlen"
    rows_lp = packed_rows(args.max_tokens_logprob)
    # Before any HF update: the packed HF path must give the actor's log-probs (same weights, bf16). A check.
    with torch.no_grad():
        model.eval()
        mb = rows_lp[0]
        lp = packed_forward(mb).cpu()
        ref = torch.cat([old[i] for i in mb.sample_indices.tolist()])
        report["hf_packed_vs_tidal_logprob_max_abs_diff"] = float((lp[: ref.numel()] - ref).abs().max())
        report["hf_packed_vs_tidal_logprob_mean_abs_diff"] = float((lp[: ref.numel()] - ref).abs().mean())
        log(f"hf packed vs tidal log-probs: {report['hf_packed_vs_tidal_logprob_max_abs_diff']}")
    model.config._attn_implementation = "sdpa"
    for mbs in [] if args.no_hf_padded else args.hf_train_mbs:
        measure(f"hf_padded_train_mbs{mbs}", lambda mbs=mbs: padded_step(mbs), flops["train"])
    if not args.no_hf_padded:
        fn = lambda: padded_logprobs(args.hf_logprob_mbs)  # noqa: E731
        measure(f"hf_padded_logprob_mbs{args.hf_logprob_mbs}", fn, flops["fwd"])
    model.config._attn_implementation = "tidal_varlen"
    rows = packed_rows(args.hf_packed_train_tokens)
    measure(f"hf_packed_train_{args.hf_packed_train_tokens}", lambda: packed_step(rows), flops["train"])
    measure(f"hf_packed_logprob_{args.max_tokens_logprob}", lambda: packed_logprobs(rows_lp), flops["fwd"])


# ----------------------------------------------------------------------------------------------- main


def save_checkpoint(cfg_kwargs: dict, out: Path) -> tuple[int, int, int]:
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    classes = {
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
        "qwen3": (Qwen3Config, Qwen3ForCausalLM),
        "llama": (LlamaConfig, LlamaForCausalLM),
        "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM),
    }
    kwargs = dict(cfg_kwargs)
    config_cls, model_cls = classes[kwargs.pop("model_type", "qwen2")]
    torch.manual_seed(0)
    cfg = config_cls(**kwargs)
    with torch.device(DEV):
        model = model_cls(cfg).to(torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.02)
            if "norm" in name:
                p.add_(1.0)
    model.save_pretrained(out)
    n_matmul = sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2)  # linears + (tied) LM head
    del model
    gc.collect()
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    d_attn = cfg.num_attention_heads * head_dim
    return n_matmul, cfg.num_hidden_layers, d_attn


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--tiny", action="store_true", help="tiny model and lengths, for debugging on CPU")
    p.add_argument("--model", choices=list(MODELS), default="1.5b", help="shape of the random model (1.5b, 7b: Qwen2)")
    p.add_argument("--mix", choices=["rl", "long"], default="rl", help="length mix: rl (lognormal_mix) or long")
    p.add_argument("--no-hf-padded", action="store_true", help="skip the padded HF contenders (packed HF only)")
    p.add_argument("--optimizer-cpu-offload", action="store_true", help="AdamW moments in host memory")
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--chunk", type=int, default=4096, help="--log-probs-chunk-size of the actor")
    p.add_argument("--max-tokens-logprob", type=int, default=32768, help="train's --log-probs-max-tokens-per-gpu")
    p.add_argument("--max-tokens-train", type=int, nargs="*", default=[16384, 32768])
    p.add_argument("--max-tokens-recompute", type=int, nargs="*", default=[])
    p.add_argument("--recompute-num-layers", type=int, default=0, help="with --max-tokens-recompute: first N (0: all)")
    p.add_argument("--precision", choices=["bf16-main", "autocast"], default="bf16-main")
    p.add_argument("--no-fused", action="store_true", help="fused_kernels=False (no Triton kernels)")
    p.add_argument("--ab-fused", action="store_true", help="also time the actor with fused kernels off")
    p.add_argument("--keep-lm-head", action="store_true", help="recompute_lm_head=False (keep the chunks' logits)")
    p.add_argument("--ab-lm-head", action="store_true", help="also time training with the other LM-head setting")
    p.add_argument("--ab-wgrad-fusion", action="store_true", help="also time training with wgrad fusion off")
    p.add_argument(
        "--cudnn-min-segment",
        type=int,
        default=None,
        help="--cudnn-attention-min-tokens of the actor (0: FA2 only; default: tidal's)",
    )
    p.add_argument(
        "--ab-cudnn",
        type=int,
        nargs="*",
        default=[],
        help="also time log-probs and training at these thresholds (0: FA2)",
    )
    p.add_argument("--bucket-mb", type=int, default=512, help="weight-export bucket size")
    p.add_argument("--hf-train-mbs", type=int, nargs="*", default=[2])
    p.add_argument("--hf-logprob-mbs", type=int, default=8)
    p.add_argument("--hf-packed-train-tokens", type=int, default=16384)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--sync-debug", action="store_true", help="record where a step synchronizes host and GPU")
    p.add_argument("--skip", nargs="*", default=[], help="sections to skip: ceilings actor hf")
    args = p.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    report: dict = {"torch": torch.__version__, "argv": sys.argv, "date_utc": time.strftime("%Y-%m-%d %H:%M")}
    if CUDA:
        report["device"] = torch.cuda.get_device_name()
    import transformers

    report["transformers"] = transformers.__version__
    global DUMP
    DUMP = dump = lambda: Path(args.out, "actor_bench.json").write_text(json.dumps(report, indent=2))

    from tidal.actor import init_distributed

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    init_distributed(rank=0, world_size=1, master_addr="127.0.0.1", master_port=port)
    cfg = TINY if args.tiny else (MODELS[args.model] or {"1.5b": QWEN2_1_5B, "7b": QWEN2_7B}[args.model])
    args.model_cfg = cfg
    work = make_workload(args.samples, args.seed, cfg["vocab_size"], 0.05 if args.tiny else 1.0, args.mix)
    lengths = work["lengths"]
    report["workload"] = {
        "samples": int(lengths.size),
        "real_tokens": int(lengths.sum()),
        "longest": int(lengths.max()),
        "mean": float(lengths.mean()),
    }
    log(f"workload {report['workload']}")
    sections = [("ceilings", lambda: ceilings(report))]
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp, "model")
        n_matmul, layers, d_attn = save_checkpoint(cfg, ckpt)
        flops = {
            "fwd": model_flops(lengths, n_matmul, layers, d_attn, train=False),
            "train": model_flops(lengths, n_matmul, layers, d_attn, train=True),
        }
        report["model"] = {"n_matmul_params": n_matmul, "layers": layers, "d_attn": d_attn, **flops}
        sections += [
            ("actor", lambda: actor_section(report, args, ckpt, work, flops)),
            ("hf", lambda: hf_section(report, args, ckpt, work, flops)),
        ]
        for name, fn in sections:
            if name in args.skip:
                continue
            try:
                fn()
            except Exception as e:  # keep going: the report says what failed
                import traceback

                traceback.print_exc()
                report.setdefault("errors", []).append(f"{name}: {e!r}"[:500])
            reset_peak()
            dump()
    summary(report)


def summary(report: dict) -> None:
    rows = []
    for key, val in report.items():
        if isinstance(val, dict) and ("tokens_per_s" in val or "error" in val):
            tps = val.get("tokens_per_s")
            rows.append(
                f"| {key} | {tps / 1e3:.1f}k | {val.get('mfu', float('nan')) * 100:.1f}% | {val['peak_gib']:.1f} |"
                if tps
                else f"| {key} | {val['error'][:40]} | | {val.get('peak_gib', float('nan')):.1f} |"
            )
    if report.get("cudnn_attention_usable") is False:
        print("WARNING: cuDNN attention was unusable (see the log): long segments ran on FlashAttention-2")
    if report.get("sync_sites_per_micro_batch"):
        sites = report["sync_sites_per_micro_batch"]
        print("WARNING: the host waits for the GPU once per micro-batch or more at:", *sites, sep="\n  ")
    if report.get("fused_kernels") is False:
        print("WARNING: the Triton smoke test failed (see errors): tidal's figures below ran WITHOUT fused kernels")
    print("| what | tokens/s | MFU | peak GiB |\n| --- | --- | --- | --- |\n" + "\n".join(rows))
    for key in (
        "tidal_export",
        "ceiling_matmul_bf16_tflops",
        "ceiling_d2d_copy_tb_s",
        "hf_packed_vs_tidal_logprob_max_abs_diff",
        "hf_packed_vs_tidal_logprob_mean_abs_diff",
        "errors",
    ):
        if key in report:
            print(key, report[key])


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
