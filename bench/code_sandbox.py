"""What `--rm-type code` costs: a sandboxed test case's wall time, and a batch's at each concurrency.

    uv run python bench/code_sandbox.py --samples 64 --cases 2 --concurrency 1 2 4 8

Each sample is a correct a+b program with ``--cases`` stdin/stdout cases (the cheapest real program: what remains
is the sandbox's own cost); prints one JSON line per concurrency.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from tidal.rollout import RolloutConfig, Sample, resolve_reward_fn, rollout_metrics, score_samples

PROGRAM = "```python\nimport sys\na, b = map(int, sys.stdin.read().split())\nprint(a + b)\n```"


def main() -> None:
    """Score the batch at each concurrency and print its figures."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--cases", type=int, default=2)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8])
    args = parser.parse_args()
    tests = {"inputs": [f"{i} {i}\n" for i in range(args.cases)], "outputs": [f"{2 * i}\n" for i in range(args.cases)]}
    samples = [
        Sample(prompt_ids=[1], response_ids=[2], response_log_probs=[0.0], finish_reason="stop", label=tests,
               response_text=PROGRAM, group_index=g)
        for g in range(args.samples)
    ]  # fmt: skip
    for concurrency in args.concurrency:
        reward = resolve_reward_fn("code", RolloutConfig(rm_type="code", code_sandbox_max_concurrency=concurrency))
        start = time.monotonic()
        scored = score_samples(samples, reward)
        wall = time.monotonic() - start
        metrics = rollout_metrics(scored)
        runs = args.samples * args.cases
        case_ms = 1000 * metrics["rollout/code/sandbox_s"] / runs
        print(json.dumps({
            "concurrency": concurrency, "samples": args.samples, "cases": runs, "wall_s": round(wall, 2),
            "cases_per_s": round(runs / wall, 1), "case_ms_mean": round(case_ms, 1),
            "reward_mean": statistics.fmean(s.reward for s in scored),
        }))  # fmt: skip


if __name__ == "__main__":
    main()
