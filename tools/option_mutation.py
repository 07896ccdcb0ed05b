"""Option mutation: each ``train`` option neutralized in turn, and the test named for it run; it must fail.

apps/train/tests/test_option_coverage.py names one test per option (``COVERED``). For each chosen option this
runs that test with ``TIDAL_OPTION_MUTANT`` set (:mod:`tidal.train.option_mutant`): the option's value replaced
by its default where parsed values become configs (or by ``MUTANT_VALUES``'s value where the test already runs
the default). A test that fails on the mutant (or runs past the timeout) kills it; one that still passes lets it
survive: the option could stop working and the suite would not notice.

    uv run python tools/option_mutation.py --since main     # the options whose flag or field a change touches
    uv run python tools/option_mutation.py --all            # every option: the kill rate and the survivors
    uv run python tools/option_mutation.py -- --eps-clip --lr   # only these options
    uv run python tools/option_mutation.py --all --list     # what each option's mutant is and which test runs

Each named test first runs once without a mutant (a test that fails already proves nothing; ``--no-baseline``
skips this). Each run's output is kept in ``--log-dir``. The pass is not part of the suite: a test named for a
``train`` run takes minutes, and the full pass hours.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent
COVERAGE = ROOT / "apps/train/tests/test_option_coverage.py"
ENV = "TIDAL_OPTION_MUTANT"


@dataclass
class Result:
    """One option's mutant and what its named test did with it."""

    option: str
    mutant: str  # the value of TIDAL_OPTION_MUTANT
    test: str  # the pytest id, or "" for an option no test is named for
    status: str = "not run"  # killed | survived | timeout | error | baseline failed | no test named
    seconds: float = 0.0
    log: Path | None = None


def coverage_table() -> ModuleType:
    """test_option_coverage.py, imported as a module (its COVERED, GAPS, MUTANT_VALUES and helpers)."""
    spec = importlib.util.spec_from_file_location("test_option_coverage", COVERAGE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def option_words() -> dict[str, set[str]]:
    """Option -> the words that mean it in a diff: its flag and its config field's name."""
    from tidal.train.flags import options
    from tidal.train.option_mutant import APP_FLAGS

    words = {o.flag: {o.flag, o.name} for o in options()}
    words.update({flag: {flag, flag.removeprefix("--").replace("-", "_")} for flag in APP_FLAGS})
    return words


def touched_options(ref: str, all_options: list[str]) -> list[str]:
    """The options whose flag or config field appears on a changed line of ``git diff ref`` (the working tree)."""
    out = subprocess.run(["git", "diff", "-U0", ref], cwd=ROOT, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"--since {ref}: git diff failed: {out.stderr.strip()}")
    changed = "\n".join(
        line[1:] for line in out.stdout.splitlines() if line[:1] in "+-" and not line.startswith(("+++", "---"))
    )
    words = option_words()

    def appears(word: str) -> bool:
        return re.search(rf"(?<![\w-]){re.escape(word)}(?![\w-])", changed) is not None

    return [o for o in all_options if any(appears(w) for w in words.get(o, {o}))]


def run_test(test: str, mutant: str | None, log: Path, timeout_s: float) -> tuple[str, float]:
    """Run ``test`` (a pytest id) with ``mutant`` set, or none; its output into ``log``; (verdict, seconds).

    The verdict is "passed", "failed" (a test failed, or the mutant broke its collection), "timeout" or "error"
    (pytest found no such test, or failed in itself).
    """
    env = {k: v for k, v in os.environ.items() if k != ENV}
    if mutant is not None:
        env[ENV] = mutant
    cmd = [sys.executable, "-m", "pytest", test, "-x", "-q", "-p", "no:cacheprovider"]
    start = time.monotonic()
    with log.open("w") as out:
        out.write(f"{ENV}={mutant or ''} {' '.join(cmd)}\n")
        out.flush()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the test's own process group: its train runs and servers too
            proc.wait()
            return "timeout", time.monotonic() - start
    verdict = {0: "passed", 1: "failed", 2: "failed"}.get(rc, "error")
    return verdict, time.monotonic() - start


def plan(table: ModuleType, chosen: list[str]) -> list[Result]:
    """One Result per chosen option: its mutant and its named test (none for a listed gap)."""
    return [Result(o, table.mutant_text(o), table.named_test_id(o) if o in table.COVERED else "") for o in chosen]


def run(results: list[Result], log_dir: Path, *, baseline: bool, timeout_s: float) -> None:
    """Run every result's mutant against its test (each test once without a mutant first, when ``baseline``)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    broken: set[str] = set()
    tests = list(dict.fromkeys(r.test for r in results if r.test))
    for i, test in enumerate(tests if baseline else []):
        verdict, seconds = run_test(test, None, log_dir / f"baseline-{i}.log", timeout_s)
        print(f"baseline {verdict:<8} {seconds:6.1f}s  {test}", flush=True)
        if verdict != "passed":
            broken.add(test)
    for r in results:
        if not r.test:
            r.status = "no test named"
        elif r.test in broken:
            r.status = "baseline failed"
        else:
            r.log = log_dir / (re.sub(r"[^\w.-]", "_", r.mutant.lstrip("-")) + ".log")
            verdict, r.seconds = run_test(r.test, r.mutant, r.log, timeout_s)
            r.status = {"failed": "killed", "passed": "survived"}.get(verdict, verdict)
        print(f"{r.status:<15} {r.seconds:6.1f}s  {r.mutant:<40} {r.test}", flush=True)


def report(results: list[Result]) -> float:
    """Print the kill rate over the options with a verdict, and every survivor; return the rate in percent."""
    counted = [r for r in results if r.status in ("killed", "timeout", "survived", "no test named")]
    killed = [r for r in counted if r.status in ("killed", "timeout")]
    survivors = [r for r in counted if r not in killed]
    rate = 100.0 * len(killed) / len(counted) if counted else 0.0
    if survivors:
        print("\nsurvivors (the named test passes with the option neutralized):")
        for r in survivors:
            print(f"  {r.mutant}: {r.test or 'no test named (GAPS)'}" + (f"  [{r.log}]" if r.log else ""))
    others = [r for r in results if r not in counted]
    if others:
        print("\nno verdict (fix the test or its entry, then run again):")
        for r in others:
            print(f"  {r.mutant}: {r.status}: {r.test}" + (f"  [{r.log}]" if r.log else ""))
    total_s = sum(r.seconds for r in results)
    print(f"\nkill rate: {rate:.1f}% ({len(killed)} of {len(counted)} options killed, {len(survivors)} survived; "
          f"{total_s:.0f} s of mutant runs)")  # fmt: skip
    return rate


def main(argv: list[str] | None = None) -> int:
    """Choose the options, run their mutants, print the results; 1 below --min-rate, 2 when a run had no verdict."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("options", nargs="*", help="options to mutate (after --, or without the dashes: eps-clip)")
    parser.add_argument("--all", action="store_true", help="every option of `train --help`")
    parser.add_argument("--since", metavar="REF", help="the options whose flag or field `git diff REF` touches")
    parser.add_argument("--list", action="store_true", help="print each option's mutant and test; run nothing")
    parser.add_argument("--no-baseline", action="store_true", help="skip running each test once without a mutant")
    parser.add_argument("--timeout-s", type=float, default=900.0, help="seconds one test run may take (a timeout "
                        "kills the mutant)")  # fmt: skip
    parser.add_argument("--log-dir", type=Path, default=Path(tempfile.gettempdir()) / "tidal-option-mutation")
    parser.add_argument("--min-rate", type=float, default=0.0, help="exit 1 when the kill rate is below this percent")
    args = parser.parse_args(argv)
    table = coverage_table()
    everything = table.train_options()
    named = ["--" + o.removeprefix("--") for o in args.options]
    unknown = sorted(set(named) - set(everything))
    if unknown:
        raise SystemExit(f"not options of `train --help`: {unknown}")
    if sum(map(bool, (args.all, args.since, named))) != 1:
        raise SystemExit("give one of --all, --since REF or the options to mutate")
    chosen = everything if args.all else touched_options(args.since, everything) if args.since else named
    if not chosen:
        print(f"no option's flag or field changed since {args.since}")
        return 0
    results = plan(table, chosen)
    if args.list:
        for r in results:
            print(f"{r.mutant:<40} {r.test or 'no test named (GAPS)'}")
        return 0
    run(results, args.log_dir, baseline=not args.no_baseline, timeout_s=args.timeout_s)
    rate = report(results)
    if any(r.status in ("error", "baseline failed") for r in results):
        return 2
    return 0 if rate >= args.min_rate else 1


if __name__ == "__main__":
    sys.exit(main())
