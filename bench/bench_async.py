"""Asynchronous training (issue 20): wall time to +25 points of held-out accuracy for --max-staleness K = 0, 1, 2.

Each run is the embedded default in decoupled mode (``--no-colocate --rollout-num-gpus 1``: the actor and the engine
on their own logical GPUs), one run per K, in its own folder. From each run's ``metrics.jsonl`` and ``summary.json``:

- the trainer's time (sum of ``time/rollout``: waiting, training, syncing; not evaluating or checkpointing) until an
  evaluation first reaches the accuracy before RL + ``--gain`` points (None when no evaluation does);
- the RL wall time (``summary.json``: the whole loop, evaluations and checkpoints included);
- the trainer's idle share: ``time/trainer_wait`` (waiting for a rollout) over the RL wall time;
- the engines' idle share: ``time/engine_wait`` (between one rollout's generation and the next) over the wall time.

On a CPU box the engine and the actor share the cores, so overlap cannot speed much up there; the idle shares are
what a machine with separate rollout GPUs turns into speed (the engines' idle time under K = 0 is the time K >= 1
hides). The numbers go to stdout as one JSON line per run, and to ``--out/results.json``. Runs with K >= 1 train
with the off-policy correction (``--use-tis``), on by default there; ``-- --no-use-tis`` runs them without it.

    uv run python bench/bench_async.py                                  # 150 rollouts x 3 runs: over an hour
    uv run python bench/bench_async.py --num-rollout 20 --eval-interval 5 --stalenesses 0 1
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

DECOUPLED = ["--no-colocate", "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1"]


def run_one(k: int, out: Path, args: argparse.Namespace) -> dict:
    """One ``train`` run with ``--max-staleness k``; its figures."""
    cmd = [sys.executable, "-m", "tidal.train.cli", *DECOUPLED, "--max-staleness", str(k), "--output-dir", str(out)]
    cmd += ["--num-rollout", str(args.num_rollout), "--eval-interval", str(args.eval_interval), *args.extra]
    tick = time.monotonic()
    with (out.parent / f"{out.name}.log").open("w") as log:
        code = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=args.timeout_s)
    wall = time.monotonic() - tick
    if code != 0:
        return {"max_staleness": k, "exit_code": code, "log": str(out.parent / f"{out.name}.log")}
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((out / "summary.json").read_text())
    return {"max_staleness": k, "command": " ".join(cmd[1:]), "process_wall_s": round(wall, 1)} | figures(
        records, summary["eval_before"], summary["rl_wall_s"], args.gain
    )


def figures(records: list[dict], eval_before: float, total: float, gain: float) -> dict:
    """Time to ``eval_before + gain``, idle shares (of ``total`` s of RL wall time) and staleness of one run."""
    elapsed, reached = 0.0, None
    for r in records:
        elapsed += r["time/rollout"]
        if reached is None and r.get("eval/accuracy", -1.0) >= eval_before + gain:
            reached = {"rollout": r["rollout"], "trainer_s": round(elapsed, 1), "accuracy": r["eval/accuracy"]}
    return {
        "eval_before": eval_before,
        "eval_last": next((r["eval/accuracy"] for r in reversed(records) if "eval/accuracy" in r), None),
        f"first_reached_plus_{round(gain * 100)}_points": reached,
        "rl_wall_s": round(total, 1),
        "trainer_idle_share": round(sum(r["time/trainer_wait"] for r in records) / total, 3),
        "engine_idle_share": round(sum(r["time/engine_wait"] for r in records) / total, 3),
        "staleness_max": max(r["rollout/staleness_max"] for r in records),
        "staleness_mean": round(sum(r["rollout/staleness_mean"] for r in records) / len(records), 3),
        "stale_tokens_masked": sum(r.get("rollout/stale_tokens_masked", 0.0) for r in records),
    }


def main() -> None:
    """Run K = 0, 1, 2 (or --stalenesses) one after another and print one JSON line each."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stalenesses", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--num-rollout", type=int, default=150)
    parser.add_argument("--eval-interval", type=int, default=10)
    parser.add_argument("--gain", type=float, default=0.25, help="accuracy gain to reach (0.25: +25 points)")
    parser.add_argument("--timeout-s", type=float, default=7200)
    parser.add_argument("--out", type=Path, default=Path("/tmp/bench_async"))
    parser.add_argument("extra", nargs="*", help="more `train` flags, after --")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for k in args.stalenesses:
        result = run_one(k, args.out / f"k{k}", args)
        print(json.dumps(result), flush=True)
        results.append(result)
    (args.out / "results.json").write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
