"""LoRA against full fine-tuning on one GPU: peak memory, step time, the largest model each fits, export seconds.

An 8B-width Llama-shaped model (hidden 4096, ffn 14336, 32 query / 8 KV heads, head_dim 128, vocab 128256, untied)
with ``--layers`` decoder layers, random bf16 weights; the actor as a run builds it on a GPU: bf16 parameters with
fp32 main copies (``--fp32-main-params``), fused kernels, layer recompute with ``--recompute`` (default on). Each
training step is two packed micro-batches of ``--tokens`` tokens (segments of 1/2, 1/4, 1/8 and 1/8 of it, as
bench/memory_plan_gpu.py packs them). Modes: full fine-tuning, LoRA rank 16 and rank 64 on all linear layers.

Per mode at ``--layers``: peak ``max_memory_allocated`` of a step (after a warm-up step, so AdamW's state exists),
the median step seconds, trainable parameters, the merged HF export's seconds (every weight as bf16 buckets, what
weight sync sends; with LoRA W + scale * B @ A), and with LoRA the adapters' own export (full tensors to host
memory) in bytes (bf16) and seconds. Then per mode the largest layer count whose step fits: doubling from
``--layers``, then bisection, each probe a fresh actor, until ``--search-seconds`` (shared by the modes) run out.

The weights are not read from a file: the actor's HF loader is replaced by a random fill on the device (what is
measured is the training and export, not a disk read; a 30-layer checkpoint would take minutes to write).

Run on the device machine (megatron-core carried in ``.carry/site``, see bench/memory_plan_gpu.py):
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
    PYTHONPATH=.carry/site:packages/actor/src:packages/batching/src:packages/ckpt/src \
        python3 bench/lora_gpu.py --out $OUT
CPU check with a tiny model: uv run python bench/lora_gpu.py --tiny --out /tmp/lora_bench
"""

from __future__ import annotations

import argparse
import gc
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from bench_actor_gpu import CUDA, TINY, log, reset_peak, sync
from memory_plan_gpu import micro_batches

WIDTH_8B = dict(
    model_type="llama",
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=131072,
    rope_theta=5e5,
    tie_word_embeddings=False,
)
MODES = {"full": 0, "lora-r16": 16, "lora-r64": 64}
GIB = 2**30


def write_config(shape: dict, layers: int, out: Path) -> Path:
    """An HF model folder holding config.json alone (the weights are filled on the device: ``random_weights``)."""
    from transformers import LlamaConfig

    kwargs = {k: v for k, v in shape.items() if k not in ("model_type", "num_hidden_layers")}
    LlamaConfig(**kwargs, num_hidden_layers=layers).save_pretrained(out)
    return out


@torch.no_grad()
def random_weights(model, *_args, **_kwargs) -> None:
    """In place of ``load_hf_weights``: N(0, 0.02) matrices, norms at 1, on the parameters' device."""
    for p in model.parameters():
        p.normal_(0.0, 0.02) if p.dim() > 1 else p.fill_(1.0)


def build(shape: dict, layers: int, rank: int, args, tmp: Path):
    import tidal.actor.actor as actor_module
    from tidal.actor import Actor, ActorConfig

    actor_module.load_hf_weights = random_weights
    folder = write_config(shape, layers, tmp / f"l{layers}")
    precision = dict(params_dtype="bfloat16", fp32_main_params=True) if CUDA else {}
    cfg = ActorConfig(
        hf_checkpoint=str(folder), lr=1e-6, log_probs_chunk_size=args.chunk, recompute_activations=args.recompute,
        lora_rank=rank, lora_alpha=2.0 * max(rank, 1), **precision,
    )  # fmt: skip
    return Actor(cfg)


def free() -> None:
    gc.collect()
    if CUDA:
        torch.cuda.empty_cache()


def step_fits(shape: dict, layers: int, rank: int, args, tmp: Path) -> bool:
    """Whether an actor of ``layers`` layers builds and takes a training step (out-of-memory: False)."""
    from tidal.actor.errors import ActorOutOfMemoryError

    actor = None
    free()
    try:
        actor = build(shape, layers, rank, args, tmp)
        actor.train_step(micro_batches(args.tokens, 2, shape["vocab_size"], 1, fields=True))
        sync()
        return True
    except (ActorOutOfMemoryError, torch.OutOfMemoryError):
        return False
    finally:
        del actor
        free()


def probe_in_child(layers: int, rank: int, args) -> bool:
    """``step_fits`` in a fresh Python process (the same arguments), its answer read from its last output line."""
    argv = [sys.executable, __file__, "--out", args.out, "--tokens", str(args.tokens), "--chunk", str(args.chunk)]
    argv += ["--recompute" if args.recompute else "--no-recompute", "--probe", str(layers), str(rank)]
    argv += ["--tiny"] if args.tiny else []
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    answer = [line for line in done.stdout.splitlines() if line.startswith("PROBE ")]
    if not answer:
        raise RuntimeError(f"probe {layers} layers rank {rank} died ({done.returncode}): {done.stderr[-2000:]}")
    return json.loads(answer[-1].removeprefix("PROBE "))["fits"]


def largest(rank: int, args, deadline: float, known: int) -> dict:
    """The largest layer count that fits (doubling from ``known``, which fits, then bisection) before ``deadline``.

    Each probe runs in a process of its own: after an out-of-memory error part of the failed step's memory stays
    held for a while, which made the next probe in the same process fail early.
    """
    lo, hi, probes = known, None, []
    while time.monotonic() < deadline and (hi is None or hi - lo > 1) and lo < args.max_layers:
        probe = min(lo * 2, args.max_layers) if hi is None else (lo + hi) // 2
        t0 = time.monotonic()
        fits = probe_in_child(probe, rank, args)
        probes.append({"layers": probe, "fits": fits, "seconds": round(time.monotonic() - t0, 1)})
        log(f"  rank {rank}: {probe} layers {'fit' if fits else 'do not fit'}")
        lo, hi = (probe, hi) if fits else (lo, probe)
    done = (hi is not None and hi - lo <= 1) or lo >= args.max_layers
    return {"largest_fitting": lo, "smallest_failing": hi, "exact": done, "probes": probes}


def measure(shape: dict, rank: int, args, tmp: Path) -> dict:
    """Peak memory and step time at ``--layers``, trainable parameters, export seconds (and adapter bytes)."""
    actor = build(shape, args.layers, rank, args, tmp)
    mbs = micro_batches(args.tokens, 2, shape["vocab_size"], 1, fields=True)
    row: dict = {"layers": args.layers, "lora_rank": rank}
    row["trainable_params"] = sum(p.numel() for p in actor.params)
    row["frozen_params"] = sum(p.numel() for p in actor.model.parameters() if not p.requires_grad)
    actor.train_step(mbs)  # warm-up: AdamW's state and the main copies exist from here on
    reset_peak()
    row["resident_gib"] = torch.cuda.memory_allocated() / GIB if CUDA else None
    times = []
    for _ in range(args.steps):
        sync()
        t0 = time.perf_counter()
        actor.train_step(mbs)
        sync()
        times.append(time.perf_counter() - t0)
    row["peak_gib"] = torch.cuda.max_memory_allocated() / GIB if CUDA else None
    row["step_s"] = statistics.median(times)
    row["step_times_s"] = times

    def export(model) -> int:
        total = 0
        for bucket in model.hf_tensor_buckets(dtype=torch.bfloat16):
            total += bucket.flat.numel() * bucket.flat.element_size()
        sync()
        return total

    export(actor)  # warm-up (bucket plans, kernels)
    t0 = time.perf_counter()
    row["export_bytes"] = export(actor)
    row["export_s"] = time.perf_counter() - t0
    if actor.lora is not None:
        t0 = time.perf_counter()
        tensors = actor.lora.adapter_tensors()
        row["adapter_export_s"] = time.perf_counter() - t0
        row["adapter_bytes_bf16"] = sum(t.numel() * 2 for t in tensors.values())
    del actor, mbs
    free()
    return row


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--tiny", action="store_true", help="a tiny model on CPU (checks the script, measures nothing)")
    p.add_argument("--layers", type=int, default=8, help="decoder layers of the fixed comparison")
    p.add_argument("--tokens", type=int, default=32768, help="tokens of each of the step's two micro-batches")
    p.add_argument("--steps", type=int, default=2, help="timed steps after the warm-up")
    p.add_argument("--chunk", type=int, default=4096)
    p.add_argument("--recompute", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--modes", nargs="*", default=list(MODES), choices=list(MODES))
    p.add_argument("--search-seconds", type=float, default=200.0, help="for the largest-fitting search, all modes")
    p.add_argument("--max-layers", type=int, default=160)
    p.add_argument("--probe", type=int, nargs=2, metavar=("LAYERS", "RANK"), help=argparse.SUPPRESS)  # a child
    args = p.parse_args()
    shape = WIDTH_8B
    if args.tiny:
        shape = {**TINY, "model_type": "llama", "head_dim": 16, "tie_word_embeddings": False}
        args.layers, args.tokens, args.max_layers, args.search_seconds = 2, 256, 4, 60.0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report: dict = {"argv": sys.argv, "torch": torch.__version__, "date_utc": time.strftime("%Y-%m-%d %H:%M")}
    report |= {"shape": shape, "tokens_per_micro_batch": args.tokens, "micro_batches": 2, "recompute": args.recompute}
    if CUDA:
        report["device"] = torch.cuda.get_device_name()
        report["gpu_gib"] = torch.cuda.get_device_properties(0).total_memory / GIB

    def dump() -> None:
        (out / "lora_gpu.json").write_text(json.dumps(report, indent=1))

    from tidal.actor import init_distributed

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    init_distributed(rank=0, world_size=1, master_addr="127.0.0.1", master_port=port)
    if args.probe:
        with tempfile.TemporaryDirectory() as tmp:
            print("PROBE " + json.dumps({"fits": step_fits(shape, *args.probe, args, Path(tmp))}), flush=True)
        return
    with tempfile.TemporaryDirectory() as tmp:
        for mode in args.modes:
            log(f"{mode}: {args.layers} layers, 2 x {args.tokens} tokens")
            try:
                report[mode] = measure(shape, MODES[mode], args, Path(tmp))
            except (torch.OutOfMemoryError, Exception) as e:  # keep going: the report says what failed
                report[mode] = {"error": f"{e!r}"[:400]}
                free()
            log(f"{mode}: {json.dumps(report[mode])}")
            dump()
        deadline = time.monotonic() + args.search_seconds
        modes = [m for m in args.modes if "error" not in report[m]]
        for i, mode in enumerate(modes):  # each mode gets an equal share of what is left
            share = (deadline - time.monotonic()) / (len(modes) - i)
            log(f"{mode}: searching the largest layer count ({share:.0f} s)")
            report[mode]["search"] = largest(MODES[mode], args, time.monotonic() + share, args.layers)
            dump()
    print("| mode | trainable params | peak GiB | step s | export s | adapter MB / s | largest layers |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for mode in args.modes:
        r = report[mode]
        if "error" in r:
            print(f"| {mode} | error: {r['error'][:80]} |")
            continue
        peak = f"{r['peak_gib']:.1f}" if r["peak_gib"] is not None else "-"
        adapter = (
            f"{r['adapter_bytes_bf16'] / 1e6:.1f} / {r['adapter_export_s']:.2f}" if "adapter_bytes_bf16" in r else "-"
        )
        search = r.get("search", {})
        fits = f"{search.get('largest_fitting')}{'' if search.get('exact') else '+'}"
        print(f"| {mode} | {r['trainable_params']:,} | {peak} | {r['step_s']:.2f} | {r['export_s']:.2f} | {adapter} "
              f"| {fits} |")  # fmt: skip
    dump()


if __name__ == "__main__":
    main()
