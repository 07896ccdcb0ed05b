"""GPU check and throughput of the actor (run by hand on a CUDA machine; not collected by pytest).

Usage: python gpu_check.py OUT_DIR
1. varlen_attn (bf16) == per-segment SDPA on packed segments.
2. The Actor on CUDA (fp32, and bf16 autocast) matches transformers' log-probs on a tiny Qwen2.
3. Throughput of compute_log_probs and train_step on a Qwen2-0.5B-shaped random model (bf16 autocast).
"""

import gc
import json
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch
from tidal.actor import Actor, ActorConfig, init_distributed
from tidal.actor.attention import packed_causal_attention
from tidal.batching import pack, unpack
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def save(cfg, out, std=0.1):
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0.0, std)
            if "norm" in name:
                p.add_(1.0)
    model.save_pretrained(out)
    return out


def check_varlen(report):
    torch.manual_seed(0)
    lengths = [7, 130, 1, 64, 300]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    q = torch.randn(sum(lengths), 8, 64, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(sum(lengths), 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    out = packed_causal_attention(q, k, v, cu, max(lengths), scale=0.125)
    ref = packed_causal_attention(q.float(), k.float(), v.float(), cu.cpu(), max(lengths), scale=0.125)
    report["varlen_max_abs_diff_vs_fp32_sdpa"] = float((out.float() - ref).abs().max())
    assert report["varlen_max_abs_diff_vs_fp32_sdpa"] < 3e-2


def check_parity(report, tmp):
    cfg = Qwen2Config(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    d = save(cfg, tmp / "tiny")
    seqs = [[5, 17, 99, 3, 42, 7, 64], [1, 2, 3], [120, 0, 33, 33, 8, 90, 12, 101, 4, 56, 77]]
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    ref = []
    with torch.no_grad():
        for s in seqs:
            ids = torch.tensor([s])
            lp = torch.log_softmax(hf(ids).logits[0], -1)[:-1].gather(-1, ids[0, 1:, None]).squeeze(-1)
            ref.append(torch.cat([torch.zeros(1), lp]))
    batch = pack(seqs)
    for bf16 in (False, True):
        actor = Actor(ActorConfig(hf_checkpoint=str(d), bf16=bf16))
        got = unpack(actor.compute_log_probs(batch), batch)
        diff = max(float((a - b).abs().max()) for a, b in zip(got, ref, strict=True))
        report[f"tiny_qwen2_logprob_max_abs_diff_bf16={bf16}"] = diff
        assert diff < (5e-2 if bf16 else 1e-4), diff


def bench(report, tmp, recompute=False):
    cfg = Qwen2Config(
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
    )
    gc.collect()  # drop the previous bench's actor before measuring this one's peak
    torch.cuda.empty_cache()
    d = tmp / "q05b"
    if not d.exists():
        save(cfg, d, std=0.02)
    actor = Actor(
        ActorConfig(
            hf_checkpoint=str(d), bf16=True, lr=1e-6, log_probs_chunk_size=4096, recompute_activations=recompute
        )
    )
    n_params = sum(p.numel() for p in actor.model.parameters())
    torch.manual_seed(0)
    lengths = torch.randint(200, 2000, (16,)).tolist()  # ~17k tokens per micro-batch
    seqs = [torch.randint(0, 151936, (n,)).tolist() for n in lengths]
    masks = [[0] * 100 + [1] * (n - 100) for n in lengths]
    zeros = [[0.0] * n for n in lengths]
    mb = pack(seqs, loss_masks=masks, token_fields={"old_log_probs": zeros, "advantages": [[0.5] * n for n in lengths]})
    actor.compute_log_probs(mb)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(3):
        actor.compute_log_probs(mb)
    torch.cuda.synchronize()
    t_lp = (time.perf_counter() - t0) / 3
    actor.train_step([mb])
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    metrics = actor.train_step([mb, mb])
    torch.cuda.synchronize()
    t_train = time.perf_counter() - t0
    tokens = mb.num_tokens
    # 6 N flops per token for fwd+bwd (attention flops excluded); H200 bf16 dense peak ~989 TFLOP/s
    tag = "recompute_" if recompute else ""
    report |= {
        "bench_params": n_params,
        "bench_tokens_per_micro_batch": tokens,
        f"{tag}log_probs_tokens_per_s": tokens / t_lp,
        f"{tag}train_tokens_per_s": 2 * tokens / t_train,
        f"{tag}train_mfu_6N_vs_989TF": 6 * n_params * 2 * tokens / t_train / 989e12,
        f"{tag}train_peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30,
        f"{tag}train_metrics": metrics,
    }


def main():
    out = Path(sys.argv[1])
    report = {"torch": torch.__version__, "device": torch.cuda.get_device_name()}
    init_distributed(rank=0, world_size=1, master_addr="127.0.0.1", master_port=free_port())
    with tempfile.TemporaryDirectory() as tmp:
        steps = (
            check_varlen,
            lambda r: check_parity(r, Path(tmp)),
            lambda r: bench(r, Path(tmp)),
            lambda r: bench(r, Path(tmp), recompute=True),
        )
        for step in steps:
            try:
                step(report)
            except Exception as e:  # keep going; the report says what failed
                report.setdefault("errors", []).append(repr(e))
            (out / "gpu_report.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
