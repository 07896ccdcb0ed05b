"""Step time and peak memory against token budget and layer recompute: the data behind ``--max-tokens-per-gpu auto``.

For each model shape (random bf16 weights, bf16 parameters with fp32 main copies) one fixed RL-shaped batch (issue
24's long mix: responses log-normal around 2k tokens, one of 12k; prompts 50-500) is trained as one optimizer step
under every token budget (``--max-tokens-per-gpu``) and recompute setting (none, half the layers, all): the median
step time of two steps after a warm-up, the tokens per second, the number of micro-batches and the peak of
``max_memory_allocated`` against ``tidal.actor.memory_plan``'s estimate for the same options. The log-prob pass is
timed the same way under its own budgets. Rows the plan says do not fit are skipped (an out-of-memory would leave
the card unusable for the next rows); a row that still runs out of memory is recorded with the allocated memory
before and after it.

``--oom`` instead runs the out-of-memory check in a fresh process: a training step and a log-prob pass too large on
purpose, the allocated memory before and after each, what still holds the largest tensors, and whether a step that
fits runs afterwards in the same process.

Run on the device machine (megatron-core carried in ``.carry/site``, see bench/memory_plan_gpu.py):
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
    PYTHONPATH=.carry/site:packages/actor/src:packages/batching/src:packages/ckpt/src \
        python3 bench/auto_plan_gpu.py --out $OUT --shapes dense-8b-4l moe-30b-a3b-4l lora-8b-8l
Debug on CPU with a tiny model: uv run python bench/auto_plan_gpu.py --tiny --out /tmp/ap
"""

from __future__ import annotations

import argparse
import gc
import json
import socket
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from bench_actor_gpu import CUDA, TINY, log, make_workload, reset_peak, save_checkpoint, timed_median
from lora_gpu import WIDTH_8B
from memory_plan_gpu import TINY_MOE, undo_recompute
from moe_gpu import QWEN3_30B_A3B

LLAMA_8B = WIDTH_8B  # Llama-3.1-8B's width (bench/lora_gpu.py), layers set per shape
SHAPES = {  # name: (HF config, LoRA rank)
    "dense-8b-4l": (LLAMA_8B | dict(num_hidden_layers=4), 0),
    "moe-30b-a3b-4l": (QWEN3_30B_A3B | dict(model_type="qwen3_moe", num_hidden_layers=4), 0),
    "lora-8b-8l": (LLAMA_8B | dict(num_hidden_layers=8), 16),
    "tiny": (TINY, 0),
    "tiny-moe": (TINY_MOE, 0),
    "tiny-lora": (TINY, 4),
}
GIB = 2**30
REPORT: dict = {}


def dump(args) -> None:
    Path(args.out, "auto_plan.json").write_text(json.dumps(REPORT, indent=1))


def allocated() -> float:
    return torch.cuda.memory_allocated() / GIB if CUDA else 0.0


def build(name: str, args, tmp: str):
    from tidal.actor import Actor, ActorConfig
    from tidal.actor.memory_plan import ModelShape
    from tidal.ckpt import read_hf_config_json

    cfg, rank = SHAPES[name]
    ckpt = Path(tmp, name)
    save_checkpoint(cfg, ckpt)
    shape = ModelShape.from_hf_config(read_hf_config_json(ckpt))
    precision = dict(params_dtype="bfloat16", fp32_main_params=True) if CUDA else {}
    lora = dict(lora_rank=rank, lora_alpha=2.0 * rank) if rank else {}
    acfg = ActorConfig(hf_checkpoint=str(ckpt), lr=1e-7, log_probs_chunk_size=args.chunk, **precision, **lora)
    return cfg, shape, acfg, Actor(acfg)


def packed(work: dict, budget: int, *, train: bool):
    from tidal.batching import pack_micro_batches, plan_micro_batches

    plan = plan_micro_batches(work["lengths"], dp_size=1, max_tokens_per_gpu=budget, pad_to_multiple_of=128)
    fields = None
    if train:
        fields = {
            "old_log_probs": [torch.full((len(t),), -2.0) for t in work["tokens"]],
            "advantages": [
                torch.full((len(t),), float(a)) for t, a in zip(work["tokens"], work["advantages"], strict=True)
            ],
        }
    return pack_micro_batches(
        plan, 0, work["tokens"], loss_masks=work["loss_masks"], token_fields=fields, pad_to_multiple_of=128
    )


def measure(row: dict, fn, steps: int, tokens: int) -> None:
    """Time ``fn`` (median of ``steps`` after a warm-up) and its peak into ``row``; an out-of-memory is recorded."""
    from tidal.actor.errors import ActorOutOfMemoryError

    reset_peak()
    try:
        _, times = timed_median(fn, steps)
    except ActorOutOfMemoryError as e:
        row["oom"] = str(e)
        return
    row["seconds"] = statistics.median(times)
    row["times"] = times
    row["tokens_per_s"] = tokens / row["seconds"]
    row["measured_gib"] = torch.cuda.max_memory_allocated() / GIB if CUDA else 0.0
    if CUDA:
        row["plan_over_measured"] = row["plan_gib"] / row["measured_gib"]


def sweep(name: str, args) -> None:
    from tidal.actor.bridge import enable_layer_recompute
    from tidal.actor.memory_plan import MemoryInputs, largest_fitting_tokens, plan_memory

    out = REPORT.setdefault(name, {"rows": []})
    with tempfile.TemporaryDirectory() as tmp:
        cfg, shape, acfg, actor = build(name, args, tmp)
        work = make_workload(args.samples, 7, cfg["vocab_size"], args.scale, mix="long")
        lengths = np.asarray(work["lengths"])
        out |= {
            "params": shape.num_params(),
            "layers": shape.num_layers,
            "tokens": int(lengths.sum()),
            "longest": int(lengths.max()),
            "samples": len(lengths),
        }
        gpu = torch.cuda.get_device_properties(0).total_memory if CUDA else None
        log(f"{name}: {json.dumps({k: v for k, v in out.items() if k != 'rows'})}")
        longest = int(-(-lengths.max() // 128) * 128)
        budgets = sorted({max(longest, b) for b in args.budgets})
        settings = {"all": 0, "half": max(1, shape.num_layers // 2), "off": None}
        resident = None
        for label in args.recompute:
            layers = settings[label]
            undo_recompute(actor)
            if layers is not None:
                enable_layer_recompute(actor.model, layers)
            rec_cfg = acfg if layers is None else replace(acfg, recompute_activations=True, recompute_num_layers=layers)
            grid = budgets
            if gpu:  # and the largest budget the plan says fits: the one --max-tokens-per-gpu auto would take
                probe = MemoryInputs.from_actor_config(
                    rec_cfg, train_tokens=budgets[0], logprob_tokens=budgets[0], longest_sequence=int(lengths.max())
                )
                largest = largest_fitting_tokens(shape, probe, gpu_bytes=gpu)
                grid = sorted({*budgets, largest} - {0})
            for budget in grid:
                inputs = MemoryInputs.from_actor_config(
                    rec_cfg, train_tokens=budget, logprob_tokens=budget, longest_sequence=int(lengths.max())
                )
                plan = plan_memory(shape, inputs, gpu_bytes=gpu)
                row = {"pass": "train", "budget": budget, "recompute": label, "plan_gib": plan.train_peak / GIB}
                if plan.fits() is False:
                    row["skipped"] = "plan over the card"
                    out["rows"].append(row)
                    log(f"{name}: {json.dumps(row)}")
                    continue
                mbs = packed(work, budget, train=True)
                row["micro_batches"] = len(mbs)
                row["max_micro_batch_tokens"] = max(mb.num_tokens for mb in mbs)
                row["allocated_before_gib"] = allocated()
                measure(row, lambda mbs=mbs: actor.train_step(mbs), args.steps, out["tokens"])
                del mbs
                gc.collect()
                row["allocated_after_gib"] = allocated()
                if resident is None and "oom" not in row:
                    resident = row["allocated_after_gib"]
                out["rows"].append(row)
                log(f"{name}: {json.dumps({k: v for k, v in row.items() if k != 'times'})}")
                dump(args)
                if "oom" in row and row["allocated_after_gib"] > row["allocated_before_gib"] + 0.5:
                    out["stopped"] = "an out-of-memory left memory held; the later rows would not be comparable"
                    log(f"{name}: {out['stopped']}")
                    return
        undo_recompute(actor)
        for budget in args.logprob_budgets:
            budget = max(budget, longest)
            inputs = MemoryInputs.from_actor_config(
                acfg, train_tokens=budgets[0], logprob_tokens=budget, longest_sequence=int(lengths.max())
            )
            plan = plan_memory(shape, inputs, gpu_bytes=gpu)
            row = {"pass": "logprob", "budget": budget, "recompute": "off", "plan_gib": plan.logprob_peak / GIB}
            mbs = packed(work, budget, train=False)
            row["micro_batches"] = len(mbs)
            measure(row, lambda mbs=mbs: [actor.compute_log_probs(mb) for mb in mbs], args.steps, out["tokens"])
            out["rows"].append(row)
            log(f"{name}: {json.dumps(row)}")
            dump(args)
        actor = None  # the next shape gets the card
        gc.collect()
        if CUDA:
            torch.cuda.empty_cache()


def holders(obj, depth: int = 4, skip: set | None = None) -> list[str]:
    """Chains of what refers to ``obj`` (types; dict keys and owners; function names), this module's frames left out."""
    skip = skip if skip is not None else set()
    skip.add(id(sys._getframe()))
    chains: list[str] = []

    def describe(r, child) -> str:
        if isinstance(r, dict):
            keys = [k for k, v in r.items() if v is child][:2]
            return f"dict[{keys}]"
        if type(r).__name__ == "frame":
            return f"frame {r.f_code.co_qualname} ({r.f_code.co_filename.rsplit('/', 1)[-1]}:{r.f_lineno})"
        if type(r).__name__ == "cell":
            return "cell"
        if callable(r) and hasattr(r, "__qualname__"):
            return f"{type(r).__name__} {r.__qualname__}"
        return type(r).__name__

    def walk(o, path: list[str], level: int) -> None:
        refs = [
            r
            for r in gc.get_referrers(o)
            if id(r) not in skip and not (type(r).__name__ == "frame" and r.f_code.co_filename == __file__)
        ]
        if not refs or level == depth:
            chains.append(" <- ".join(path) or "(nothing)")
            return
        for r in refs[:3]:
            skip.add(id(refs))
            walk(r, [*path, describe(r, o)], level + 1)

    walk(obj, [], 0)
    return chains[:8]


def live_storages() -> set[int]:
    """The storage pointers of the CUDA tensors Python holds now."""
    return set(_live_tensors())


def _live_tensors() -> dict[int, torch.Tensor]:
    found = {}
    for o in gc.get_objects():
        try:
            if torch.is_tensor(o) and o.is_cuda and not isinstance(o, torch.nn.Parameter):
                found[o.untyped_storage().data_ptr()] = o
        except Exception:
            continue
    return found


def largest_live(top: int = 4, *, new_since: set[int] | None = None) -> list[dict]:
    """The ``top`` largest CUDA tensors alive (only those not in ``new_since``), with what holds each."""
    found = {ptr: t for ptr, t in _live_tensors().items() if not new_since or ptr not in new_since}
    big = sorted(found.values(), key=lambda t: -t.untyped_storage().nbytes())[:top]
    skip = {id(found), id(big)}
    out = [
        {"gib": t.untyped_storage().nbytes() / GIB, "shape": list(t.shape), "held_by": holders(t, skip=skip)}
        for t in big
    ]
    found.clear()
    big.clear()
    return out


def warmed_actor(args, tmp: str):
    """``args.oom_shape``'s actor after one step (AdamW's state exists), its config and the workload's micro-batches."""
    cfg, _, _, actor = build(args.oom_shape, args, tmp)
    work = make_workload(args.samples, 7, cfg["vocab_size"], args.scale, mix="long")
    longest = int(-(-max(work["lengths"]) // 128) * 128)
    mbs = packed(work, max(args.oom_ok_tokens, longest), train=True)
    actor.train_step(mbs[:1])
    gc.collect()
    return cfg, actor, mbs


def oom_check(args) -> None:
    """A real out-of-memory in training and in the log-prob pass: is the memory given back?"""
    from tidal.actor.errors import ActorOutOfMemoryError

    name = args.oom_shape
    out = REPORT.setdefault(f"oom-{name}", {})
    with tempfile.TemporaryDirectory() as tmp:
        cfg, actor, mbs = warmed_actor(args, tmp)
        small = mbs[:1]
        out["resident_gib"] = allocated()
        for what, tokens in (("train", args.oom_tokens), ("logprob", args.oom_logprob_tokens)):
            from tidal.batching import pack

            gen = torch.Generator().manual_seed(3)
            seqs = [torch.randint(0, cfg["vocab_size"], (tokens // 4,), generator=gen) for _ in range(4)]
            fields = {"old_log_probs": [torch.full((len(s),), -2.0) for s in seqs]} if what == "train" else {}
            if fields:
                fields["advantages"] = [torch.ones(len(s)) for s in seqs]
            mb = pack(seqs, token_fields=fields or None)
            before = allocated()
            row: dict = {"tokens": tokens, "allocated_before_gib": before}
            try:
                actor.train_step([mb]) if what == "train" else actor.compute_log_probs(mb)
                row["error"] = None
            except ActorOutOfMemoryError as e:
                row["error"] = str(e)
            del mb, seqs, fields
            gc.collect()
            row["allocated_after_gib"] = allocated()
            if row["allocated_after_gib"] > before + 0.05:
                row["largest_live"] = largest_live()
            try:
                actor.train_step(small)
                row["step_after_ok"] = True
            except ActorOutOfMemoryError as e:
                row["step_after_ok"] = False
                row["step_after_error"] = str(e)
            out[what] = row
            log(f"oom {what}: {json.dumps(row)[:4000]}")
            dump(args)


def recompute_leak(args) -> None:
    """What a training step with layer recompute leaves allocated after it, with torch's early stop and without."""
    from tidal.actor.bridge import enable_layer_recompute
    from torch.utils.checkpoint import checkpoint

    name = args.oom_shape
    out = REPORT.setdefault(f"recompute-leak-{name}", {})
    with tempfile.TemporaryDirectory() as tmp:
        _, actor, mbs = warmed_actor(args, tmp)
        out["resident_gib"] = resident = allocated()
        out["micro_batch_tokens"] = [mb.num_tokens for mb in mbs]

        def torch_early_stop(model) -> None:  # torch.utils.checkpoint's default, which tidal no longer uses
            for layer in model.decoder.layers:
                forward = layer.forward

                def checkpointed(*a, _forward=forward, **kw):
                    if not torch.is_grad_enabled():
                        return _forward(*a, **kw)
                    return checkpoint(_forward, *a, use_reentrant=False, early_stop=True, **kw)

                layer.forward = checkpointed

        variants = {
            "off": None,
            "torch default (early stop)": torch_early_stop,
            "tidal (no early stop)": enable_layer_recompute,
        }
        for label, wrap in variants.items():
            undo_recompute(actor)
            if wrap is not None:
                wrap(actor.model)
            reset_peak()
            gc.collect()
            before = live_storages()
            _, times = timed_median(lambda: actor.train_step(mbs), args.steps)
            gc.collect()
            row = {
                "seconds": statistics.median(times),
                "peak_gib": torch.cuda.max_memory_allocated() / GIB if CUDA else 0,
            }
            row["held_after_gib"] = allocated() - resident
            if row["held_after_gib"] > 0.1:
                row["largest_live"] = largest_live(6, new_since=before)
            out[label] = row
            log(f"recompute leak {label}: {json.dumps(row)[:3000]}")
            dump(args)
        undo_recompute(actor)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--shapes", nargs="*", default=["dense-8b-4l", "moe-30b-a3b-4l", "lora-8b-8l"])
    p.add_argument("--budgets", type=int, nargs="*", default=[12288, 16384, 24576, 32768, 49152, 65536])
    p.add_argument("--logprob-budgets", type=int, nargs="*", default=[16384, 32768, 65536, 131072])
    p.add_argument("--recompute", nargs="*", default=["all", "half", "off"], choices=["all", "half", "off"])
    p.add_argument("--samples", type=int, default=48)
    p.add_argument("--scale", type=float, default=1.0, help="sample lengths times this")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--chunk", type=int, default=4096)
    p.add_argument("--oom", action="store_true", help="run the out-of-memory check instead of the sweep")
    p.add_argument("--leak", action="store_true", help="run the recompute check instead of the sweep")
    p.add_argument("--oom-shape", default="dense-8b-4l")
    p.add_argument("--oom-tokens", type=int, default=262144)
    p.add_argument("--oom-logprob-tokens", type=int, default=1048576)
    p.add_argument("--oom-ok-tokens", type=int, default=16384)
    args = p.parse_args()
    if args.tiny:
        args.shapes, args.scale, args.samples = ["tiny", "tiny-moe", "tiny-lora"], 0.05, 12
        args.budgets, args.logprob_budgets = [512, 1024], [1024]
        args.oom_shape, args.oom_tokens, args.oom_logprob_tokens, args.oom_ok_tokens = "tiny", 1024, 1024, 512
    Path(args.out).mkdir(parents=True, exist_ok=True)
    import megatron.core
    from tidal.actor import init_distributed

    REPORT.update(torch=torch.__version__, megatron_core=megatron.core.__version__, argv=sys.argv)
    REPORT["date_utc"] = time.strftime("%Y-%m-%d %H:%M", time.gmtime())
    if CUDA:
        REPORT["device"] = torch.cuda.get_device_name()
        REPORT["gpu_gib"] = torch.cuda.get_device_properties(0).total_memory / GIB
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    init_distributed(rank=0, world_size=1, master_addr="127.0.0.1", master_port=port)
    if args.leak:
        recompute_leak(args)
        return
    if args.oom:
        oom_check(args)
        return
    for name in args.shapes:
        try:
            sweep(name, args)
        except Exception as e:  # keep going: the report says what failed
            import traceback

            traceback.print_exc()
            REPORT.setdefault("errors", []).append(f"{name}: {e!r}"[:500])
        dump(args)


if __name__ == "__main__":
    main()
