"""Grid search of the embedded task's RL recipe, in-process with Hugging Face transformers (GPU or CPU).

Diagnostic for issue 10 ("RL must raise held-out accuracy"): each variant builds the embedded model
(tokenizer + Qwen2 + supervised warm start, the same code as `tidal.train.embedded_model`), then runs plain
GRPO (one on-policy step per rollout, per-sample mean loss, group std normalisation, AdamW, clip 1.0, logits
divided by the sampling temperature, as tidal's actor does) and records held-out greedy accuracy over time.
It chooses the defaults of `uv run train`; the real stack then has to reproduce the gain (bench/RESULTS.md).

    PYTHONPATH=apps/train/src python bench/rl_recipe_grid.py --out DIR [--device cuda] [--variants a,b]
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

import torch


def pad_record(r):
    a, b = r["prompt"][:-1].split("+")
    return {"prompt": f"{int(a):02d}+{int(b):02d}=", "label": f"{int(r['label']):03d}"}


def rev_record(r):
    return {"prompt": r["prompt"], "label": r["label"][::-1]}


FORMATS = {"plain": lambda r: r, "pad": pad_record, "rev": rev_record}


def build(spec, fmt, device):
    """The embedded model exactly as `tidal.train.embedded_model` builds it, warm-started on ``device``."""
    import tidal.train.embedded_model as em
    from tidal.train.task_data import EVAL_FILE, TRAIN_FILE, read_jsonl, shipped_path

    train = [FORMATS[fmt](r) for r in read_jsonl(shipped_path(TRAIN_FILE))]
    held = [FORMATS[fmt](r) for r in read_jsonl(shipped_path(EVAL_FILE))]
    tok = em.build_tokenizer([r["prompt"] + r["label"] for r in train])
    t0 = time.time()
    model = em.new_model(tok, spec).to(device)
    em.warm_start(model, tok, train, spec)
    model.eval()
    return model, tok, train, held, time.time() - t0


def generate(model, tok, recs, n, temp, device, maxlen=8):
    eos = tok.eos_token_id
    prompts = [tok.encode(r["prompt"]) for r in recs for _ in range(n)]
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), eos)
    att = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        att[i, width - len(p) :] = 1
    kw = {"do_sample": True, "temperature": temp, "top_k": 0, "top_p": 1.0} if temp > 0 else {"do_sample": False}
    with torch.no_grad():
        out = model.generate(
            input_ids=ids.to(device),
            attention_mask=att.to(device),
            max_new_tokens=maxlen,
            pad_token_id=eos,
            eos_token_id=eos,
            **kw,
        ).cpu()
    res = []
    for i, p in enumerate(prompts):
        r = out[i, width:].tolist()
        if eos in r:
            r = r[: r.index(eos) + 1]
        res.append((p, r))
    return res


def reward(tok, resp, label):
    return float(tok.decode([t for t in resp if t != tok.eos_token_id]).strip() == label)


def digit_reward(tok, resp, label):
    """Exact answer 1.0; otherwise the share of answer digits in the right place, halved."""
    text = tok.decode([t for t in resp if t != tok.eos_token_id]).strip()
    if text == label:
        return 1.0
    return 0.5 * sum(a == b for a, b in zip(text, label, strict=False)) / len(label) if len(text) == len(label) else 0.0


def evaluate(model, tok, held, device):
    from tidal.train.embedded_model import greedy_accuracy

    return greedy_accuracy(model, tok, held)


def grpo(model, tok, train, held, v, device, log):
    opt = torch.optim.AdamW(model.parameters(), lr=v["lr"], weight_decay=0.0, betas=(0.9, 0.98))
    g = torch.Generator().manual_seed(1)
    eos = tok.eos_token_id
    n, temp = v["n"], v["temp"]
    for it in range(v["iters"]):
        recs = [train[i] for i in torch.randint(len(train), (v["prompts"],), generator=g).tolist()]
        model.eval()
        res = generate(model, tok, recs, n, temp, device)
        score = digit_reward if v.get("digit_credit") else reward
        rw = torch.tensor([score(tok, r, recs[i // n]["label"]) for i, (_, r) in enumerate(res)]).view(-1, n)
        adv = rw - rw.mean(1, keepdim=True)
        if v.get("std", True):
            adv = adv / (rw.std(1, keepdim=True) + 1e-6)
        if v.get("posonly"):
            adv = adv.clamp(min=0)
        adv = adv.flatten().to(device)
        for group in opt.param_groups:
            group["lr"] = v["lr"] * min(1.0, (it + 1) / v.get("warmup", 1))
        model.train()
        seqs = [p + r for p, r in res]
        width = max(map(len, seqs))
        ids = torch.full((len(seqs), width), eos)
        mask = torch.zeros(len(seqs), width)
        for i, (p, r) in enumerate(res):
            ids[i, : len(p) + len(r)] = torch.tensor(p + r)
            mask[i, len(p) : len(p) + len(r)] = 1
        ids, mask = ids.to(device), mask.to(device)
        logits = model(input_ids=ids).logits[:, :-1].float() / temp
        lp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]
        m = mask[:, 1:]
        loss = -((lp * m).sum(1) / m.sum(1).clamp(min=1) * adv).mean()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if (it + 1) % v["eval_every"] == 0:
            log({"iter": it + 1, "train_reward": float(rw.mean()), "held_out": evaluate(model, tok, held, device)})


def run_variant(name, v, device, out):
    from tidal.train.embedded_model import EmbeddedModelSpec

    # The recorded grid warm-started for a fixed number of steps: no early stop unless a variant asks for one.
    spec = replace(EmbeddedModelSpec(), **{"sft_target_accuracy": 1.0, **v.get("spec", {})})
    torch.set_num_threads(1)
    lines = []

    def log(rec):
        rec = {"variant": name, "t": round(time.time() - start, 1), **rec}
        lines.append(rec)
        with open(out / f"{name}.jsonl", "a") as f:
            f.write(json.dumps(rec) + "\n")

    out.mkdir(parents=True, exist_ok=True)
    start = time.time()
    model, tok, train, held, sft_s = build(spec, v["fmt"], device)
    res = generate(model, tok, held[:64], 8, v["temp"], device)
    sampled = sum(reward(tok, r, held[i // 8]["label"]) for i, (_, r) in enumerate(res)) / len(res)
    log(
        {
            "iter": 0,
            "sft_s": round(sft_s, 1),
            "held_out": evaluate(model, tok, held, device),
            "sampled": sampled,
            "config": v,
        }
    )
    grpo(model, tok, train, held, v, device, log)


BASE = {"fmt": "plain", "lr": 1e-4, "n": 8, "prompts": 32, "temp": 1.0, "iters": 300, "eval_every": 50}


def grid_broad():
    """Format x warm-start length x learning rate (first look: the warm start groks between 600 and 1500 steps)."""
    grid = {}
    for fmt in ("plain", "pad", "rev"):
        for steps in (600, 1500):
            for lr in (1e-4, 3e-4):
                grid[f"{fmt}-sft{steps}-lr{lr:g}"] = {**BASE, "fmt": fmt, "lr": lr, "spec": {"sft_steps": steps}}
    return grid


def grid_transition():
    """Warm starts inside the supervised phase transition, where RL has the most to gain."""
    grid = {}
    for fmt in ("plain", "pad"):
        for steps in (800, 1000):
            for lr in (3e-4, 1e-3):
                grid[f"{fmt}-sft{steps}-lr{lr:g}"] = {**BASE, "fmt": fmt, "lr": lr, "spec": {"sft_steps": steps}}
    for steps in (700, 900):
        grid[f"plain-sft{steps}-lr1e-3"] = {**BASE, "lr": 1e-3, "spec": {"sft_steps": steps}}
        grid[f"plain-sft{steps}-lr1e-3-p64"] = {**BASE, "lr": 1e-3, "prompts": 64, "spec": {"sft_steps": steps}}
    grid["plain-sft800-lr1e-3-t0.7"] = {**BASE, "lr": 1e-3, "temp": 0.7, "spec": {"sft_steps": 800}}
    grid["plain-sft800-lr3e-3"] = {**BASE, "lr": 3e-3, "spec": {"sft_steps": 800}}
    return grid


def grid_stability():
    """From the 800-step warm start: batch size, learning rate, warm-up, std normalisation, negatives."""
    base = {**BASE, "prompts": 64, "lr": 3e-4, "spec": {"sft_steps": 800}}
    grid = {
        "p64-lr1e-4": {**base, "lr": 1e-4},
        "p64-lr3e-4": base,
        "p64-lr3e-4-warm20": {**base, "warmup": 20},
        "p64-lr3e-4-n16": {**base, "n": 16},
        "p64-lr3e-4-posonly": {**base, "posonly": True},
        "p128-lr1e-4": {**base, "prompts": 128, "lr": 1e-4},
        "p64-lr3e-5": {**base, "lr": 3e-5},
        "p64-lr3e-4-nostd": {**base, "std": False},
        "pad-p64-lr3e-4": {**base, "fmt": "pad"},
        "pad-p64-lr3e-4-warm20": {**base, "fmt": "pad", "warmup": 20},
        "sft600-p64-lr3e-4-warm20": {**base, "warmup": 20, "spec": {"sft_steps": 600}},
        "sft600-p64-lr3e-4-posonly": {**base, "posonly": True, "spec": {"sft_steps": 600}},
    }
    return grid


def grid_format():
    """Fixed-width ("pad") and reversed-answer formats around the 800-step warm start."""
    base = {**BASE, "fmt": "pad", "prompts": 64, "lr": 3e-4, "iters": 400, "spec": {"sft_steps": 800}}
    return {
        "pad-sft800-lr5e-4": {**base, "lr": 5e-4},
        "pad-sft800-lr3e-4-p128": {**base, "prompts": 128},
        "pad-sft800-lr3e-4-digits": {**base, "digit_credit": True},
        "pad-sft700-lr3e-4": {**base, "spec": {"sft_steps": 700}},
        "pad-sft900-lr3e-4": {**base, "spec": {"sft_steps": 900}},
        "pad-sft800-lr3e-4-t1.2": {**base, "temp": 1.2},
        "pad-sft800-lr3e-4": base,
        "pad-sft800-lr3e-4-seed2": {**base, "spec": {"sft_steps": 800, "seed": 2}},
        "rev-sft600-lr3e-4": {**base, "fmt": "rev", "spec": {"sft_steps": 600}},
        "rev-sft800-lr3e-4": {**base, "fmt": "rev"},
        "rev-sft400-lr3e-4": {**base, "fmt": "rev", "spec": {"sft_steps": 400}},
        "pad-sft800-lr3e-4-sft_lr1e-3": {**base, "spec": {"sft_steps": 800, "sft_lr": 1e-3}},
    }


GRIDS = {"broad": grid_broad, "transition": grid_transition, "stability": grid_stability, "format": grid_format}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--variants", default="")
    p.add_argument("--jobs", type=int, default=8)
    p.add_argument("--grid", default="transition", choices=sorted(GRIDS))
    a = p.parse_args()
    grid = GRIDS[a.grid]()
    names = [n for n in grid if not a.variants or n in a.variants.split(",")]
    a.out.mkdir(parents=True, exist_ok=True)
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    with ctx.Pool(a.jobs) as pool:
        pool.starmap(run_variant, [(n, grid[n], a.device, a.out) for n in names])


if __name__ == "__main__":
    main()
