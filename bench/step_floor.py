"""The floor of one rollout of `uv run train`: the same model, samples and machine, with no framework around them.

In one process, on the job the flags describe (the embedded recipe by default), it times

- generation: ONE batched ``/generate`` of all the rollout's samples (``rollout_batch_size x n``) on a real
  SGLang server started as `train` starts it (same server flags); beside it, tidal's own dispatch of the same
  prompts (``generate_samples``: one request per prompt group, the plain path's way);
- the actor's compute: one plain PyTorch step of the HF model on those samples (right-padded batch, all cores):
  forward + backward of the policy-gradient loss + AdamW, and a forward alone (an old-log-prob pass);

and, beside the floor, tidal's own actor (``train_on_rollout``: Megatron-core over gloo, the embedded recipe's
micro-batching) on the same samples with one torch thread or every core, with and without the separate old-log-prob
pass (``--actor-levers``); each the median of ``--repeats`` after one warm-up, variants interleaved. The floor is
generation + training step. The figures go to ``--out`` (default :data:`tidal.train.summary.STEP_FLOOR_FILE`),
where `train` reads them: its ``summary.json`` reports each phase's mean time over the floor's (``vs_floor``) when
the run's shape matches (model, prompts, samples, new tokens, CPU count).

    uv run python bench/step_floor.py                       # the embedded default, ~2 min on two cores
    uv run python bench/step_floor.py --sglang-max-total-tokens 16384   # any train flag
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _median_s(fn, repeats: int) -> tuple[float, list[float]]:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        tick = time.perf_counter()
        fn()
        times.append(time.perf_counter() - tick)
    return statistics.median(times), times


def time_generation(job, model: str, prompt_ids: list[list[int]], repeats: int) -> tuple[dict, list[list[int]]]:
    """One batched /generate of every sample vs tidal's per-group dispatch; the samples' full token lists."""
    from tidal.rollout import SGLangEngine, generate_samples

    params = job.rollout.sampling_params()
    with tempfile.TemporaryDirectory() as logs:
        engine = SGLangEngine.from_config(job.rollout, model, port=_free_port(), nccl_port=_free_port(), log_dir=logs)
        engine.start(wait=True)
        try:
            one, one_all = _median_s(lambda: engine.generate(prompt_ids, params), repeats)
            groups, groups_all = _median_s(
                lambda: generate_samples(engine, prompt_ids, params, progress_every_s=1e9), repeats
            )
            outs = engine.generate(prompt_ids, params)
        finally:
            engine.shutdown()
    n = int(params["n"])
    tokens = [list(prompt_ids[i // n]) + o["output_ids"] for i, o in enumerate(outs)]
    figures = {
        "generate_one_request_s": one,
        "generate_one_request_all_s": one_all,
        "generate_per_group_s": groups,
        "generate_per_group_all_s": groups_all,
        "server_args": list(engine.command()[engine.command().index("--port") + 2 :]),
    }
    return figures, tokens


def time_hf_step(model_dir: str, tokens: list[list[int]], prompt_lens: list[int], lr: float, repeats: int) -> dict:
    """Plain PyTorch, every core: a forward (log-probs) and a forward+backward+AdamW step on the samples."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(os.cpu_count() or 1)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    width = max(map(len, tokens))
    ids = torch.zeros(len(tokens), width, dtype=torch.long)
    attention = torch.zeros(len(tokens), width, dtype=torch.long)
    response = torch.zeros(len(tokens), width - 1)
    for i, (t, p) in enumerate(zip(tokens, prompt_lens, strict=True)):
        ids[i, : len(t)] = torch.tensor(t)
        attention[i, : len(t)] = 1
        response[i, p - 1 : len(t) - 1] = 1.0  # position t predicts token t+1: the response tokens
    advantages = torch.randn(len(tokens), 1)

    def token_log_probs() -> torch.Tensor:
        logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1].float()
        return torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)

    def forward() -> None:
        with torch.no_grad():
            token_log_probs()

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        logp = token_log_probs()
        loss = -(advantages * logp * response).sum() / response.sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()

    fwd, fwd_all = _median_s(forward, repeats)
    train, train_all = _median_s(step, repeats)
    return {
        "forward_s": fwd,
        "forward_all_s": fwd_all,
        "train_step_s": train,
        "train_step_all_s": train_all,
        "real_tokens": sum(map(len, tokens)),
        "padded_tokens": len(tokens) * width,
        "torch_threads": torch.get_num_threads(),
    }


def time_tidal_actor(job, tokens: list[list[int]], prompt_lens: list[int], repeats: int) -> dict:
    """tidal's ``train_on_rollout`` on the samples: threads 1 / every core x old-log-prob pass / reuse, interleaved."""
    import random

    import torch
    from tidal.actor import Actor, init_distributed
    from tidal.actor.trainer import train_on_rollout

    init_distributed(rank=0, world_size=1, master_addr="127.0.0.1", master_port=_free_port(), seed=job.train.seed)
    actor = Actor(job.actor)
    masks = [[0] * p + [1] * (len(t) - p) for t, p in zip(tokens, prompt_lens, strict=True)]
    rng = random.Random(0)
    rewards = [float(rng.random() < 0.3) for _ in tokens]
    cores = os.cpu_count() or 1
    variants = {
        f"actor_threads{t}_{'reuse' if r else 'pass'}": (t, r) for t in sorted({1, cores}) for r in (False, True)
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    for repeat in range(repeats + 1):  # the first round warms up
        for name, (threads, reuse) in variants.items():
            torch.set_num_threads(threads)
            tick = time.perf_counter()
            m = train_on_rollout(actor, job.batching, tokens=tokens, loss_masks=masks, rewards=rewards,
                                 group_size=job.rollout.n_samples_per_prompt, reuse_step_log_probs=reuse)  # fmt: skip
            if repeat:
                times[name].append(time.perf_counter() - tick)
                times[name + "_log_probs"] = [*times.get(name + "_log_probs", []), m["time/log_probs"]]
                times[name + "_train"] = [*times.get(name + "_train", []), m["time/train"]]
    out = {f"{name}_s": statistics.median(v) for name, v in times.items()}
    out["actor_micro_batches"] = m["batching/num_micro_batches"]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--actor-levers", action="store_true", help="also time tidal's actor (threads x reuse)")
    parser.add_argument("--skip-engine", help="a floor JSON whose generation figures and samples to reuse")
    parser.add_argument("--out", default=None, help="JSON file (default: where `train` reads the floor)")
    args, train_flags = parser.parse_known_args(argv)
    logging.basicConfig(level=logging.INFO, format="[step_floor] %(asctime)s %(message)s", datefmt="%H:%M:%S")
    from tidal.train.cli import parse_job
    from tidal.train.data import PromptDataset
    from tidal.train.summary import STEP_FLOOR_FILE, floor_key
    from transformers import AutoTokenizer

    job = parse_job(train_flags)
    if job.train.hf_checkpoint is None:  # the embedded model: built on first use, as `train` does
        from tidal.train.embedded_model import ensure_embedded_model

        ensure_embedded_model()
    model = job.actor.hf_checkpoint
    tokenizer = AutoTokenizer.from_pretrained(model)
    data = PromptDataset(job.train.prompt_data, tokenizer, input_key=job.train.input_key,
                         label_key=job.train.label_key, seed=job.train.seed)  # fmt: skip
    prompts = [list(p.ids) for p in data.batch(0, job.batching.rollout_batch_size)]
    n = job.rollout.n_samples_per_prompt
    if args.skip_engine:
        old = json.loads(Path(args.skip_engine).read_text())
        generation = {k: v for k, v in old.items() if k.startswith("generate") or k == "server_args"}
        tokens = old["tokens"]
    else:
        generation, tokens = time_generation(job, model, prompts, args.repeats)
    prompt_lens = [len(prompts[i // n]) for i in range(len(tokens))]
    step = time_hf_step(model, tokens, prompt_lens, job.actor.lr, args.repeats)
    if args.actor_levers:
        step |= time_tidal_actor(job, tokens, prompt_lens, args.repeats)
    figures = {
        "key": floor_key(job),
        "floor_s": generation["generate_one_request_s"] + step["train_step_s"],
        **generation,
        **step,
        "num_samples": len(tokens),
        "cpu": os.cpu_count(),
        "load_average": os.getloadavg(),
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "tokens": tokens,
        "command": " ".join(["uv run python bench/step_floor.py", *(argv if argv is not None else sys.argv[1:])]),
    }
    out = Path(args.out) if args.out else STEP_FLOOR_FILE
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(figures, indent=2) + "\n")
    short = {k: round(v, 3) for k, v in figures.items() if isinstance(v, float) and not k.endswith("_all_s")}
    logging.info("floor %s -> %s", short, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
