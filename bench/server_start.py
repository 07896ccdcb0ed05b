"""SGLang server start-up: seconds from launch to a healthy ``/health``, by phase, and what it then generates.

Starts tidal's own ``SGLangEngine`` (the exact command and environment `train` uses: CPU flags and the
``sgl_kernel`` stand-in when there is no CUDA) ``--repeats`` times in a row on the embedded model (or ``--model``),
each time timing launch -> healthy and reading the phases off the server log (1 s resolution):

- ``main imports``: launch -> SGLang prints its ``server_args`` (the launcher process has imported SGLang);
- ``worker imports``: -> ``Init parallel begin`` (the spawned scheduler has imported SGLang again);
- ``model + KV``: -> ``KV Cache is allocated`` (model classes imported, weights loaded, KV pool);
- ``HTTP up``: -> ``Uvicorn running``;
- ``warmup + health``: -> healthy (SGLang's warm-up request, then tidal's poll).

After each start it sends one greedy ``/generate`` with log-probs and writes the tokens and log-probs to
``--out`` (JSON), so two runs (before / after a change) can be compared for identical output:

    uv run python bench/server_start.py --repeats 2 --out /tmp/start_after.json
    uv run python bench/server_start.py --compare /tmp/start_before.json /tmp/start_after.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import os
import re
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

PHASES = (
    ("main imports", "server_args="),
    ("worker imports", "Init parallel begin"),
    ("model + KV", "KV Cache is allocated"),
    ("HTTP up", "Uvicorn running"),
)
_STAMP = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)\] ")
PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _default_model() -> Path:
    found = sorted((Path.home() / ".cache" / "tidal").glob("embedded-*/config.json"))
    if not found:
        sys.exit("no embedded model in ~/.cache/tidal; run `uv run train` once or pass --model DIR")
    return found[-1].parent


def _phases(log: Path, launched: float, healthy_s: float) -> dict[str, float]:
    """Seconds from launch to each phase's first log line (the log's clock has 1 s resolution)."""
    seen: dict[str, float] = {}
    for line in log.read_text(errors="replace").splitlines():
        m = _STAMP.match(line)
        if not m:
            continue
        t = dt.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S").timestamp()
        for name, marker in PHASES:
            if name not in seen and marker in line:
                seen[name] = t - launched
    seen["healthy"] = healthy_s
    return seen


def group_cpu_s(pgid: int) -> float:
    """CPU seconds (user + system) used so far by the live processes of process group ``pgid``.

    Unlike the wall clock this hardly moves with the load of a shared machine, so it compares starts made at
    different times.
    """
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:  # fields after the command: state ppid pgrp ... utime(11) stime(12)
            total += int(fields[11]) + int(fields[12])
    return total / tick


def one_start(model: Path, log_dir: Path, extra_args: list[str], env: dict[str, str]) -> dict:
    from tidal.rollout import SGLangEngine

    engine = SGLangEngine(model, port=_free_port(), log_dir=log_dir, extra_server_args=extra_args, env=env)
    launched = time.time()
    t0 = time.monotonic()
    engine.start()
    healthy_s = time.monotonic() - t0
    cpu_s = group_cpu_s(engine.pid)
    try:
        params = {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}
        out = engine.generate(PROMPTS, params)
        tokens = [o["output_ids"] for o in out]
        logprobs = [o["output_log_probs"] for o in out]
    finally:
        engine.shutdown()
    return {
        "healthy_s": healthy_s,
        "cpu_s": cpu_s,
        "phases": _phases(engine.log_path, launched, healthy_s),
        "tokens": tokens,
        "logprobs": logprobs,
    }


def compare(a: Path, b: Path) -> int:
    ra, rb = json.loads(a.read_text()), json.loads(b.read_text())
    ta, tb = ra["starts"][0], rb["starts"][0]
    same_tokens = ta["tokens"] == tb["tokens"]
    max_diff = max(
        abs(x - y) for la, lb in zip(ta["logprobs"], tb["logprobs"], strict=True) for x, y in zip(la, lb, strict=True)
    )
    print(f"tokens identical: {same_tokens}; max |log-prob difference|: {max_diff:.3g}")
    return 0 if same_tokens and max_diff == 0 else 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=None)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--server-arg", action="append", default=[], help="one extra sglang.launch_server argument")
    p.add_argument("--env", action="append", default=[], help="KEY=VALUE for the server's environment")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--compare", type=Path, nargs=2, default=None)
    a = p.parse_args()
    if a.compare:
        return compare(*a.compare)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    model = a.model or _default_model()
    env = dict(kv.split("=", 1) for kv in a.env)
    starts = []
    with tempfile.TemporaryDirectory(prefix="server_start_") as tmp:
        for i in range(a.repeats):
            r = one_start(model, Path(tmp) / f"run{i}", a.server_arg, env)
            phases = ", ".join(f"{k} {v:.0f}" for k, v in r["phases"].items())
            print(
                f"start {i}: healthy after {r['healthy_s']:.1f} s, {r['cpu_s']:.1f} CPU s; at s: {phases}", flush=True
            )
            starts.append(r)
    healthy = [r["healthy_s"] for r in starts]
    cpu = [r["cpu_s"] for r in starts]
    each = "; ".join(f"{h:.1f} s / CPU {c:.1f} s" for h, c in zip(healthy, cpu, strict=True))
    print(
        f"median over {len(starts)} starts: healthy after {statistics.median(healthy):.1f} s, "
        f"CPU {statistics.median(cpu):.1f} s (each: {each})"
    )
    if a.out:
        a.out.write_text(json.dumps({"model": str(model), "server_args": a.server_arg, "env": env, "starts": starts}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
