"""The co-located data path on one GPU (issue 19): actor offload/onload, and the tensor weight sync over CUDA IPC.

What it measures, on a Qwen2-1.5B-shaped random model (bf16 parameters, fp32 main copies, AdamW state after one
training step), in one run:

* ``copy``: device-to-device copy bandwidth of this GPU, the yardstick (bytes read + written per second).
* ``offload`` / ``onload``: ``Actor.offload()`` / ``Actor.onload()`` (parameters, gradients, fp32 main copies and
  AdamW state to pinned host memory and back), seconds, GiB moved, GPU memory allocated / reserved before and
  after, and whether every parameter came back bit-identical.
* ``ipc_sync``: tidal's tensor transport as the co-located engine sees it: the actor exports bf16 HF buckets
  (``Actor.hf_tensor_buckets``), each bucket's ``(name, tensor)`` list is pickled with torch's ``ForkingPickler``
  and base64-encoded exactly as ``tidal.rollout.weight_sync`` sends it to SGLang's ``/update_weights_from_tensor``
  (CUDA IPC handles, no weight bytes in the message), and a second process on the same GPU (standing where the
  SGLang scheduler would) decodes it, opens the handles and copies every tensor into its own weights, then acks.
  Per bucket size: seconds per full sync, GB/s delivered, and the fraction of the copy bandwidth (two copies per
  byte: export and the receiver's copy, so 4 bytes moved per bf16 byte delivered ... counted as read + write). The
  receiver's weights are checked against the actor's export.

NCCL between two ranks needs two GPUs (NCCL refuses two ranks on one device); the decoupled path's GPU figure is
not measured here.

Run on a GPU (megatron-core on the path, as for bench_actor_gpu.py):
    PYTHONPATH=$P python3 bench/weight_sync_gpu.py --out $OUT/weight_sync
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import socket
import sys
import tempfile
import time
import traceback
from argparse import Namespace
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

import torch
import torch.multiprocessing as mp  # importing it registers the tensor reductions with ForkingPickler

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_actor_gpu as B  # the model shapes, checkpoint writer and timing helpers


def _serialize(named: list[tuple[str, torch.Tensor]]) -> str:
    buffer = io.BytesIO()
    ForkingPickler(buffer).dump(named)  # what tidal.rollout.weight_sync._serialize (and sglang) does
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def receiver(conn, shapes: dict[str, tuple[tuple[int, ...], str]]) -> None:
    """The engine's side: decode each message, copy the tensors into its own weights, ack with the bytes copied."""
    torch.cuda.set_device(0)
    weights = {n: torch.empty(s, dtype=getattr(torch, d), device="cuda") for n, (s, d) in shapes.items()}
    conn.send("ready")
    while True:
        msg = conn.recv()
        if msg == "checksums":
            conn.send({n: float(w.float().sum()) for n, w in weights.items()})
            continue
        if msg is None:
            break
        named = ForkingPickler.loads(base64.b64decode(msg))
        copied = 0
        for name, tensor in named:
            weights[name].copy_(tensor)
            copied += tensor.numel() * tensor.element_size()
        del named, tensor
        torch.cuda.synchronize()
        conn.send(copied)


def build_actor(report: dict, ckpt: Path):
    from tidal.actor import Actor
    from tidal.batching import pack_micro_batches, plan_micro_batches

    args = Namespace(precision="bf16-main", chunk=4096, no_fused=False, keep_lm_head=True, optimizer_cpu_offload=False)
    actor = Actor(B.actor_config(args, ckpt))
    work = B.make_workload(8, 0, B.QWEN2_1_5B["vocab_size"], 1.0, "rl")
    tokens, masks = work["tokens"], work["loss_masks"]
    fields = {
        "old_log_probs": [torch.zeros(len(t)) for t in tokens],
        "advantages": [torch.full((len(t),), float(a)) for t, a in zip(tokens, work["advantages"], strict=True)],
    }
    plan = plan_micro_batches(work["lengths"], dp_size=1, max_tokens_per_gpu=16384, pad_to_multiple_of=128)
    mbs = pack_micro_batches(plan, 0, tokens, loss_masks=masks, token_fields=fields, pad_to_multiple_of=128)
    actor.train_step(mbs)  # gradients and AdamW state exist, as in a run
    torch.cuda.synchronize()
    report["actor_allocated_gib_after_step"] = torch.cuda.memory_allocated() / 2**30
    return actor


def offload_section(report: dict, actor, repeats: int, prepin: bool = False) -> None:
    before = {n: p.detach().clone().cpu() for n, p in list(actor.model.named_parameters())[:4]}
    if prepin:  # what a run does while its engines start: the first round below then finds the memory pinned
        actor.reserve_offload_memory()
        actor._pinned.wait()
        report["prepin"] = {"gib": actor._pinned.bytes / 2**30, "seconds": actor._pinned.seconds}
        B.log(f"pinned in the background: {report['prepin']}")
    rounds = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        alloc0, res0 = torch.cuda.memory_allocated() / 2**30, torch.cuda.memory_reserved() / 2**30
        off = actor.offload()
        alloc1, res1 = torch.cuda.memory_allocated() / 2**30, torch.cuda.memory_reserved() / 2**30
        on = actor.onload()
        torch.cuda.synchronize()
        rounds.append(
            {
                **off,
                **on,
                "allocated_gib_before": alloc0,
                "reserved_gib_before": res0,
                "allocated_gib_offloaded": alloc1,
                "reserved_gib_offloaded": res1,
                "allocated_gib_after_onload": torch.cuda.memory_allocated() / 2**30,
                "offload_gb_s": off["actor/offload_gb"] * 2**30 / 1e9 / off["actor/offload_s"],
                "onload_gb_s": on["actor/onload_gb"] * 2**30 / 1e9 / on["actor/onload_s"],
            }
        )
        B.log(f"offload round: {rounds[-1]}")
    after = dict(list(actor.model.named_parameters())[:4])
    report["offload"] = {
        "rounds": rounds,
        "params_identical_after_round_trips": all(torch.equal(before[n], after[n].detach().cpu()) for n in before),
    }


def ipc_section(report: dict, actor, bucket_mbs: list[int], repeats: int) -> None:
    shapes = {}
    for bucket in actor.hf_tensor_buckets(bucket_bytes=512 * 2**20):
        for name, t in bucket:
            shapes[name] = (tuple(t.shape), str(t.dtype).removeprefix("torch."))
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=receiver, args=(child, shapes), daemon=True)
    proc.start()
    if not parent.poll(300):
        raise RuntimeError("receiver did not start")
    assert parent.recv() == "ready"
    report["ipc_sync"] = {"tensors": len(shapes)}
    try:
        for mb in bucket_mbs:
            times, delivered, msg_bytes = [], 0, 0
            for _ in range(repeats + 1):  # the first sync opens the IPC handles: reported apart
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                delivered = msg_bytes = 0
                for bucket in actor.hf_tensor_buckets(bucket_bytes=mb * 2**20):
                    msg = _serialize(list(bucket))
                    msg_bytes += len(msg)
                    parent.send(msg)
                    if not parent.poll(120):
                        raise RuntimeError("receiver did not ack a bucket in 120 s")
                    delivered += parent.recv()
                times.append(time.perf_counter() - t0)
            t = sorted(times[1:])[len(times[1:]) // 2]
            copy = B.copy_tb_s()
            report["ipc_sync"][f"bucket_{mb}mb"] = {
                "first_sync_s": times[0],
                "sync_s": t,
                "times_s": times[1:],
                "delivered_gb": delivered / 1e9,
                "message_kb": msg_bytes / 1e3,
                "delivered_gb_s": delivered / t / 1e9,
                "moved_tb_s_read_plus_write": 4 * delivered / t / 1e12,  # export copy + receiver copy, read + write
                "d2d_copy_tb_s_same_run": copy,
                "fraction_of_copy": 4 * delivered / t / 1e12 / copy,
            }
            B.log(f"ipc sync {mb} MB buckets: {report['ipc_sync'][f'bucket_{mb}mb']}")
        parent.send("checksums")
        got = parent.recv()
        want = {n: float(t.float().sum()) for b in actor.hf_tensor_buckets(bucket_bytes=512 * 2**20) for n, t in b}
        close = [abs(got[n] - want[n]) <= 1e-3 * (1 + abs(want[n])) for n in want]
        report["ipc_sync"]["receiver_equals_export"] = all(close)
    finally:
        parent.send(None)
        proc.join(30)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--bucket-mb", type=int, nargs="*", default=[128, 512, 2048])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--prepin", action="store_true", help="reserve_offload_memory() before the offload rounds")
    args = p.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    report: dict = {"torch": torch.__version__, "argv": sys.argv, "date_utc": time.strftime("%Y-%m-%d %H:%M")}
    report["device"] = torch.cuda.get_device_name()
    dump = lambda: Path(args.out, "weight_sync_gpu.json").write_text(json.dumps(report, indent=2))  # noqa: E731
    from tidal.actor import init_distributed

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    init_distributed(rank=0, world_size=1, master_addr="127.0.0.1", master_port=port)
    report["d2d_copy_tb_s"] = B.copy_tb_s()
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp, "model")
        B.save_checkpoint(B.QWEN2_1_5B, ckpt)
        actor = build_actor(report, ckpt)
        for name, fn in (
            ("ipc_sync", lambda: ipc_section(report, actor, args.bucket_mb, args.repeats)),
            ("offload", lambda: offload_section(report, actor, args.repeats, args.prepin)),
        ):
            try:
                fn()
            except Exception as e:  # keep going: the report says what failed
                traceback.print_exc()
                report.setdefault("errors", []).append(f"{name}: {e!r}"[:500])
            dump()
    print(json.dumps(report, indent=1)[:6000])


if __name__ == "__main__":
    main()
