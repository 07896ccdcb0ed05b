"""--update-weight-delta's export side on one GPU: the actor building delta buckets after real optimizer steps.

An 8B-width Llama-shaped model (bench/lora_gpu.py's ``WIDTH_8B``) with ``--layers`` decoder layers (8 by default:
what fits a training step with bf16 parameters, fp32 main copies and AdamW's state on one H100), random bf16
weights filled on the device. After a first sync (every tensor into the host snapshot, in bf16, as the engines hold
them), each of ``--steps`` rounds takes one training step at ``--lr`` (two packed micro-batches of ``--tokens``
random tokens: real gradients) and then:

- full: the export a sync without deltas sends (every HF tensor as bf16 buckets on the GPU): bytes and seconds;
- delta: the same export, each tensor compared with the snapshot on the GPU and encoded as the sender does
  (``tidal.train.weight_sync.delta._entries``: indices or bitmask + values, the snapshot updated, a checksum per
  tensor): bytes, seconds, and the share of elements whose bf16 value changed.

Nothing is sent: no engine here (the send itself is SGLang's, measured by bench/weight_sync_gpu.py); of
tidal-rollout only the delta format (``engine_delta``: torch alone) is imported.

Run on the device machine (megatron-core carried in ``.carry/site``, see bench/memory_plan_gpu.py):
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
    PYTHONPATH=.carry/site:packages/actor/src:packages/batching/src:packages/ckpt/src:packages/rollout/src:\
apps/train/src python3 bench/delta_sync_gpu.py --out $OUT
CPU check with a tiny model: uv run python bench/delta_sync_gpu.py --tiny --out /tmp/delta_bench
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_actor_gpu import CUDA, TINY, log, sync
from lora_gpu import WIDTH_8B, random_weights, write_config
from memory_plan_gpu import micro_batches


def build(shape: dict, args, tmp: Path):
    """The actor as a run builds it on a GPU (bf16 parameters, fp32 main copies), random weights, ``--lr``."""
    import tidal.actor.actor as actor_module
    from tidal.actor import Actor, ActorConfig

    actor_module.load_hf_weights = random_weights
    folder = write_config(shape, args.layers, tmp / f"l{args.layers}")
    precision = dict(params_dtype="bfloat16", fp32_main_params=True) if CUDA else {}
    cfg = ActorConfig(
        hf_checkpoint=str(folder), lr=args.lr, log_probs_chunk_size=args.chunk, recompute_activations=args.recompute,
        **precision,
    )  # fmt: skip
    return Actor(cfg)


def full_export(actor, bucket_bytes: int) -> tuple[int, float]:
    """Bytes and seconds of every HF tensor as bf16 buckets (a sync without deltas)."""
    sync()
    t0, total = time.perf_counter(), 0
    for bucket in actor.hf_tensor_buckets(dtype=torch.bfloat16, bucket_bytes=bucket_bytes):
        total += bucket.flat.nbytes
    sync()
    return total, time.perf_counter() - t0


def delta_export(actor, snap, bucket_bytes: int, *, full: bool) -> dict:
    """Bytes, seconds and changed share of the delta entries the sender builds against ``snap``."""
    from tidal.train.weight_sync import delta

    def named():
        for bucket in actor.hf_tensor_buckets(dtype=torch.bfloat16, bucket_bytes=bucket_bytes):
            yield from bucket

    counts = {"weight_sync/delta_elements": 0.0, "weight_sync/delta_changed": 0.0}
    sync()
    t0, total, kinds = time.perf_counter(), 0, {"idx": 0, "mask": 0, "whole": 0}
    for name, key, payload, _ in delta._entries(named(), snap, full, counts):
        total += payload.nbytes
        kinds[key.split("|")[1] if key != name else "whole"] += 1
        if full:  # the first sync: what the engines' report makes the sender keep
            snap.store(name, payload.to(snap.dtype))
    sync()
    seconds = time.perf_counter() - t0
    elements = counts["weight_sync/delta_elements"]
    return {"bytes": total, "seconds": seconds, "changed_share": counts["weight_sync/delta_changed"] / elements,
            "elements": elements, "tensors_by_kind": kinds}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--tiny", action="store_true", help="a tiny model on CPU (checks the script, measures nothing)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--tokens", type=int, default=8192, help="tokens of each of the step's two micro-batches")
    p.add_argument("--steps", type=int, default=4, help="optimizer steps, each followed by a full and a delta export")
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--bucket-mb", type=int, default=512, help="--update-weight-buffer-size in MiB")
    p.add_argument("--chunk", type=int, default=4096)
    p.add_argument("--recompute", action=argparse.BooleanOptionalAction, default=True)
    args = p.parse_args()
    shape = WIDTH_8B
    if args.tiny:
        shape = {**TINY, "model_type": "llama", "head_dim": 16, "tie_word_embeddings": False}
        args.layers, args.tokens, args.steps = 2, 256, 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report: dict = {"argv": sys.argv, "torch": torch.__version__, "date_utc": time.strftime("%Y-%m-%d %H:%M")}
    report |= {"shape": shape, "layers": args.layers, "lr": args.lr, "tokens_per_micro_batch": args.tokens}
    if CUDA:
        report["device"] = torch.cuda.get_device_name()

    def dump() -> None:
        (out / "delta_sync_gpu.json").write_text(json.dumps(report, indent=1))

    from tidal.actor import init_distributed
    from tidal.train.weight_sync.delta import DeltaSnapshot

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    init_distributed(rank=0, world_size=1, master_addr="127.0.0.1", master_port=port)
    bucket_bytes = args.bucket_mb * 2**20
    with tempfile.TemporaryDirectory() as tmp:
        actor = build(shape, args, Path(tmp))
        report["params"] = sum(p.numel() for p in actor.model.parameters())
        log(f"{report['params'] / 1e9:.2f} B parameters, {args.layers} layers, lr {args.lr}")
        mbs = micro_batches(args.tokens, 2, shape["vocab_size"], 1, fields=True)
        snap = DeltaSnapshot(pin=CUDA)
        snap.dtype = torch.bfloat16  # the engines' dtype, which their first report gives a run
        t0 = time.perf_counter()
        first = delta_export(actor, snap, bucket_bytes, full=True)
        report["first_sync"] = first | {"snapshot_seconds": time.perf_counter() - t0, "snapshot_gib": snap.mb / 1024}
        log(f"first sync (snapshot {snap.mb / 1024:.2f} GiB, pinned {snap.pin}): {json.dumps(report['first_sync'])}")
        full_export(actor, bucket_bytes)  # warm-up of the plain export
        report["steps"] = []
        for step in range(args.steps):
            t0 = time.perf_counter()
            actor.train_step(mbs)
            sync()
            row = {"step": step, "train_s": time.perf_counter() - t0}
            row["full_bytes"], row["full_s"] = full_export(actor, bucket_bytes)
            row["delta"] = delta_export(actor, snap, bucket_bytes, full=False)
            report["steps"].append(row)
            log(f"step {step}: {json.dumps(row)}")
            dump()
    print("| step | changed share | full MB | full s | delta MB | delta s |")
    for r in report["steps"]:
        d = r["delta"]
        print(f"| {r['step']} | {d['changed_share']:.4f} | {r['full_bytes'] / 2**20:.1f} | {r['full_s']:.3f} | "
              f"{d['bytes'] / 2**20:.1f} | {d['seconds']:.3f} |")  # fmt: skip
    dump()


if __name__ == "__main__":
    main()
