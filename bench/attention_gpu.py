"""Packed causal attention kernels on one GPU: FlashAttention-2 varlen (torch) against cuDNN's ragged attention.

For each model family's head layout (Qwen2-1.5B 12/2, Qwen3-1.7B 16/8, Llama-3.2-3B 24/8; head_dim 128), one
32,768-token pack of the long RL mix's lengths (12,359 down to 209) is run forward and forward+backward by each
contender; printed: milliseconds, TFLOP/s (causal FLOPs) and the distance of output and gradients to FA2's and to an
fp32 reference on a short pack. Contenders whose kernel is missing or refuses the input print the error.

    python3 bench/attention_gpu.py --out OUT/attention.json          # ~1 min on an H200
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "packages" / "actor" / "src"))

FAMILIES = {"qwen2-1.5b": (12, 2), "qwen3-1.7b": (16, 8), "llama-3.2-3b": (24, 8)}
LONG_PACK = [12359, 7000, 4000, 3000, 2500, 1800, 1200, 700]
SHORT_PACK = [700, 300, 129, 64, 5]


def _cu(lengths: list[int], device) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)


def fa2(q, k, v, cu, max_len, scale, gqa_native):
    from torch.nn.attention.varlen import varlen_attn

    kwargs = {}
    if q.size(1) != k.size(1):
        if gqa_native:
            kwargs["enable_gqa"] = True
        else:
            k = k.repeat_interleave(q.size(1) // k.size(1), dim=1)
            v = v.repeat_interleave(q.size(1) // v.size(1), dim=1)
    return varlen_attn(q, k, v, cu, cu, max_len, max_len, scale=scale, window_size=(-1, 0), **kwargs)


def cudnn(q, k, v, cu, max_len, scale, gqa_native):
    if q.size(1) != k.size(1) and not gqa_native:
        k = k.repeat_interleave(q.size(1) // k.size(1), dim=1)
        v = v.repeat_interleave(q.size(1) // v.size(1), dim=1)
    return torch.ops.aten._cudnn_attention_forward(
        q, k, v, None, cu, cu, max_len, max_len, True, 0.0, True, False, scale=scale
    )[0]


def _dense_per_segment(backend, q, k, v, cu, scale, gqa_native):
    from torch.nn.attention import sdpa_kernel

    if q.size(1) != k.size(1) and not gqa_native:
        k = k.repeat_interleave(q.size(1) // k.size(1), dim=1)
        v = v.repeat_interleave(q.size(1) // v.size(1), dim=1)
    outs = []
    bounds = cu.tolist()
    with sdpa_kernel([backend]):
        for start, end in itertools.pairwise(bounds):
            qq, kk, vv = (x[start:end].transpose(0, 1).unsqueeze(0) for x in (q, k, v))
            out = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, scale=scale, enable_gqa=bool(gqa_native))
            outs.append(out[0].transpose(0, 1))
    return torch.cat(outs)


def cudnn_dense(q, k, v, cu, max_len, scale, gqa_native):
    from torch.nn.attention import SDPBackend

    return _dense_per_segment(SDPBackend.CUDNN_ATTENTION, q, k, v, cu, scale, gqa_native)


def flash_dense(q, k, v, cu, max_len, scale, gqa_native):
    from torch.nn.attention import SDPBackend

    return _dense_per_segment(SDPBackend.FLASH_ATTENTION, q, k, v, cu, scale, gqa_native)


def tidal(q, k, v, cu, max_len, scale, gqa_native):
    from tidal.actor import ActorConfig
    from tidal.actor.attention import packed_causal_attention

    threshold = ActorConfig.__dataclass_fields__["cudnn_attention_min_tokens"].default  # the actor's default
    bounds = tuple(cu.tolist())
    return packed_causal_attention(
        q, k, v, cu, max_len, scale=scale, host_cu_seqlens=bounds, cudnn_min_segment=threshold
    )


def tidal_fa2_only(q, k, v, cu, max_len, scale, gqa_native):
    from tidal.actor.attention import packed_causal_attention

    return packed_causal_attention(q, k, v, cu, max_len, scale=scale)


CONTENDERS = {
    "fa2 (k/v repeated)": (fa2, False),
    "tidal fa2 only (k/v grouped)": (tidal_fa2_only, True),
    "tidal, long segments to cudnn (padded)": (tidal, True),
    "cudnn dense per segment (k/v repeated)": (cudnn_dense, False),
    "cudnn dense per segment enable_gqa": (cudnn_dense, True),
    "flash dense per segment (k/v repeated)": (flash_dense, False),
    "cudnn ragged (k/v repeated)": (cudnn, False),
}


def reference(q, k, v, lengths, scale):
    """fp32 causal attention per segment (math kernel), the ground truth on the short pack."""
    outs, start = [], 0
    rep = q.size(1) // k.size(1)
    for n in lengths:
        sl = slice(start, start + n)
        qq, kk, vv = (x[sl].float().transpose(0, 1).unsqueeze(0) for x in (q, k, v))
        kk, vv = kk.repeat_interleave(rep, dim=1), vv.repeat_interleave(rep, dim=1)
        outs.append(F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, scale=scale)[0].transpose(0, 1))
        start += n
    return torch.cat(outs)


def _inputs(lengths, heads, groups, dim, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    total = sum(lengths)
    q, k, v = (
        torch.randn(total, h, dim, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
        for h in (heads, groups, groups)
    )
    grad = torch.randn(total, heads, dim, device="cuda", dtype=torch.bfloat16, generator=g)
    return q, k, v, grad


def _run(fn, gqa, q, k, v, grad, cu, max_len, scale):
    for x in (q, k, v):
        x.grad = None
    out = fn(q, k, v, cu, max_len, scale, gqa)
    out.backward(grad)
    return out.detach().float(), [x.grad.float() for x in (q, k, v)]


def _time(fn, gqa, q, k, v, grad, cu, max_len, scale, reps):
    def fwd():
        with torch.no_grad():
            fn(q, k, v, cu, max_len, scale, gqa)

    def fwd_bwd():
        torch.autograd.backward(fn(q, k, v, cu, max_len, scale, gqa), grad)

    result = {}
    for name, step in (("fwd_ms", fwd), ("fwd_bwd_ms", fwd_bwd)):
        for _ in range(3):
            step()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(reps):
            step()
        end.record()
        torch.cuda.synchronize()
        result[name] = start.elapsed_time(end) / reps
    return result


def _rel(a, b):
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--reps", type=int, default=10)
    args = p.parse_args()
    print(f"torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}, {torch.cuda.get_device_name()}")
    dim, scale = 128, 128**-0.5
    report = {"torch": torch.__version__, "cudnn": torch.backends.cudnn.version(), "families": {}}
    causal_pairs = sum(n * (n + 1) // 2 for n in LONG_PACK)
    for family, (heads, groups) in FAMILIES.items():
        fwd_flops = 4 * heads * dim * causal_pairs
        rows = report["families"][family] = {}
        sq, sk, sv, sg = _inputs(SHORT_PACK, heads, groups, dim, seed=1)
        ref = reference(sq, sk, sv, SHORT_PACK, scale)
        scu = _cu(SHORT_PACK, "cuda")
        q, k, v, grad = _inputs(LONG_PACK, heads, groups, dim, seed=0)
        cu = _cu(LONG_PACK, "cuda")
        base = None
        for name, (fn, gqa) in CONTENDERS.items():
            row = rows[name] = {}
            try:
                short_out, _ = _run(fn, gqa, sq, sk, sv, sg, scu, max(SHORT_PACK), scale)
                row["short_rel_err_vs_fp32"] = _rel(short_out, ref)
                out, grads = _run(fn, gqa, q, k, v, grad, cu, max(LONG_PACK), scale)
                if base is None:
                    base = (out, grads)
                else:
                    pairs = zip([out, *grads], [base[0], *base[1]], strict=True)
                    row["rel_diff_vs_fa2_out_dq_dk_dv"] = [_rel(a, b) for a, b in pairs]
                row.update(_time(fn, gqa, q, k, v, grad, cu, max(LONG_PACK), scale, args.reps))
                cold = []
                for shift in range(1, 4):  # lengths never seen: what a kernel-plan cache miss costs
                    lengths = [n + shift for n in LONG_PACK[:-1]] + [LONG_PACK[-1] - shift * (len(LONG_PACK) - 1)]
                    torch.cuda.synchronize()
                    tick = time.perf_counter()
                    torch.autograd.backward(fn(q, k, v, _cu(lengths, "cuda"), max(lengths), scale, gqa), grad)
                    torch.cuda.synchronize()
                    cold.append((time.perf_counter() - tick) * 1e3)
                row["new_lengths_fwd_bwd_ms"] = cold
                row["fwd_tflops"] = fwd_flops / row["fwd_ms"] / 1e9
                row["fwd_bwd_tflops"] = 3.5 * fwd_flops / row["fwd_bwd_ms"] / 1e9
            except Exception as exc:  # a contender the build lacks: report it, go on
                row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            print(f"{family:13s} {name:30s} {json.dumps(row)}", flush=True)
            torch.cuda.empty_cache()
        report["families"][family]["by_length"] = by_length(heads, groups, dim, scale, args.reps)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))


def by_length(heads: int, groups: int, dim: int, scale: float, reps: int) -> dict:
    """Where cuDNN overtakes FA2: a 32k pack of equal segments per length, FA2 varlen (one call) against each
    segment through tidal's padded cuDNN path; fwd and fwd+bwd ms."""
    from tidal.actor.attention import cudnn_bucket_length, padded_segment_attention

    def cudnn_each(q, k, v, cu, max_len, scale, gqa_native):
        bounds = cu.tolist()
        return torch.cat(
            [padded_segment_attention(q[a:b], k[a:b], v[a:b], scale) for a, b in itertools.pairwise(bounds)]
        )

    rows = {}
    for length in (509, 1013, 1531, 2039, 3067, 4091, 8179, 16381):  # just under a bucket: the padding is paid
        lengths = [length] * max(1, 32768 // length)
        q, k, v, grad = _inputs(lengths, heads, groups, dim, seed=2)
        cu = _cu(lengths, "cuda")
        row = rows[length] = {"segments": len(lengths), "padded_to": cudnn_bucket_length(length)}
        for name, fn in (("fa2", tidal_fa2_only), ("cudnn", cudnn_each)):
            try:
                row[name] = _time(fn, True, q, k, v, grad, cu, length, scale, reps)
            except Exception as exc:
                row[name] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
        print(f"  by length {heads}/{groups} {length}: {json.dumps(row)}", flush=True)
        torch.cuda.empty_cache()
    return rows


if __name__ == "__main__":
    main()
