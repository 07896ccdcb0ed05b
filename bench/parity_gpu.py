"""Parity of tidal-actor with Hugging Face transformers at real lengths, per position bucket (issue 24, item 1).

For each model family (Qwen2 with q/k/v bias, Qwen3 with qk-norm, Llama with llama3 rope scaling; tied and untied;
rope_theta 1e4 / 5e5 / 1e6) and each checkpoint dtype (saved in bf16 and in fp32), one pack of sequences up to 32k
tokens next to short ones is scored by:
  - an fp64 reference: HF loaded in float64, RoPE angles and cos/sin in float64 (HF computes them in fp32 even for a
    float64 model), attention in float64 chunked over queries (no [T, T] matrix);
  - HF loaded (never cast) in fp32 and in bf16, SDPA, one sequence at a time;
  - tidal fp32 (``params_dtype="float32"``) and tidal's fast bf16 setting (``params_dtype="bfloat16"`` with the
    Triton kernels), the whole pack at once (packed THD);
  - diagnostic variants of tidal bf16 (``--variants``): ``eager`` (fused kernels off), ``table_bf16`` (the RoPE
    cos/sin table rounded to bf16, as before the fix of issue 24).
Each contender's log-probs (tidal's convention: position t holds log p(token t | earlier)) are compared with the fp64
reference and with HF fp32 per position bucket (mean |delta|), and its gradient of a fixed weighted sum of log-probs
with the fp64 gradient (relative norm of the difference) on four tensors that every path reaches: the embedding,
layer 0's attention output projection, the last layer's MLP down projection and the final norm.

Pass (issue 24): in every bucket tidal fp32 is within 1e-3 of HF fp32, and tidal bf16's distance to fp64 is at most
1.5x HF bf16's own; gradients likewise (tidal fp32 within 1e-3 relative of HF fp32's; tidal bf16 within 1.5x HF bf16's).

On the device machine (megatron-core carried in .carry/site, as for bench_actor_gpu.py):
    PYTHONPATH=.carry/site:packages/actor/src:packages/batching/src:packages/ckpt/src \
        python3 bench/parity_gpu.py --out $OUT
On CPU with small shapes, to check the harness itself: uv run python bench/parity_gpu.py --tiny --out /tmp/parity
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import itertools
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch

CUDA = torch.cuda.is_available()
DEV = torch.device("cuda" if CUDA else "cpu")
EMBED_STD: list[float | None] = [None]  # --embed-std; None: 2 / sqrt(hidden)
BUCKETS = [0, 64, 512, 2048, 4096, 8192, 16384, 32768]
GRAD_TENSORS = {  # megatron name -> HF name (TP = 1); {last} is the last layer
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "decoder.layers.0.self_attention.linear_proj.weight": "model.layers.0.self_attn.o_proj.weight",
    "decoder.layers.{last}.mlp.linear_fc2.weight": "model.layers.{last}.mlp.down_proj.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
}


def families(tiny: bool) -> dict[str, tuple[str, dict]]:
    """Model type and config keyword arguments of each family (real widths, 2 layers; tiny: small widths)."""
    width = (
        dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
        if tiny
        else dict(hidden_size=1536, intermediate_size=8960, num_attention_heads=12, num_key_value_heads=2)
    )
    common = dict(vocab_size=512 if tiny else 32000, num_hidden_layers=2, max_position_embeddings=40960)
    qwen3 = (
        dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32)
        if tiny
        else dict(hidden_size=2048, intermediate_size=6144, num_attention_heads=16, num_key_value_heads=8, head_dim=128)
    )
    llama = (
        dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
        if tiny
        else dict(hidden_size=3072, intermediate_size=8192, num_attention_heads=24, num_key_value_heads=8)
    )
    from bench_actor_gpu import LLAMA_3_2_3B  # Llama-3.2-3B's rope_parameters (llama3 scaling, theta 5e5)

    llama3 = LLAMA_3_2_3B["rope_parameters"]
    return {
        "qwen2": ("qwen2", {**common, **width, "rope_theta": 1e6, "tie_word_embeddings": True}),
        "qwen2_theta1e4_untied": ("qwen2", {**common, **width, "rope_theta": 1e4, "tie_word_embeddings": False}),
        "qwen3": ("qwen3", {**common, **qwen3, "rope_theta": 1e6, "tie_word_embeddings": True}),
        "llama3": (
            "llama",
            {
                **common,
                **llama,
                "rope_parameters": llama3,
                "tie_word_embeddings": True,
                "max_position_embeddings": 131072,
            },
        ),
    }


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def save_checkpoints(model_type: str, kwargs: dict, out: Path) -> dict[str, Path]:
    """One random model saved twice: in fp32 and in bf16 (``save_pretrained``), like a real checkpoint."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    cls = {"qwen2": (Qwen2Config, Qwen2ForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM)}
    cfg_cls, model_cls = cls.get(model_type, (LlamaConfig, LlamaForCausalLM))
    torch.manual_seed(0)
    model = model_cls(cfg_cls(**kwargs))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.1)
            elif "embed" in name or "lm_head" in name:  # logits of std ~2 through a tied or untied head
                p.normal_(0.0, EMBED_STD[0] or 2.0 / kwargs["hidden_size"] ** 0.5)
            else:
                p.normal_(0.0, 0.02 if "bias" not in name else 0.5)
    dirs = {"fp32": out / "fp32", "bf16": out / "bf16"}
    model.save_pretrained(dirs["fp32"])
    model.to(torch.bfloat16).save_pretrained(dirs["bf16"])
    return dirs


def workload(vocab: int, tiny: bool, seed: int = 0) -> tuple[list[torch.Tensor], torch.Tensor]:
    """A long sequence packed with short and medium ones, and fixed per-token loss weights."""
    lengths = [40, 700, 3000, 64] if tiny else [300, 12000, 64, 32768, 2500, 700, 5]
    gen = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, vocab, (n,), generator=gen) for n in lengths]
    weights = torch.randn(sum(lengths), generator=gen)
    return seqs, weights


# ----------------------------------------------------------------------------------------------- Hugging Face


def chunked_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Causal attention in the inputs' dtype over query blocks (no [T, T] matrix): the fp64 reference's kernel."""
    _, heads, n, _ = query.shape
    rep = heads // key.size(1)
    k = key[0].repeat_interleave(rep, 0)
    v = value[0].repeat_interleave(rep, 0)
    q = query[0]
    block = max(1, (1 << 27) // max(1, heads * n))  # ~1 GiB of fp64 scores per block

    def one(qb, start):
        s = torch.einsum("hqd,hkd->hqk", qb, k[:, : start + qb.size(1)]) * scaling
        pos_q = torch.arange(start, start + qb.size(1), device=q.device)[:, None]
        pos_k = torch.arange(start + qb.size(1), device=q.device)[None, :]
        s = s.masked_fill(pos_k > pos_q, float("-inf"))
        return torch.einsum("hqk,hkd->hqd", torch.softmax(s, -1), v[:, : start + qb.size(1)])

    outs = []
    for start in range(0, n, block):
        qb = q[:, start : start + block]
        outs.append(torch.utils.checkpoint.checkpoint(one, qb, start, use_reentrant=False))
    return torch.cat(outs, 1).transpose(0, 1).unsqueeze(0), None


def rotary_fp64(self, x, position_ids):
    """HF rotary embedding forward with the angles and cos/sin in float64 (inv_freq: the model's own values)."""
    freqs = position_ids[..., None].double() * self.inv_freq.double()[None, None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * self.attention_scaling).to(x.dtype), (emb.sin() * self.attention_scaling).to(x.dtype)


def hf_model(path: Path, dtype: torch.dtype):
    from transformers import AttentionInterface, AutoModelForCausalLM

    if dtype == torch.float64:
        AttentionInterface.register("tidal_chunked", chunked_attention)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="tidal_chunked")
        rot = model.model.rotary_emb
        rot.forward = rotary_fp64.__get__(rot)
    else:  # SDPA with is_causal and no mask tensor (HF's own sdpa path builds a [T, T] mask: math kernel at 32k)
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

        AttentionInterface.register("tidal_sdpa_causal", sdpa_causal)
        ALL_MASK_ATTENTION_FUNCTIONS.register("tidal_sdpa_causal", lambda *a, **k: None)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="tidal_sdpa_causal")
    return model.to(DEV).eval()


def sdpa_causal(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """torch's SDPA, causal, grouped-query, no mask tensor: what HF's sdpa path computes for one unpadded row."""
    rep = query.size(1) // key.size(1)  # k/v repeated here: enable_gqa would send fp32 to the math kernel
    key, value = key.repeat_interleave(rep, 1), value.repeat_interleave(rep, 1)
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def hf_scores(model, seqs: list[torch.Tensor], weights: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token log-probs (tidal's convention) of each sequence alone, and the gradients of sum(weights * lp)."""
    model.zero_grad(set_to_none=True)
    out, offset = [], 0
    head = model.lm_head.weight
    for ids in seqs:
        ids = ids.to(DEV)
        hidden = model.model(input_ids=ids[None]).last_hidden_state[0]
        lps = [torch.zeros(1, device=DEV, dtype=torch.float64)]
        for start in range(0, ids.numel() - 1, 4096):  # the LM head in chunks: no [T, V] fp64 tensor
            h = hidden[start : min(start + 4096, ids.numel() - 1)]
            logits = (h @ head.t()).to(torch.float64 if h.dtype == torch.float64 else torch.float32)
            tgt = ids[start + 1 : start + 1 + h.size(0)]
            lps.append(torch.log_softmax(logits, -1).gather(-1, tgt[:, None]).squeeze(-1).double())
        lp = torch.cat(lps)
        w = weights[offset : offset + ids.numel()].to(DEV, torch.float64)
        (lp * w).sum().backward()
        out.append(lp.detach().cpu())
        offset += ids.numel()
        del hidden, lp
    grads = {hf: p.grad.detach().double().cpu() for hf, p in model.named_parameters() if p.grad is not None}
    return torch.cat(out), grads


# ----------------------------------------------------------------------------------------------- tidal


@contextlib.contextmanager
def variant(name: str):
    """Diagnostic variants of tidal's bf16 path, by patching its module functions for the duration."""
    from tidal.actor import fused

    saved = fused.rope_table
    if name == "table_bf16":  # the table as before the fix: cos/sin rounded to the activations' dtype

        def bf16_table(freqs, position):
            f = freqs[position].reshape(position.numel(), 1, freqs.size(-1))
            return f.cos().to(torch.bfloat16), f.sin().to(torch.bfloat16)

        fused.rope_table = bf16_table
    try:
        yield
    finally:
        fused.rope_table = saved


def tidal_scores(path: Path, dtype: str, fused_kernels: bool, seqs, weights, num_layers: int):
    from tidal.actor import Actor, ActorConfig
    from tidal.batching import pack

    actor = Actor(ActorConfig(hf_checkpoint=str(path), params_dtype=dtype, fused_kernels=fused_kernels))
    batch = pack([s.tolist() for s in seqs])
    actor.model.train()  # dropout is 0: train mode only so that autograd keeps what backward needs
    for p in actor.params:
        p.grad = None
    lp, _ = actor._forward(batch, with_entropy=False)
    n = weights.numel()
    (lp[:n].double() * weights.to(lp.device, torch.float64)).sum().backward()
    named = dict(actor.model.named_parameters())
    grads = {}
    for mname, hname in GRAD_TENSORS.items():
        last = str(num_layers - 1)
        p = named[mname.format(last=last)]
        grads[hname.format(last=last)] = p.grad.detach().double().cpu()
    out = lp[:n].detach().double().cpu()
    del actor, lp
    return out, grads


# ----------------------------------------------------------------------------------------------- comparison


def bucket_means(diff: torch.Tensor, seqs: list[torch.Tensor]) -> list[float | None]:
    """Mean |diff| per position bucket (position inside its own sequence; each sequence's first token skipped)."""
    pos = torch.cat([torch.arange(s.numel()) for s in seqs])
    first = torch.cat([torch.arange(s.numel()) == 0 for s in seqs])
    out = []
    for lo, hi in itertools.pairwise(BUCKETS):
        sel = (pos >= lo) & (pos < hi) & ~first
        out.append(float(diff[sel].abs().mean()) if sel.any() else None)
    return out


def grad_rel(grads: dict, ref: dict) -> float:
    """Largest relative norm of the difference over the compared tensors."""
    worst = 0.0
    for name, g in grads.items():
        r = ref[name]
        worst = max(worst, float((g - r).norm() / r.norm().clamp_min(1e-30)))
    return worst


def one_family(name: str, model_type: str, kwargs: dict, args, report: dict, tmp: Path) -> None:
    dirs = save_checkpoints(model_type, kwargs, tmp / name)
    seqs, weights = workload(kwargs["vocab_size"], args.tiny)
    num_layers = kwargs["num_hidden_layers"]
    for ckpt_dtype, path in dirs.items():
        key = f"{name}/{ckpt_dtype}"
        rows: dict[str, dict] = {}
        scores: dict[str, tuple] = {}
        for tag, dtype in (("hf_fp64", torch.float64), ("hf_fp32", torch.float32), ("hf_bf16", torch.bfloat16)):
            t0 = time.perf_counter()
            model = hf_model(path, dtype)
            lp, grads = hf_scores(model, seqs, weights)
            scores[tag] = (lp, {k: grads[k] for k in _grad_names(num_layers)})
            del model
            gc.collect()
            torch.cuda.empty_cache() if CUDA else None
            log(f"{key} {tag}: {time.perf_counter() - t0:.1f} s")
        contenders = [("tidal_fp32", "float32", True, "shipped"), ("tidal_bf16", "bfloat16", True, "shipped")]
        contenders += [(f"tidal_bf16_{v}", "bfloat16", v != "eager", v) for v in args.variants]
        for tag, dtype, fk, var in contenders:
            t0 = time.perf_counter()
            with variant(var):
                scores[tag] = tidal_scores(path, dtype, fk, seqs, weights, num_layers)
            gc.collect()
            torch.cuda.empty_cache() if CUDA else None
            log(f"{key} {tag}: {time.perf_counter() - t0:.1f} s")
        ref_lp, ref_g = scores["hf_fp64"]
        fp32_lp, fp32_g = scores["hf_fp32"]
        for tag, (lp, g) in scores.items():
            if tag == "hf_fp64":
                continue
            rows[tag] = {
                "vs_fp64": bucket_means(lp - ref_lp, seqs),
                "vs_hf_fp32": bucket_means(lp - fp32_lp, seqs),
                "grad_rel_vs_fp64": grad_rel(g, ref_g),
                "grad_rel_vs_hf_fp32": grad_rel(g, fp32_g),
                "max_abs_vs_fp64": float((lp - ref_lp).abs().max()),
            }
        rows["verdict"] = verdict(rows)
        report["results"][key] = rows
        log(f"{key}: {rows['verdict']}")
        print_table(key, rows)


def _grad_names(num_layers: int) -> set[str]:
    return {h.format(last=num_layers - 1) for h in GRAD_TENSORS.values()}


def verdict(rows: dict) -> dict:
    """Issue 24's pass rule, bucket by bucket."""
    fp32 = [d for d in rows["tidal_fp32"]["vs_hf_fp32"] if d is not None]
    hf16 = rows["hf_bf16"]["vs_fp64"]
    t16 = rows["tidal_bf16"]["vs_fp64"]
    ratios = [t / h for t, h in zip(t16, hf16, strict=True) if t is not None and h]
    g_ratio = rows["tidal_bf16"]["grad_rel_vs_fp64"] / max(rows["hf_bf16"]["grad_rel_vs_fp64"], 1e-30)
    return {
        "tidal_fp32_max_bucket_vs_hf_fp32": max(fp32),
        "tidal_fp32_pass": max(fp32) <= 1e-3 and rows["tidal_fp32"]["grad_rel_vs_hf_fp32"] <= 1e-3,
        "tidal_bf16_worst_ratio_to_hf_bf16": max(ratios),
        "tidal_bf16_grad_ratio_to_hf_bf16": g_ratio,
        "tidal_bf16_pass": max(ratios) <= 1.5 and g_ratio <= 1.5,
    }


def print_table(key: str, rows: dict) -> None:
    heads = [f"{lo}-{hi}" for lo, hi in itertools.pairwise(BUCKETS)]
    print(f"\n{key}: mean |delta log-prob| vs fp64 per position bucket; grad rel. diff vs fp64")
    print("| contender | " + " | ".join(heads) + " | grad |")
    print("|---" * (len(heads) + 2) + "|")
    for tag, row in rows.items():
        if tag == "verdict":
            continue
        cells = ["" if d is None else f"{d:.4f}" for d in row["vs_fp64"]]
        print(f"| {tag} | " + " | ".join(cells) + f" | {row['grad_rel_vs_fp64']:.2e} |")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--tiny", action="store_true", help="small widths and lengths, to check the harness on CPU")
    p.add_argument("--families", nargs="*", default=None, help="subset of: qwen2 qwen2_theta1e4_untied qwen3 llama3")
    p.add_argument("--embed-std", type=float, default=None, help="embedding/LM-head init std (2/sqrt(hidden))")
    p.add_argument("--variants", nargs="*", default=["eager", "table_bf16"], help="diagnostic tidal bf16 variants")
    args = p.parse_args()
    EMBED_STD[0] = args.embed_std
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report: dict = {"argv": sys.argv, "torch": torch.__version__, "buckets": BUCKETS, "results": {}}
    if CUDA:
        report["device"] = torch.cuda.get_device_name()
    from tidal.actor import init_distributed

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    init_distributed(rank=0, world_size=1, master_addr="127.0.0.1", master_port=port)
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32 (torch's default; stated for the record)
    fams = families(args.tiny)
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.families or list(fams):
            model_type, kwargs = fams[name]
            try:
                one_family(name, model_type, kwargs, args, report, Path(tmp))
            except Exception as e:  # keep going: the report says what failed
                import traceback

                traceback.print_exc()
                report.setdefault("errors", []).append(f"{name}: {e!r}"[:800])
            (out / "parity.json").write_text(json.dumps(report, indent=2))
    print("\nverdicts:")
    for key, rows in report["results"].items():
        print(key, json.dumps(rows["verdict"]))
    ok = all(
        rows["verdict"]["tidal_fp32_pass"] and rows["verdict"]["tidal_bf16_pass"] for rows in report["results"].values()
    )
    print("PASS" if ok and "errors" not in report else "FAIL")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
