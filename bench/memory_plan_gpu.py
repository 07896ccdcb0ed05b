"""The memory plan against the measured peak: tidal-actor's training and log-prob passes on one GPU.

For each model shape (random bf16 weights, the shapes of bench_actor_gpu.py) and each training budget, with layer
recompute off and on, one training step over two micro-batches of exactly the budget's tokens (long segments:
1/2, 1/4, 1/8 and 1/8 of it, so cuDNN's route is taken) and a log-prob pass; the peak of ``max_memory_allocated``
against ``tidal.actor.memory_plan``'s estimate for the same options. A census of the tensors each layer saves for
backward (``saved_tensors_hooks``) shows where the activations go. Last, a budget set too high on purpose must end
in the actor's one-line out-of-memory error.

Run on the device machine like bench_actor_gpu.py (megatron-core carried in ``.carry/site``):
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
    PYTHONPATH=.carry/site:packages/actor/src:packages/batching/src:packages/ckpt/src \
        python3 bench/memory_plan_gpu.py --out $OUT
Debug on CPU with a tiny model: uv run python bench/memory_plan_gpu.py --tiny --out /tmp/mp
"""

from __future__ import annotations

import argparse
import gc
import json
import socket
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch
from bench_actor_gpu import CUDA, LLAMA_3_2_3B, QWEN2_1_5B, QWEN3_1_7B, TINY, log, reset_peak, save_checkpoint
from moe_gpu import QWEN3_30B_A3B
from moe_gpu import TINY as MOE_TINY

# Qwen3-30B-A3B's shape (128 experts, top-8, expert ffn 768) with 4 of its 48 layers, and a tiny one like it
QWEN3_30B_A3B_4L = QWEN3_30B_A3B | dict(model_type="qwen3_moe", num_hidden_layers=4)
TINY_MOE = MOE_TINY | dict(model_type="qwen3_moe", intermediate_size=128, num_hidden_layers=2)
SHAPES = {
    "qwen2-1.5b": QWEN2_1_5B,
    "qwen3-1.7b": QWEN3_1_7B,
    "llama-3.2-3b": LLAMA_3_2_3B,
    "qwen3-30b-a3b-4l": QWEN3_30B_A3B_4L,
    "tiny": TINY,
    "tiny-moe": TINY_MOE,
}


def micro_batches(tokens: int, count: int, vocab: int, seed: int, *, fields: bool):
    """``count`` packed micro-batches of exactly ``tokens`` tokens each (segments of 1/2, 1/4, 1/8, 1/8)."""
    from tidal.batching import pack_micro_batches, plan_micro_batches

    parts = [tokens // 2, tokens // 4, tokens // 8]
    parts.append(tokens - sum(parts))
    lengths = torch.tensor(parts * count).numpy()
    gen = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, vocab, (int(n),), generator=gen) for n in lengths]
    masks = [torch.ones(int(n), dtype=torch.bool) for n in lengths]
    token_fields = None
    if fields:
        token_fields = {
            "old_log_probs": [torch.full((int(n),), -2.0) for n in lengths],
            "advantages": [torch.randn(int(n), generator=gen).sign() for n in lengths],
        }
    plan = plan_micro_batches(lengths, dp_size=1, max_tokens_per_gpu=tokens, pad_to_multiple_of=128)
    mbs = pack_micro_batches(plan, 0, seqs, loss_masks=masks, token_fields=token_fields, pad_to_multiple_of=128)
    assert all(mb.num_tokens == tokens for mb in mbs), [mb.num_tokens for mb in mbs]
    return mbs


def census(actor, mb) -> dict:
    """Bytes per token each layer saves for backward (unique storages, parameters excluded), by dtype and shape."""
    layers = list(actor.model.decoder.layers)
    params = {p.untyped_storage().data_ptr() for p in actor.model.parameters()}
    current = ["embedding"]
    seen: dict[int, tuple[str, int, str]] = {}

    def pre(i):
        return lambda *_: current.__setitem__(0, f"layer{i}")

    handles = [layer.register_forward_pre_hook(pre(i)) for i, layer in enumerate(layers)]
    handles.append(
        actor.model.decoder.final_layernorm.register_forward_pre_hook(lambda *_: current.__setitem__(0, "head"))
    )

    def pack(t):
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in params and ptr not in seen and t.device.type == DEV_TYPE:
            seen[ptr] = (current[0], storage.nbytes(), f"{t.dtype} {tuple(t.shape)}")
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            actor.train_step([mb])
    finally:
        for h in handles:
            h.remove()
    by_where: dict[str, int] = defaultdict(int)
    for where, nbytes, _ in seen.values():
        by_where[where] += nbytes
    layer1 = sorted((s, n) for w, n, s in seen.values() if w == "layer1")
    tokens = mb.num_tokens
    return {
        "tokens": tokens,
        "per_token_bytes": {k: v / tokens for k, v in sorted(by_where.items())},
        "layer1_saved": layer1,
    }


DEV_TYPE = "cuda" if CUDA else "cpu"


def live_cuda_tensors(top: int = 8) -> list:
    """The largest CUDA tensors Python still reaches (gc), with the types of what refers to them."""
    if not CUDA:
        return []
    found = {}
    for obj in gc.get_objects():
        try:
            if torch.is_tensor(obj) and obj.is_cuda and not isinstance(obj, torch.nn.Parameter):
                found[obj.untyped_storage().data_ptr()] = obj
        except Exception:
            continue
    big = sorted(found.values(), key=lambda t: -t.untyped_storage().nbytes())[:top]
    return [
        (
            t.untyped_storage().nbytes() / 2**30,
            str(t.dtype),
            tuple(t.shape),
            sorted({type(r).__name__ for r in gc.get_referrers(t)})[:6],
        )
        for t in big
    ]


def peak() -> int:
    return torch.cuda.max_memory_allocated() if CUDA else 0


def run_model(name: str, args, report: dict, lora_rank: int = 0) -> None:
    from tidal.actor import Actor, ActorConfig
    from tidal.actor.bridge import enable_layer_recompute
    from tidal.actor.errors import ActorOutOfMemoryError
    from tidal.actor.memory_plan import GIB, MemoryInputs, ModelShape, largest_fitting_tokens, plan_memory
    from tidal.ckpt import read_hf_config_json

    cfg = SHAPES[name]
    out: dict = report.setdefault(f"{name}-lora-r{lora_rank}" if lora_rank else name, {})
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp, "model")
        save_checkpoint(cfg, ckpt)
        shape = ModelShape.from_hf_config(read_hf_config_json(ckpt))
        precision = dict(params_dtype="bfloat16", fp32_main_params=True) if CUDA else {}
        lora = dict(lora_rank=lora_rank, lora_alpha=2.0 * lora_rank) if lora_rank else {}
        acfg = ActorConfig(hf_checkpoint=str(ckpt), lr=1e-7, log_probs_chunk_size=args.chunk, **precision, **lora)
        actor = Actor(acfg)
        gpu = torch.cuda.get_device_properties(0).total_memory if CUDA else None
        out["params"] = shape.num_params()
        small = micro_batches(args.census_tokens, 1, cfg["vocab_size"], 0, fields=True)
        out["census"] = census(actor, small[0])  # also the warm-up step: AdamW's state exists from here on
        reset_peak()
        out["resident_gib"] = torch.cuda.memory_allocated() / GIB if CUDA else 0.0
        log(f"{name}: census {json.dumps(out['census']['per_token_bytes'])}")
        log(f"{name}: layer 1 saves {out['census']['layer1_saved']}")

        def estimate(tokens: int, recompute: int | None, logprob_tokens: int) -> object:
            inputs = MemoryInputs.from_actor_config(
                acfg if recompute is None else _with_recompute(acfg, recompute),
                train_tokens=tokens,
                logprob_tokens=logprob_tokens,
                longest_sequence=tokens // 2,
            )
            return plan_memory(shape, inputs, gpu_bytes=gpu), inputs

        rows = out.setdefault("rows", [])
        for recompute in [None, *args.recompute]:
            undo_recompute(actor)
            if recompute is not None:
                enable_layer_recompute(actor.model, recompute)
            for tokens in args.tokens:
                plan, inputs = estimate(tokens, recompute, tokens)
                row = {
                    "pass": "train",
                    "tokens": tokens,
                    "recompute_layers": recompute,
                    "estimate_gib": plan.train_peak / GIB,
                    "plan_fits": plan.fits(),
                    "rows_gib": {k: v / GIB for k, v in plan.rows},
                }
                if plan.fits() is False:  # an out-of-memory here would leave the card unusable for the next rows
                    row["skipped"] = "the plan says it does not fit"
                    rows.append(row)
                    log(f"{name}: {json.dumps({k: v for k, v in row.items() if k != 'rows_gib'})}")
                    continue
                mbs = micro_batches(tokens, 2, cfg["vocab_size"], 1, fields=True)
                reset_peak()
                t0 = time.perf_counter()
                try:
                    actor.train_step(mbs)
                    row["measured_gib"] = peak() / GIB
                    row["ratio"] = row["estimate_gib"] / row["measured_gib"] if CUDA else None
                except ActorOutOfMemoryError as e:
                    row["oom"] = str(e)
                    row["measured_gib"] = peak() / GIB
                row["seconds"] = time.perf_counter() - t0
                if gpu:
                    row["plan_largest_fitting"] = largest_fitting_tokens(shape, inputs, gpu_bytes=gpu)
                rows.append(row)
                log(f"{name}: {json.dumps({k: v for k, v in row.items() if k != 'rows_gib'})}")
                del mbs
                dump(args, report)
            if recompute is None:
                for tokens in args.logprob_tokens:
                    plan, _ = estimate(args.tokens[0], None, tokens)
                    mb = micro_batches(tokens, 1, cfg["vocab_size"], 2, fields=False)[0]
                    reset_peak()
                    try:
                        actor.compute_log_probs(mb)
                        measured = peak() / GIB
                        row = {"pass": "logprob", "tokens": tokens, "estimate_gib": plan.logprob_peak / GIB}
                        row |= {"measured_gib": measured, "ratio": plan.logprob_peak / GIB / measured if CUDA else None}
                    except ActorOutOfMemoryError as e:
                        row = {"pass": "logprob", "tokens": tokens, "oom": str(e)}
                    rows.append(row)
                    log(f"{name}: {json.dumps(row)}")
                    dump(args, report)
        # last: after it the card may hold the failed pass
        if args.oom_tokens and name == args.oom_model and not lora_rank:
            undo_recompute(actor)
            oom_test(actor, name, cfg, args, out)
        del actor
        gc.collect()
        if CUDA:
            torch.cuda.empty_cache()


def oom_test(actor, name: str, cfg: dict, args, out: dict) -> None:
    """A training budget too large on purpose: the actor's one-line error, then a step that fits still runs."""
    from tidal.actor.errors import ActorOutOfMemoryError
    from tidal.actor.memory_plan import GIB

    mbs = micro_batches(args.oom_tokens, 1, cfg["vocab_size"], 3, fields=True)
    before = torch.cuda.memory_allocated() if CUDA else 0
    try:
        actor.train_step(mbs)
        out["oom_test"] = {"tokens": args.oom_tokens, "error": None, "peak_gib": peak() / GIB}
    except ActorOutOfMemoryError as e:
        out["oom_test"] = {"tokens": args.oom_tokens, "error": str(e)}
        del e
        gc.collect()
        if CUDA:
            out["oom_test"]["allocated_before_gib"] = before / 2**30
            out["oom_test"]["allocated_after_gib"] = torch.cuda.memory_allocated() / 2**30
            out["oom_test"]["live_tensors"] = live_cuda_tensors()
            log(f"{name}: after the OOM: {json.dumps(out['oom_test'])[:3000]}")
        del mbs
        ok = micro_batches(args.tokens[0], 1, cfg["vocab_size"], 4, fields=True)
        try:
            actor.train_step(ok)
            out["oom_test"]["step_after_ok"] = True
        except ActorOutOfMemoryError as again:
            out["oom_test"]["step_after_ok"] = False
            out["oom_test"]["step_after_error"] = str(again)
    log(f"{name}: OOM test {out['oom_test']}")


def undo_recompute(actor) -> None:
    """Every layer back to its own forward (``enable_layer_recompute`` wraps it in an instance attribute)."""
    for layer in actor.model.decoder.layers:
        layer.__dict__.pop("forward", None)


def _with_recompute(acfg, layers: int):
    from dataclasses import replace

    return replace(acfg, recompute_activations=True, recompute_num_layers=layers)


def dump(args, report: dict) -> None:
    Path(args.out, "memory_plan.json").write_text(json.dumps(report, indent=1))


def summary(report: dict) -> None:
    print("| model | pass | tokens | recompute | estimate GiB | measured GiB | estimate / measured |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, out in report.items():
        if not isinstance(out, dict) or "rows" not in out:
            continue
        for r in out["rows"]:
            rec = {None: "off", 0: "all layers"}.get(r.get("recompute_layers"), f"first {r.get('recompute_layers')}")
            measured = "OOM" if "oom" in r else f"{r['measured_gib']:.1f}"
            ratio = f"{r['ratio']:.3f}" if r.get("ratio") else "-"
            est = r.get("estimate_gib", float("nan"))
            print(f"| {name} | {r['pass']} | {r['tokens']} | {rec} | {est:.1f} | {measured} | {ratio} |")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--models", nargs="*", default=["qwen2-1.5b", "qwen3-1.7b", "llama-3.2-3b"])
    p.add_argument("--tokens", type=int, nargs="*", default=[16384, 32768])
    p.add_argument("--logprob-tokens", type=int, nargs="*", default=[32768, 65536])
    p.add_argument("--recompute", type=int, nargs="*", default=[0], help="recompute settings after 'off' (0: all)")
    p.add_argument("--census-tokens", type=int, default=8192)
    p.add_argument("--chunk", type=int, default=4096)
    p.add_argument("--lora-ranks", type=int, nargs="*", default=[0], help="--lora-rank of each run (0: full FT)")
    p.add_argument("--lora-models", nargs="*", default=None, help="the models the LoRA ranks run on (default: all)")
    p.add_argument("--oom-model", default="llama-3.2-3b")
    p.add_argument("--oom-tokens", type=int, default=0, help="a training budget too large on purpose (0: skip)")
    args = p.parse_args()
    if args.tiny:
        args.models, args.tokens, args.logprob_tokens = ["tiny", "tiny-moe"], [512, 1024], [1024]
        args.census_tokens = 256
        args.oom_model = "tiny"
    Path(args.out).mkdir(parents=True, exist_ok=True)
    report: dict = {"torch": torch.__version__, "argv": sys.argv, "date_utc": time.strftime("%Y-%m-%d %H:%M")}
    if CUDA:
        report["device"] = torch.cuda.get_device_name()
        report["gpu_gib"] = torch.cuda.get_device_properties(0).total_memory / 2**30
    import megatron.core

    report["megatron_core"] = megatron.core.__version__
    from tidal.actor import init_distributed

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    init_distributed(rank=0, world_size=1, master_addr="127.0.0.1", master_port=port)
    for name in args.models:
        for rank in args.lora_ranks:
            if rank and args.lora_models is not None and name not in args.lora_models:
                continue
            try:
                run_model(name, args, report, lora_rank=rank)
            except Exception as e:  # keep going: the report says what failed
                import traceback

                traceback.print_exc()
                report.setdefault("errors", []).append(f"{name} lora {rank}: {e!r}"[:500])
            dump(args, report)
    summary(report)


if __name__ == "__main__":
    main()
