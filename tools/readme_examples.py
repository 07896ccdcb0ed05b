"""Extract each package README's example script and run it.

A package README (``packages/NAME/README.md``) holds exactly one fenced block opened with ```` ```python example ````:
a complete script that builds its own inputs and asserts what it shows. This tool writes that block to a file and
runs it with a given interpreter in a scratch folder, so that an example that drifts from the package's API fails.

    python tools/readme_examples.py show batching                 # print the example
    python tools/readme_examples.py run batching ckpt             # run them with this interpreter
    python tools/readme_examples.py run rollout --python VENV/bin/python --timeout 900

Exit status 0 when every example ran and exited 0; otherwise one line per failure (with the example's output
above it) and status 1. An unknown package or a README without exactly one example block is one line, status 2.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("batching", "ckpt", "placement", "actor", "rollout")
FENCE = re.compile(r"^```python example[ \t]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)


def extract(package: str, *, root: Path = ROOT) -> str:
    """The source of ``packages/<package>/README.md``'s one example block.

    Raises:
        ValueError: the package is unknown, or its README has no example block or more than one.
    """
    readme = root / "packages" / package / "README.md"
    if not readme.is_file():
        raise ValueError(f"no README at {readme}: the package must be one of {', '.join(PACKAGES)}")
    blocks = FENCE.findall(readme.read_text())
    if len(blocks) != 1:
        raise ValueError(f"{readme} must hold exactly one block opened with ```python example, found {len(blocks)}")
    return blocks[0]


def run(package: str, *, python: str, timeout_s: float, root: Path = ROOT) -> tuple[int, float]:
    """Run one package's example with ``python`` in a scratch folder; return its exit status and wall seconds.

    The example runs with the scratch folder as its working directory, so that nothing it imports can come from
    this repository's sources unless the interpreter's environment provides it.
    """
    source = extract(package, root=root)
    with tempfile.TemporaryDirectory(prefix=f"tidal-example-{package}-") as scratch:
        script = Path(scratch) / f"{package}_example.py"
        script.write_text(source)
        start = time.monotonic()
        try:
            rc = subprocess.run([python, str(script)], cwd=scratch, timeout=timeout_s, check=False).returncode
        except subprocess.TimeoutExpired:
            print(f"readme_examples: the {package} example ran past {timeout_s:.0f} s (--timeout)", file=sys.stderr)
            rc = 124
        return rc, time.monotonic() - start


def main(argv: list[str] | None = None) -> int:
    """Command line: ``show`` or ``run`` the examples of the packages named."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["show", "run"])
    parser.add_argument("packages", nargs="*", default=list(PACKAGES), help="packages (default: all five)")
    parser.add_argument("--python", default=sys.executable, help="interpreter to run the examples with")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds each example may take")
    args = parser.parse_args(argv)
    try:
        sources = {package: extract(package) for package in args.packages}
    except ValueError as e:
        print(f"readme_examples: {e}", file=sys.stderr)
        return 2
    if args.command == "show":
        for source in sources.values():
            print(source, end="")
        return 0
    failed = []
    for package in args.packages:
        rc, seconds = run(package, python=args.python, timeout_s=args.timeout)
        print(f"readme_examples: {package} example exited {rc} after {seconds:.1f} s", flush=True)
        if rc != 0:
            failed.append(package)
    if failed:
        print(f"readme_examples: failed: {', '.join(failed)} (see their output above)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
