"""Mutation testing of the RL core: run mutmut over the chosen modules and print the kill rate.

Each package that takes part names its modules and its fast unit tests in a ``[tool.mutmut]`` section of its own
pyproject.toml; mutmut then runs from that package's folder, where ``src/`` holds the namespace package that it
copies into ``mutants/`` (the repository root has no single ``src/``).

    uv run python tools/mutation.py                      # every configured module (the full pass)
    uv run python tools/mutation.py packages/actor/src/tidal/actor/loss.py packages/batching   # only these
    uv run python tools/mutation.py --since main         # the configured modules a change touches
    uv run python tools/mutation.py --diffs PATH         # also print each surviving mutant's diff

Results are cached in each package's ``mutants/`` (mutmut re-tests only the functions whose code or tests
changed); ``--fresh`` deletes that cache first. A mutant counts as killed when a test fails on it or it runs past
mutmut's timeout; a survivor, or a mutant that no test reaches, counts as alive.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KILLED = {"killed", "timeout", "segfault", "caught by type check"}


@dataclass
class Module:
    """One module that mutmut mutates, as its package configures it."""

    package_dir: Path
    relative: str  # e.g. "src/tidal/batching/packing.py", relative to package_dir
    statuses: dict[str, str] = field(default_factory=dict)

    @property
    def path(self) -> Path:
        """The module's file."""
        return self.package_dir / self.relative

    @property
    def dotted(self) -> str:
        """The module's import name, the prefix of its mutants' names."""
        return self.relative.removeprefix("src/").removesuffix(".py").replace("/", ".")


def configured_modules() -> list[Module]:
    """Every module named by a ``[tool.mutmut] only_mutate`` list under packages/ and apps/."""
    modules = []
    for pyproject in sorted([*ROOT.glob("packages/*/pyproject.toml"), *ROOT.glob("apps/*/pyproject.toml")]):
        section = tomllib.loads(pyproject.read_text()).get("tool", {}).get("mutmut")
        if section:
            modules += [Module(pyproject.parent, rel) for rel in section.get("only_mutate", [])]
    return modules


def select(modules: list[Module], paths: list[str]) -> list[Module]:
    """The configured modules at or under ``paths`` (all of them when none is given)."""
    if not paths:
        return modules
    wanted = [Path(p).resolve() for p in paths]

    def covers(w: Path, m: Module) -> bool:
        return m.path == w or w in m.path.parents

    chosen = [m for m in modules if any(covers(w, m) for w in wanted)]
    unknown = [p for p, w in zip(paths, wanted, strict=True) if not any(covers(w, m) for m in modules)]
    if unknown:
        configured = "\n  ".join(str(m.path.relative_to(ROOT)) for m in modules)
        raise SystemExit(f"not configured for mutation testing: {unknown}; configured modules:\n  {configured}")
    return chosen


def changed_paths(ref: str) -> list[str]:
    """Files that differ between ``ref`` and the working tree (``git diff --name-only ref``), from the root."""
    out = subprocess.run(["git", "diff", "--name-only", ref], cwd=ROOT, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"--since {ref}: git diff failed: {out.stderr.strip()}")
    return [str(ROOT / line) for line in out.stdout.splitlines() if line]


def run_mutmut(package_dir: Path, modules: list[Module], *, fresh: bool) -> bool:
    """``mutmut run`` in ``package_dir`` on the mutants of ``modules``, one worker, its output in mutants/run.log.

    Returns:
        Whether mutmut finished; when not, the end of its log is printed.
    """
    if fresh:
        shutil.rmtree(package_dir / "mutants", ignore_errors=True)
    mutmut = Path(sys.executable).parent / "mutmut"
    cmd = [str(mutmut), "run", "--max-children", "1", *(f"{m.dotted}.*" for m in modules)]
    (package_dir / "mutants").mkdir(exist_ok=True)
    log = package_dir / "mutants" / "run.log"
    print(f"mutmut run in {package_dir.relative_to(ROOT)} on {', '.join(m.dotted for m in modules)}", flush=True)
    # mutmut forks each mutant's test run from a process that has run torch: with a thread pool there, the fork
    # can deadlock in its first parallel op (a false "timeout"); one thread per process has no pool to inherit.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    with log.open("w") as out:
        rc = subprocess.run(cmd, cwd=package_dir, env=env, stdout=out, stderr=subprocess.STDOUT, check=False).returncode
    if rc != 0:
        tail = log.read_text(errors="replace").replace("\r", "\n").splitlines()[-40:]
        print(f"mutmut exited {rc} in {package_dir}; the end of {log}:\n" + "\n".join(tail))
    return rc == 0


def read_statuses(module: Module) -> None:
    """Fill ``module.statuses`` (mutant name -> mutmut status) from mutmut's results file of that module."""
    from mutmut.stats import status_by_exit_code

    meta = module.package_dir / "mutants" / (module.relative + ".meta")
    codes = json.loads(meta.read_text())["exit_code_by_key"] if meta.exists() else {}
    module.statuses = {name: status_by_exit_code[code] for name, code in codes.items()}


def report(modules: list[Module], *, diffs: bool) -> float:
    """Print the per-module counts, the surviving mutants and the kill rate; return the rate in percent.

    The rate is over the mutants mutmut has a verdict for; "not checked" ones (an interrupted run) are counted apart.
    """
    total = killed = unchecked = 0
    print(f"\n{'module':<48} {'mutants':>8} {'killed':>7} {'alive':>6}")
    for m in modules:
        checked = [s for s in m.statuses.values() if s != "not checked"]
        k = sum(s in KILLED for s in checked)
        total, killed, unchecked = total + len(checked), killed + k, unchecked + len(m.statuses) - len(checked)
        print(f"{m.dotted:<48} {len(checked):>8} {k:>7} {len(checked) - k:>6}")
    alive = [(m, name, s) for m in modules for name, s in m.statuses.items() if s not in KILLED | {"not checked"}]
    if alive:
        print("\nalive mutants (mutmut show NAME, in the package folder, prints one):")
    for m, name, status in alive:
        print(f"  {name}: {status}")
        if diffs:
            mutmut = Path(sys.executable).parent / "mutmut"
            show = subprocess.run([str(mutmut), "show", name], cwd=m.package_dir, capture_output=True, text=True)
            print("    " + show.stdout.strip().replace("\n", "\n    "))
    rate = 100.0 * killed / total if total else 0.0
    print(f"\nkill rate: {rate:.1f}% ({killed} of {total} mutants killed, {total - killed} alive)")
    if unchecked:
        print(f"{unchecked} mutants not checked yet (an interrupted run): run again without --report-only")
    return rate


def main(argv: list[str] | None = None) -> int:
    """Run mutmut on the chosen modules (unless --report-only) and print the results; 1 below --min-rate."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="*", help="module files or folders to mutate (default: every configured one)")
    parser.add_argument("--since", metavar="REF", help="only the configured modules changed since git REF")
    parser.add_argument("--fresh", action="store_true", help="delete the packages' mutants/ caches first")
    parser.add_argument("--diffs", action="store_true", help="print each surviving mutant's diff")
    parser.add_argument("--report-only", action="store_true", help="print the last results without running mutmut")
    parser.add_argument("--min-rate", type=float, default=0.0, help="exit 1 when the kill rate is below this percent")
    args = parser.parse_args(argv)
    modules = configured_modules()
    if args.since:
        changed = {Path(p) for p in changed_paths(args.since)}
        modules = [m for m in modules if m.path in changed]
        if not modules:
            print(f"no module configured for mutation testing changed since {args.since}")
            return 0
    modules = select(modules, args.paths)
    finished = True
    if not args.report_only:
        for package_dir in dict.fromkeys(m.package_dir for m in modules):
            ok = run_mutmut(package_dir, [m for m in modules if m.package_dir == package_dir], fresh=args.fresh)
            finished = finished and ok
    for m in modules:
        read_statuses(m)
    rate = report(modules, diffs=args.diffs)
    if not finished:
        return 2
    return 0 if rate >= args.min_rate else 1


if __name__ == "__main__":
    sys.exit(main())
