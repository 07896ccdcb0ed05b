"""Soak: the embedded default's first N rollouts, M times back to back, each in a fresh folder; report failures.

Each run is the README's command, ``uv run train``, cut to ``--num-rollout N`` (so its last rollout also evaluates
and checkpoints), in its own ``--output-dir``. A run fails when it exits non-zero, its ``metrics.jsonl`` does not
hold rollouts 0..N-1 exactly once, or a process of it is still alive 30 s after it ended. The log of a failed run
is kept and its last lines printed.

    uv run python bench/soak.py                      # 40 rollouts x 5 runs: ~25 min on two shared cores
    uv run python bench/soak.py --rollouts 10 --runs 2
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from chaos import _alive, _children  # the same /proc bookkeeping (this process is a subreaper there too)


def _leftovers(before: set[int], grace_s: float = 30.0) -> list[str]:
    """Command lines of new children (orphans re-parented here) still alive after ``grace_s``; they are killed."""
    deadline = time.monotonic() + grace_s
    while True:
        for pid in _children() - before:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)
        alive = {pid for pid in _children() - before if _alive(pid)}
        if not alive or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    left = []
    for pid in alive:
        with contextlib.suppress(OSError):
            left.append(Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")[:160])
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return left


def soak_run(index: int, root: Path, rollouts: int, timeout_s: float) -> dict:
    """One run of ``train --num-rollout N`` in ``root/run-INDEX``; its outcome."""
    out = root / f"run-{index}"
    log = root / f"run-{index}.log"
    before = _children()
    tick = time.monotonic()
    with log.open("w") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tidal.train.cli", "--num-rollout", str(rollouts), "--output-dir", str(out)],
            stdout=f,
            stderr=subprocess.STDOUT,
        )
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = "timeout"
    wall = time.monotonic() - tick
    left = _leftovers(before)
    metrics = out / "metrics.jsonl"
    records = [json.loads(line)["rollout"] for line in metrics.read_text().splitlines()] if metrics.exists() else []
    summary = json.loads((out / "summary.json").read_text()) if (out / "summary.json").exists() else {}
    problems = []
    if code != 0:
        problems.append(f"exit {code}")
    if records != list(range(rollouts)):
        problems.append(f"metrics rollouts {records[:3]}...{records[-3:]} ({len(records)})")
    if left:
        problems.append(f"left running: {left}")
    return {
        "run": index,
        "ok": not problems,
        "problems": problems,
        "wall_s": round(wall, 1),
        "eval_before": summary.get("eval_before"),
        "eval_after": summary.get("eval_after"),
        "log": str(log),
    }


def main() -> int:
    """Run the soak; print one line per run and a summary; exit 1 if any run failed."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rollouts", type=int, default=40, help="rollouts per run (N)")
    parser.add_argument("--runs", type=int, default=5, help="runs back to back (M)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds one run may take")
    parser.add_argument("--root", type=Path, default=None, help="where the run folders go (default: a temp dir)")
    parser.add_argument("--report", type=Path, default=Path("bench/soak_report.json"))
    cli = parser.parse_args()
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER: a run's orphans come here, to be counted
    root = cli.root or Path(tempfile.mkdtemp(prefix="tidal-soak-"))
    root.mkdir(parents=True, exist_ok=True)
    results = []
    for index in range(cli.runs):
        result = soak_run(index, root, cli.rollouts, cli.timeout)
        results.append(result)
        print(json.dumps(result), flush=True)
        if not result["ok"]:
            print(Path(result["log"]).read_text()[-4000:], flush=True)
    failures = sum(not r["ok"] for r in results)
    walls = [r["wall_s"] for r in results]
    print(f"{failures} failure(s) in {len(results)} runs of {cli.rollouts} rollouts; wall {min(walls)}-{max(walls)} s")
    cli.report.write_text(json.dumps({"root": str(root), "rollouts": cli.rollouts, "results": results}, indent=1))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
