"""Multi-GPU actor parity and scaling on one host (issue 9): TP, DP and CP under torchrun, NCCL.

Each launch is one parallel layout on the Qwen2-1.5B-shaped random model and the RL length mix of
``bench_actor_gpu.py``; the first (``--tag ref``, one GPU) writes what the others are compared with into ``--work``:
the model, the old log-probs every layout trains against, the losses and the fp32 weights after ``--steps`` AdamW
steps. A layout then reports, into ``--out/multi_gpu_<tag>.json``: per-step loss and gradient norm against the
reference, the largest weight difference after the steps (bf16 parameters, fp32 main weights: it should stay within
a few learning rates), whether its initial HF export equals the checkpoint it loaded bit for bit (the TP gather),
and tokens/s per GPU of a training step against one GPU (scaling efficiency). On the device (one command per
machine start; NVLink multicast left as the device README says):

    export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \\
        PYTHONPATH=.carry/site:packages/actor/src:packages/batching/src:packages/ckpt/src
    R="python3 -m torch.distributed.run --standalone --nproc-per-node"
    $R 1 bench/bench_multi_gpu.py --out $OUT --tag ref && $R 2 bench/bench_multi_gpu.py --out $OUT --tag tp2 --tp 2 \\
        && $R 2 bench/bench_multi_gpu.py --out $OUT --tag dp2
    # 4 GPUs: ... --tag tp2dp2 --tp 2 (4 processes); long sequences: --long 8 on ref and on --tag cp2 --cp 2
Debug on CPU (gloo): the same with ``uv run python -m torch.distributed.run ... --tiny --work /tmp/mgpu``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from bench_actor_gpu import CUDA, PEAK_FLOPS, QWEN2_1_5B, TINY, make_workload, model_flops, save_checkpoint


def log(msg: str) -> None:
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def workload(args, cfg: dict) -> dict:
    if args.long:  # --long N: N sequences of 32k tokens (CP's case), half prompt
        n, length = args.long, 64 if args.tiny else 32768
        gen = torch.Generator().manual_seed(args.seed)
        tokens = [torch.randint(0, cfg["vocab_size"], (length,), generator=gen) for _ in range(n)]
        masks = [torch.cat([torch.zeros(length // 2), torch.ones(length - length // 2)]) for _ in range(n)]
        return {"lengths": np.full(n, length), "tokens": tokens, "loss_masks": masks, "advantages": torch.randn(n)}
    return make_workload(args.samples, args.seed, cfg["vocab_size"], 0.05 if args.tiny else 1.0)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--work", default="/tmp/tidal_multi_gpu", help="shared by the launches: model and reference")
    p.add_argument("--tag", required=True, help="ref (one process) or a layout's name")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--cp", type=int, default=1)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--long", type=int, default=0, help="N sequences of 32k tokens instead of the RL mix")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--max-tokens-per-gpu", type=int, default=32768)
    args = p.parse_args()

    from tidal.actor import Actor, ActorConfig, init_distributed
    from tidal.batching import pack_micro_batches, plan_micro_batches, unpack

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    init_distributed(
        rank=rank,
        world_size=world,
        master_addr=os.environ["MASTER_ADDR"],
        master_port=int(os.environ["MASTER_PORT"]),
        tensor_model_parallel_size=args.tp,
        context_parallel_size=args.cp,
    )
    from megatron.core import parallel_state

    dp, dp_rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    work, out = Path(args.work), Path(args.out)
    ref_dir = work / ("ref_long" if args.long else "ref")
    cfg = TINY if args.tiny else QWEN2_1_5B
    model_dir = work / "model"
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        if not (model_dir / "config.json").exists():
            save_checkpoint(cfg, model_dir)
    dist.barrier()
    data = workload(args, cfg)
    lengths, tokens, masks = data["lengths"], data["tokens"], data["loss_masks"]
    real = int(sum(int(k) for k in lengths))
    actor = Actor(
        ActorConfig(
            hf_checkpoint=str(model_dir),
            params_dtype="bfloat16",
            fp32_main_params=True,
            recompute_lm_head=False,
            lr=args.lr,
            clip_grad=1.0,
            log_probs_chunk_size=4096,
        )
    )
    report: dict = {"tag": args.tag, "world": world, "tp": args.tp, "cp": args.cp, "dp": dp, "real_tokens": real}
    report["device"] = torch.cuda.get_device_name() if CUDA else "cpu"

    # 1. The initial export equals the HF checkpoint it loaded (the TP gather; exact for bf16 weights).
    from safetensors.torch import load_file

    hf = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        hf.update(load_file(f))
    init_diff = 0.0
    for name, tensor in actor.named_hf_tensors():
        init_diff = max(init_diff, float((tensor.float() - hf[name].float()).abs().max()))
    report["init_export_vs_checkpoint_max_abs_diff"] = init_diff
    n_matmul = sum(t.numel() for n, t in hf.items() if t.dim() == 2)
    del hf
    log(f"{args.tag}: initial export vs checkpoint {init_diff}")

    # 2. Old log-probs: the reference's, so every layout optimises the same objective.
    plan = plan_micro_batches(
        lengths, dp_size=dp, max_tokens_per_gpu=args.max_tokens_per_gpu, context_parallel_size=args.cp,
        pad_to_multiple_of=128,
    )  # fmt: skip
    if args.tag == "ref":
        mbs = pack_micro_batches(plan, 0, tokens, loss_masks=masks, pad_to_multiple_of=128)
        old = [None] * len(tokens)
        for mb in mbs:
            for i, v in zip(mb.sample_indices.tolist(), unpack(actor.compute_log_probs(mb), mb), strict=True):
                old[i] = v
        ref_dir.mkdir(parents=True, exist_ok=True)
        torch.save(old, ref_dir / "old_log_probs.pt")
    dist.barrier()
    old = torch.load(ref_dir / "old_log_probs.pt")
    fields = {
        "old_log_probs": old,
        "advantages": [torch.full((len(t),), float(a)) for t, a in zip(tokens, data["advantages"], strict=True)],
    }
    mbs = pack_micro_batches(plan, dp_rank, tokens, loss_masks=masks, token_fields=fields, pad_to_multiple_of=128)

    # 3. --steps optimizer steps on the same global batch; the first includes warm-up (kernel compilation).
    metrics, times = [], []
    for step in range(args.steps):
        sync()
        t0 = time.perf_counter()
        m = actor.train_step(mbs)
        sync()
        times.append(time.perf_counter() - t0)
        metrics.append({k: m[k] for k in ("train/loss", "train/grad_norm", "train/pg_clipfrac")})
        log(f"{args.tag} step {step}: {metrics[-1]} in {times[-1]:.3f} s")
    t = statistics.median(times[1:]) if len(times) > 1 else times[0]
    flops = model_flops(lengths, n_matmul, cfg["num_hidden_layers"], cfg["hidden_size"], train=True)
    report |= {
        "metrics": metrics,
        "step_times_s": times,
        "step_s": t,
        "tokens_per_s": real / t,
        "tokens_per_s_per_gpu": real / t / world,
        "mfu_per_gpu": flops / t / PEAK_FLOPS / world,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if CUDA else math.nan,
    }

    # 4. Weights after the steps against the reference's.
    trained = dict(actor.named_hf_tensors())
    if args.tag == "ref":
        if rank == 0:
            from safetensors.torch import save_file

            save_file({k: v.contiguous() for k, v in trained.items()}, str(ref_dir / "weights.safetensors"))
            (ref_dir / "report.json").write_text(json.dumps(report))
    else:
        ref = json.loads((ref_dir / "report.json").read_text())
        ref_w = load_file(str(ref_dir / "weights.safetensors"))
        diff = {n: float((trained[n].float() - ref_w[n]).abs().max()) for n in ref_w}
        worst = max(diff, key=diff.get)
        report["vs_ref"] = {
            "loss_rel_diff_per_step": [
                abs(a["train/loss"] - b["train/loss"]) / max(abs(b["train/loss"]), 1e-12)
                for a, b in zip(metrics, ref["metrics"], strict=True)
            ],
            "grad_norm_rel_diff_per_step": [
                abs(a["train/grad_norm"] - b["train/grad_norm"]) / max(b["train/grad_norm"], 1e-12)
                for a, b in zip(metrics, ref["metrics"], strict=True)
            ],
            "weights_max_abs_diff": diff[worst],
            "weights_max_abs_diff_tensor": worst,
            "weights_max_abs_diff_in_lr": diff[worst] / args.lr,
            "scaling_efficiency_per_gpu": report["tokens_per_s_per_gpu"] / ref["tokens_per_s_per_gpu"],
            "ref_tokens_per_s": ref["tokens_per_s"],
        }
    if rank == 0:
        (out / f"multi_gpu_{args.tag}.json").write_text(json.dumps(report, indent=2))
        log(f"{args.tag}: {json.dumps({k: v for k, v in report.items() if k != 'metrics'})}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
