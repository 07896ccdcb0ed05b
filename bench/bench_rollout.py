"""Rollout throughput: tidal.rollout.generate_samples versus the same requests sent to SGLang directly.

Starts ONE real SGLang server (CPU flags when there is no CUDA) on a tiny Qwen2 built locally (random
weights, word-level tokenizer; no download), or on ``--model DIR``. For each concurrency level it times

- tidal: ``generate_samples(engine, prompts, params, max_concurrency=c)`` (one request per prompt group,
  parsed into Samples, progress, restart guard);
- direct, same requests: the same per-group ``/generate`` payloads posted with ``requests`` from ``c``
  threads, answers only JSON-decoded;
- direct, one call: every sample in ONE ``/generate`` call (concurrency does not apply);

interleaved, ``--repeats`` times each, median wall clock. ``ignore_eos`` makes every response exactly
``--max-new-tokens`` long, so tokens/s = samples/s x that. Also times a weight update from disk and from
tensors (time per MB). Prints a Markdown table.

    uv run python bench/bench_rollout.py          # 16 prompts x 8 samples x 32 tokens; minutes on two shared cores
    uv run python bench/bench_rollout.py --prompts 64 --n 8 --concurrency 1 8 64 --repeats 5
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import socket
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

WORDS = "the answer is zero one two three four five six seven eight nine plus minus what a b c d e f g h"


def build_tiny_qwen2(out: Path, *, hidden: int, layers: int) -> Path:
    """A random Qwen2 with a word-level tokenizer, in the HF layout (float32)."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([WORDS], trainers.WordLevelTrainer(special_tokens=["<unk>", "<pad>", "<eos>"]))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", eos_token="<eos>")
    fast.save_pretrained(out)
    config = Qwen2Config(
        vocab_size=tok.get_vocab_size(),
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).to(torch.float32).save_pretrained(out)
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": fast.eos_token_id}))
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def direct_same_requests(url: str, prompts: list[list[int]], params: dict, concurrency: int) -> int:
    """The per-group payloads tidal sends, posted with plain requests; returns the number of samples."""
    n = params["n"]
    rest = {k: v for k, v in params.items() if k != "n"}
    session = requests.Session()
    session.mount("http://", requests.adapters.HTTPAdapter(pool_maxsize=max(concurrency, 10)))

    def post(ids: list[int]) -> int:
        payload = {"input_ids": [ids] * n, "sampling_params": rest, "return_logprob": True}
        response = session.post(f"{url}/generate", json=payload, timeout=600)
        response.raise_for_status()
        return len(response.json())

    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        return sum(pool.map(post, prompts))


def direct_one_call(url: str, prompts: list[list[int]], params: dict) -> int:
    """Every sample in one /generate call."""
    n = params["n"]
    rest = {k: v for k, v in params.items() if k != "n"}
    payload = {"input_ids": [ids for ids in prompts for _ in range(n)], "sampling_params": rest, "return_logprob": True}
    response = requests.post(f"{url}/generate", json=payload, timeout=600)
    response.raise_for_status()
    return len(response.json())


def timed(fn) -> tuple[float, int]:
    start = time.perf_counter()
    count = fn()
    return time.perf_counter() - start, count


HEADER = (
    "| concurrency | tidal samples/s | tidal tokens/s | direct, same requests, samples/s | tidal / direct "
    "| direct, one batched call, samples/s | tidal / one call |\n|---|---|---|---|---|---|---|"
)


def row_line(r: dict, tokens: int) -> str:
    t, d, o = r["tidal_s"], r["direct_s"], r["one_call_s"]
    return (
        f"| {r['concurrency']} | {r['samples'] / t:.1f} | {tokens / t:.0f} | {r['samples'] / d:.1f} | "
        f"{d / t:.3f} | {r['samples'] / o:.1f} | {o / t:.3f} |"
    )


def bench_generation(engine, args) -> list[dict]:
    from tidal.rollout import generate_samples

    prompts = [[3 + (i * 7 + j) % 20 for j in range(args.prompt_len)] for i in range(args.prompts)]
    params = {"n": args.n, "max_new_tokens": args.max_new_tokens, "temperature": 1.0, "ignore_eos": True}
    total = args.prompts * args.n

    def tidal(c: int) -> int:
        return len(generate_samples(engine, prompts, params, max_concurrency=c, progress_every_s=3600))

    tidal(max(args.concurrency))  # warm-up (first requests compile/allocate)
    print(
        f"Workload: {args.prompts} prompts x {args.n} samples, prompt {args.prompt_len} tokens, "
        f"{args.max_new_tokens} new tokens each (ignore_eos), log-probs on; {total * args.max_new_tokens} generated "
        f"tokens per batch; median of {args.repeats} interleaved repeats.\n\n{HEADER}",
        flush=True,
    )
    rows = []
    for c in args.concurrency:
        times: dict[str, list[float]] = {"tidal": [], "direct": [], "one_call": []}
        for _ in range(args.repeats):  # interleaved, so that load from other jobs hits all three alike
            for name, fn in (
                ("tidal", lambda c=c: tidal(c)),
                ("direct", lambda c=c: direct_same_requests(engine.url, prompts, params, c)),
                ("one_call", lambda: direct_one_call(engine.url, prompts, params)),
            ):
                seconds, count = timed(fn)
                assert count == total, (name, count, total)
                times[name].append(seconds)
        med = {k: statistics.median(v) for k, v in times.items()}
        rows.append({"concurrency": c, **{f"{k}_s": v for k, v in med.items()}, "samples": total})
        print(row_line(rows[-1], total * args.max_new_tokens), flush=True)
    return rows


def bench_weight_sync(engine, model_dir: Path) -> list[tuple[str, float, float]]:
    import torch
    from safetensors.torch import load_file
    from tidal.rollout import update_weights_from_tensor

    tensors = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        tensors.update(load_file(path))
    mb = sum(t.numel() * t.element_size() for t in tensors.values()) / 2**20
    out = []
    start = time.perf_counter()
    engine.update_weights_from_disk(model_dir, weight_version="bench-disk")
    out.append(("disk (/update_weights_from_disk)", time.perf_counter() - start, mb))
    start = time.perf_counter()
    update_weights_from_tensor(engine, ((k, v.to(torch.float32)) for k, v in tensors.items()), weight_version="t")
    out.append(("tensor (/update_weights_from_tensor)", time.perf_counter() - start, mb))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="HF checkpoint directory (default: build a tiny random Qwen2)")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=8, help="samples per prompt")
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--startup-timeout", type=float, default=900.0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    # SIGTERM (e.g. `kill`) unwinds like Ctrl-C, so that the finally below stops the server.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    from tidal.rollout import SGLangEngine

    with tempfile.TemporaryDirectory(prefix="bench_rollout_") as tmp:
        model = args.model or build_tiny_qwen2(Path(tmp) / "model", hidden=args.hidden, layers=args.layers)
        engine = SGLangEngine(
            model,
            port=free_port(),
            log_dir=Path(tmp) / "logs",
            extra_server_args=["--dtype", "float32"],
            startup_timeout_s=args.startup_timeout,
        )
        start = time.perf_counter()
        engine.start()
        startup = time.perf_counter() - start
        try:
            rows = bench_generation(engine, args)
            sync = bench_weight_sync(engine, model)
        finally:
            engine.shutdown()
    print(f"\nSGLang server start-up to healthy: {startup:.0f} s\n\n{HEADER}")
    for r in rows:
        print(row_line(r, args.n * args.prompts * args.max_new_tokens))
    print("\n| weight update | seconds | MB | ms per MB |\n|---|---|---|---|")
    for name, seconds, mb in sync:
        print(f"| {name} | {seconds:.3f} | {mb:.1f} | {1000 * seconds / mb:.1f} |")


if __name__ == "__main__":
    main()
