"""Chaos: SIGKILL a `train` run at six points, resume it with --load, check nothing was lost, repeated or left.

Each point is a phase of a rollout and a process to kill when that phase starts:

    generation  -> the SGLang server   (its engine dies under /generate; the run must stop, not hang)
    training    -> actor rank 0        (the Megatron worker dies in log-probs / optimizer steps)
    weight_sync -> the driver          (the HF weights for the engine half written)
    checkpoint  -> the driver          (the actor may still finish and publish the save it was given)
    checkpoint_writer -> actor rank 0  (a Megatron checkpoint half written: the resume takes the one before)
    evaluation  -> the driver          (held-out evaluation in flight)

For each point: run A (``--num-rollout N --save-interval 1 --save-debug-rollout-data``) is killed when phase P of
rollout K begins (``--kill-rollout``); then run B, the same command plus ``--load OUT/ckpt``. Checks:

- A's processes are all gone within 30 s of the kill (Ray, SGLang, actor ranks: none re-parented and left);
- B exits 0, says "resumed from", and its checkpoint tracker names iteration N (the checkpoint loads);
- ``metrics.jsonl`` holds rollouts 0..N-1 exactly once each (none lost, none repeated);
- every rollout's prompts (saved samples) equal the batch an uninterrupted run draws for it;
- B's processes are all gone after it.

Phases are seen by running the driver through this file (``--driver``), which wraps the phase methods of the
rollout manager and the actor group (and tidal.train.loop's checkpoint step) to append one line per phase start to
``OUT/phases.txt`` before calling the real ``train`` entry point
(the code under test is unchanged), and kills the target 20 ms into the chosen phase from a timer thread (phases of
the tiny model last 0.1-0.5 s: a poll from outside would miss them); it notes what was on disk at the kill.
The runs that do not kill the server attach to one shared SGLang server started here
(``--rollout-external-engine-addrs``, saves a ~80 s start-up per run); the generation point launches its own.

    uv run python bench/chaos.py                       # all six points, ~30-40 min on two shared cores
    uv run python bench/chaos.py --points checkpoint   # one point
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

POINTS = {  # point -> (phase, whom to kill)
    "generation": ("generation", "sglang"),
    "training": ("training", "actor"),
    "weight_sync": ("weight_sync", "driver"),
    "checkpoint": ("checkpoint", "driver"),
    "checkpoint_writer": ("checkpoint", "actor"),
    "evaluation": ("evaluation", "driver"),
}
COMMON = [
    "--rollout-batch-size", "4",
    "--n-samples-per-prompt", "4",
    "--rollout-max-response-len", "6",
    "--num-eval-prompts", "8",
    "--eval-interval", "1",
    "--lr", "1e-4",
    "--save-interval", "1",
]  # fmt: skip


# --- the driver, run as `python bench/chaos.py --driver OUT ARGS...` -------------------------------------------


KILL_DELAY_S = 0.02
"""How far into the phase the kill lands: phases of the tiny model last 0.1-0.5 s on two cores."""


def run_driver(phases: Path, argv: list[str]) -> int:
    """The real `train` entry point, with each phase's start appended to ``phases`` as it happens.

    ``TIDAL_CHAOS_KILL=phase:occurrence:target`` SIGKILLs the target ``KILL_DELAY_S`` into that occurrence of the
    phase, from a timer thread of this process (so the kill cannot miss a phase shorter than a poll interval).
    """
    import tidal.train.loop as loop
    from tidal.train.actor_group import ActorGroup
    from tidal.train.cli import main
    from tidal.train.rollout_manager import RolloutManager

    plan = os.environ.get("TIDAL_CHAOS_KILL", "").split(":")
    counts: dict[str, int] = {}

    def marked(name: str, fn):
        def wrapper(*args, **kwargs):
            counts[name] = counts.get(name, 0) + 1
            with phases.open("a") as f:
                f.write(f"{name}\n")
            if plan[0] == name and counts[name] == int(plan[1]):
                threading.Timer(KILL_DELAY_S, _kill_target, (plan[2], phases)).start()
            return fn(*args, **kwargs)

        return wrapper

    RolloutManager.generate = marked("generation", RolloutManager.generate)
    RolloutManager.evaluate = marked("evaluation", RolloutManager.evaluate)
    ActorGroup.sync_weights = marked("weight_sync", ActorGroup.sync_weights)
    loop._save = marked("checkpoint", loop._save)
    ActorGroup.train = marked("training", ActorGroup.train)
    return main(argv)


def _kill_target(target: str, phases: Path) -> None:
    """SIGKILL the driver (this process), actor rank 0 or the SGLang server; note it, and the run folder then."""
    pid = _target_pid(os.getpid(), target)
    out = phases.parent
    tracker = out / "ckpt" / "latest_checkpointed_iteration.txt"
    state = {
        "time": time.time(),
        "tracker": tracker.read_text().strip() if tracker.exists() else None,
        "ckpt": sorted(p.name for p in (out / "ckpt").iterdir()) if (out / "ckpt").is_dir() else [],
        "weights": sorted(p.name for p in (out / "weights").iterdir()) if (out / "weights").is_dir() else [],
    }
    with phases.open("a") as f:
        f.write(f"KILL {target} {pid} {json.dumps(state)}\n")
    if pid is not None:
        os.kill(pid, signal.SIGKILL)


# --- process bookkeeping (this process is a child subreaper: orphans of a run come here) -------------------------


def _children() -> set[int]:
    kids: set[int] = set()
    for task in Path(f"/proc/{os.getpid()}/task").iterdir():
        kids |= {int(p) for p in (task / "children").read_text().split()}
    return kids


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ").strip()
    except OSError:
        return ""


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError):
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(entry.name))
    found, stack = [], [root]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found


def _leftovers(before: set[int], grace_s: float = 30.0) -> tuple[dict[int, str], float]:
    """New children still alive after ``grace_s`` (polled), and how long it took until none was."""
    start = time.monotonic()
    while True:
        for pid in _children() - before:  # reap zombies re-parented here
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)
        alive = {pid for pid in _children() - before if _alive(pid)}
        if not alive or time.monotonic() - start > grace_s:
            return {pid: _cmdline(pid)[:160] for pid in alive}, time.monotonic() - start
        time.sleep(0.2)


def _kill_all(before: set[int]) -> None:
    for _ in range(50):
        alive = {pid for pid in _children() - before if _alive(pid)}
        if not alive:
            return
        for pid in alive:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.2)


def _target_pid(driver: int, target: str) -> int | None:
    if target == "driver":
        return driver
    pattern = {"sglang": "sglang.launch_server", "actor": "ray::ActorWorker"}[target]
    for pid in _descendants(driver):
        if pattern in _cmdline(pid):
            return pid
    return None


# --- one point ----------------------------------------------------------------------------------------------------


def _train(out: Path, args: list[str], log: Path, *, kill: tuple[str, int, str] | None, timeout_s: float) -> dict:
    """Run the driver; with ``kill=(phase, occurrence, target)`` it SIGKILLs the target when that phase starts."""
    phases = out / "phases.txt"
    phases.unlink(missing_ok=True)
    before = _children()
    env = dict(os.environ)
    env.pop("TIDAL_CHAOS_KILL", None)
    if kill is not None:
        env["TIDAL_CHAOS_KILL"] = ":".join(map(str, kill))
    result: dict = {"killed": None}
    with log.open("w") as f:
        proc = subprocess.Popen(
            [sys.executable, __file__, "--driver", str(phases), *args, "--output-dir", str(out)],
            stdout=f,
            stderr=subprocess.STDOUT,
            env=env,
        )
        try:
            result["code"] = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            result["hung"] = True
            proc.kill()
            result["code"] = proc.wait(timeout=60)
    ended = time.time()
    lines = phases.read_text().splitlines() if phases.exists() else []
    kills = [line.split(" ", 3) for line in lines if line.startswith("KILL ")]
    if kills:
        _, target, pid, state = kills[0]
        at_kill = json.loads(state)
        result["killed"] = {"target": target, "pid": None if pid == "None" else int(pid), "at_kill": at_kill}
        result["driver_exit_after_kill_s"] = round(ended - at_kill.pop("time"), 1)
    left, settle = _leftovers(before)
    result["leftovers"], result["settle_s"] = left, round(settle, 1)  # from the driver's exit until none is left
    _kill_all(before)
    return result


def _records(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def _prompts_match(out: Path, num_rollout: int) -> bool:
    from tidal.rollout import load_rollout_data
    from tidal.train.cli import parse_job
    from tidal.train.data import PromptDataset
    from transformers import AutoTokenizer

    job = parse_job(["--output-dir", str(out / "_parse_only"), *COMMON])
    tokenizer = AutoTokenizer.from_pretrained(job.actor.hf_checkpoint)
    data = PromptDataset(job.train.prompt_data, tokenizer, input_key="prompt", label_key="label", seed=job.train.seed)
    for rollout_id in range(num_rollout):
        samples = load_rollout_data(out / "debug", rollout_id)
        expected = [list(p.ids) for p in data.batch(rollout_id, 4) for _ in range(4)]
        if [list(s.prompt_ids) for s in samples] != expected:
            return False
    return True


def run_point(point: str, root: Path, *, num_rollout: int, kill_rollout: int, external: str | None) -> dict:
    """Kill run A at ``point`` of rollout ``kill_rollout``, resume it as run B, and check the outcome."""
    phase, target = POINTS[point]
    out = root / point
    args = [*COMMON, "--num-rollout", str(num_rollout), "--save-debug-rollout-data", str(out / "debug")]
    shared = ["--rollout-external-engine-addrs", external] if external else []
    # Occurrence of the phase that belongs to rollout `kill_rollout`: evaluation also runs once before RL.
    occurrence = kill_rollout + 1 + (phase == "evaluation")
    a_args = args if target == "sglang" else [*args, *shared]
    tick = time.monotonic()
    a = _train(out, a_args, root / f"{point}-A.log", kill=(phase, occurrence, target), timeout_s=900)
    b = _train(out, [*args, *shared, "--load", str(out / "ckpt")], root / f"{point}-B.log", kill=None, timeout_s=900)
    b_log = (root / f"{point}-B.log").read_text()
    records = [r["rollout"] for r in _records(out)]
    tracker = out / "ckpt" / "latest_checkpointed_iteration.txt"
    checks = {
        "killed": a["killed"] is not None and a["killed"]["pid"] is not None,  # the target existed at the point
        "a_gone_30s": not a["leftovers"],  # nothing of run A left 30 s after the kill
        "resumed": b["code"] == 0 and "resumed from" in b_log,  # the checkpoint loaded
        "tracker_n": tracker.exists() and tracker.read_text().strip() == str(num_rollout),
        "rollouts_once": records == list(range(num_rollout)),  # none lost, none repeated
        "prompts": b["code"] == 0 and _prompts_match(out, num_rollout),  # as an uninterrupted run's
        "b_gone": not b["leftovers"],
    }
    return {
        "point": point,
        "target": target,
        "ok": all(checks.values()),
        "checks": checks,
        "A": a,
        "B": {k: v for k, v in b.items() if k != "killed"},
        "rollouts": records,
        "wall_s": round(time.monotonic() - tick, 1),
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    """Run the chosen points; print and save a JSON report."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--points", nargs="+", choices=list(POINTS), default=list(POINTS))
    parser.add_argument("--num-rollout", type=int, default=4)
    parser.add_argument("--kill-rollout", type=int, default=2, help="rollout (0-based) whose phase is hit")
    parser.add_argument("--root", type=Path, default=None, help="where the runs go (default: a temp dir)")
    parser.add_argument("--report", type=Path, default=Path("bench/chaos_report.json"))
    cli = parser.parse_args()
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER: a run's orphans come to us, to be counted
    root = cli.root or Path(tempfile.mkdtemp(prefix="tidal-chaos-"))
    root.mkdir(parents=True, exist_ok=True)
    external = None
    server = None
    if any(POINTS[p][1] != "sglang" for p in cli.points):
        from tidal.rollout import SGLangEngine
        from tidal.train.embedded_model import ensure_embedded_model

        port = _free_port()
        server = SGLangEngine(
            ensure_embedded_model(),
            port=port,
            nccl_port=_free_port(),
            log_dir=root / "shared_sglang",
            extra_server_args=("--dtype", "float32"),
            startup_timeout_s=900,
        )
        server.start(wait=True)
        external = f"127.0.0.1:{port}"
    results = []
    try:
        for point in cli.points:
            result = run_point(
                point, root, num_rollout=cli.num_rollout, kill_rollout=cli.kill_rollout, external=external
            )
            results.append(result)
            print(json.dumps(result, indent=1), flush=True)
    finally:
        if server is not None:
            server.shutdown()
    cli.report.write_text(json.dumps({"root": str(root), "results": results}, indent=1) + "\n")
    print(
        "\n| point | killed | tracker at kill | A exit (s after kill) | A left after 30 s | resumed | tracker | "
        "rollouts once | prompts | B left | ok |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        c, a = r["checks"], r["A"]
        at_kill = (a["killed"] or {}).get("at_kill", {})
        cells = [r["point"], r["target"], at_kill.get("tracker"), f"{a['code']} ({a.get('driver_exit_after_kill_s')})"]
        cells += [len(a["leftovers"]), c["resumed"], c["tracker_n"], c["rollouts_once"], c["prompts"]]
        cells += [len(r["B"]["leftovers"]), "PASS" if r["ok"] else "FAIL"]
        print("| " + " | ".join(map(str, cells)) + " |")
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    if sys.argv[1:2] == ["--driver"]:
        sys.exit(run_driver(Path(sys.argv[2]), sys.argv[3:]))
    sys.exit(main())
