"""Weight sync transports into one real SGLang server: disk vs nccl (gloo on CPU) vs tensor, per model, one run.

For each model (the embedded ~1M-parameter Qwen2, and a Qwen2 of ``--hidden``/``--layers`` built locally with random
weights, ~71M parameters by default) it starts ONE SGLang server (float32, CPU flags without CUDA) and, from this
process standing where the actor's rank 0 would, times ``--repeats`` syncs of the full state dict per transport
(interleaved, median), each ending with the engine reporting the new weight version:

- disk: ``save_file`` of the tensors into a fresh folder (the model's config beside them), then
  ``/update_weights_from_disk`` (what ``--update-weight-transport disk`` does: export + reload);
- nccl: ``update_weights_from_distributed`` over the group made once by ``init_weights_update_group``
  (its rendezvous timed apart); NCCL on GPU, gloo on CPU;
- tensor: ``update_weights_from_tensor`` (CUDA IPC handles on GPU, shared memory on CPU).

The actor's own export (TP gather, bucket packing: ``Actor.hf_tensor_buckets``) is not in these numbers.
Prints a Markdown table (seconds per sync, MB/s).

    uv run python bench/weight_sync.py                   # both models, 3 repeats; a few minutes on two shared cores
    uv run python bench/weight_sync.py --hidden 256 --layers 4 --repeats 2
"""

from __future__ import annotations

import argparse
import logging
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_rollout import build_tiny_qwen2, free_port


def _state(model: Path) -> list[tuple[str, object]]:
    from safetensors.torch import load_file

    tensors = {}
    for shard in sorted(model.glob("*.safetensors")):
        tensors |= load_file(shard)
    return sorted(tensors.items())


def _disk(engine, tensors, model: Path, scratch: Path, version: str) -> None:
    from safetensors.torch import save_file

    out = scratch / f"v{version}"
    out.mkdir()
    for name in ("config.json", "generation_config.json"):
        if (model / name).exists():
            shutil.copy(model / name, out / name)
    save_file(dict(tensors), str(out / "model.safetensors"))
    engine.update_weights_from_disk(out, weight_version=version)
    shutil.rmtree(out)


def bench_model(label: str, model: Path, args, tmp: Path) -> list[dict]:
    from tidal.rollout import SGLangEngine
    from tidal.rollout.weight_sync import (
        destroy_weights_update_group,
        init_weights_update_group,
        update_weights_from_distributed,
        update_weights_from_tensor,
    )

    tensors = _state(model)
    mb = sum(t.numel() * t.element_size() for _, t in tensors) / 2**20
    params = sum(t.numel() for _, t in tensors)
    engine = SGLangEngine(model, port=free_port(), log_dir=tmp / f"logs_{label}", nccl_port=free_port(),
                          extra_server_args=["--dtype", "float32"], startup_timeout_s=args.startup_timeout)  # fmt: skip
    engine.start(wait=True)
    try:
        tick = time.perf_counter()
        group = init_weights_update_group(engine, master_address="127.0.0.1", master_port=free_port(), timeout_s=300)
        rendezvous_s = time.perf_counter() - tick
        scratch = tmp / f"scratch_{label}"
        scratch.mkdir()
        runs = {
            "disk": lambda v: _disk(engine, tensors, model, scratch, v),
            "nccl": lambda v: update_weights_from_distributed(
                engine, group, tensors, bucket_bytes=args.bucket_bytes, weight_version=v, timeout_s=300
            ),
            "tensor": lambda v: update_weights_from_tensor(
                engine, tensors, bucket_bytes=args.bucket_bytes, weight_version=v
            ),
        }
        times: dict[str, list[float]] = {k: [] for k in runs}
        for repeat in range(args.repeats):
            for name, fn in runs.items():
                version = f"{name}{repeat}"
                tick = time.perf_counter()
                fn(version)
                assert engine.get_model_info()["weight_version"] == version
                times[name].append(time.perf_counter() - tick)
        destroy_weights_update_group(engine, group)
    finally:
        engine.shutdown()
    rows = []
    for name, seconds in times.items():
        median = statistics.median(seconds)
        rows.append({"model": label, "params_m": params / 1e6, "mb": mb, "transport": name, "s": median,
                     "mb_per_s": mb / median, "all_s": seconds})  # fmt: skip
    rows[1]["note"] = f"group rendezvous {rendezvous_s:.2f} s, once"
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=768, help="hidden size of the larger model")
    parser.add_argument("--layers", type=int, default=8, help="layers of the larger model")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--bucket-bytes", type=int, default=512 * 2**20)
    parser.add_argument("--startup-timeout", type=float, default=900.0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    from tidal.train.embedded_model import ensure_embedded_model

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        models = [("embedded", ensure_embedded_model())]
        larger = build_tiny_qwen2(tmp / "larger", hidden=args.hidden, layers=args.layers)
        models.append((f"qwen2 h{args.hidden} l{args.layers}", larger))
        for label, model in models:
            rows += bench_model(label, model, args, tmp)
    print("| model | params | MB (fp32) | transport | s / sync (median) | MB/s | runs (s) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        runs = ", ".join(f"{s:.3f}" for s in r["all_s"]) + (f"; {r['note']}" if "note" in r else "")
        print(f"| {r['model']} | {r['params_m']:.1f}M | {r['mb']:.1f} | {r['transport']} | {r['s']:.3f} | "
              f"{r['mb_per_s']:.0f} | {runs} |")  # fmt: skip


if __name__ == "__main__":
    main()
