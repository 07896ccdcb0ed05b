"""Snapshot each package's public API with its version, and fail when the API changed but the version did not.

A package's public API is its ``__all__`` and, for each name, its signature: a function's parameters and return
annotation; a class's constructor and its public methods and properties; a constant's type and value. The snapshot
of ``tidal-NAME`` lives in ``packages/NAME/api.json`` with the version it belongs to.

    python tools/api_snapshot.py --check            # every package; CI runs this (in the workspace environment)
    python tools/api_snapshot.py --write actor      # after bumping tidal-actor's version and its CHANGELOG

``--check`` fails (status 1, one line per package) when a package's API differs from its snapshot at the same
version (bump ``version`` in its pyproject.toml, add a CHANGELOG.md entry, then ``--write``), when its version moved
on without a new snapshot (``--write``), when ``tidal.NAME.__version__`` is not the pyproject's version (a stale
install: ``uv sync``), or when its CHANGELOG.md has no ``## VERSION`` entry.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import re
import sys
import tomllib
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("batching", "ckpt", "placement", "actor", "rollout")


def _signature(obj: Any) -> str:
    try:
        text = str(inspect.signature(obj))
    except (TypeError, ValueError):
        return "(signature not available)"
    # A default that is a function or an object shows its address, which changes from run to run.
    return re.sub(r" at 0x[0-9a-fA-F]+", "", text)


def describe(obj: Any) -> Any:
    """A JSON-able description of one public name: what a caller relies on."""
    if inspect.isclass(obj):
        members = {}
        for name, member in sorted(vars(obj).items()):
            if name.startswith("_"):
                continue
            if isinstance(member, property):
                members[name] = "property"
            elif isinstance(member, staticmethod | classmethod):
                members[name] = f"{type(member).__name__}{_signature(member.__func__)}"
            elif inspect.isfunction(member):
                members[name] = _signature(member)
        return {"class": _signature(obj), "members": members}
    if callable(obj):
        return _signature(obj)
    if isinstance(obj, str | int | float | bool | tuple | frozenset) or obj is None:
        return f"{type(obj).__name__} = {obj!r}"
    return type(obj).__name__


def current_api(package: str) -> dict[str, Any]:
    """``{name: description}`` for every name in ``tidal.<package>.__all__``."""
    module = importlib.import_module(f"tidal.{package}")
    return {name: describe(getattr(module, name)) for name in sorted(module.__all__)}


def pyproject_version(package: str) -> str:
    """The ``version`` of ``packages/<package>/pyproject.toml``."""
    with open(ROOT / "packages" / package / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]["version"]


def snapshot_path(package: str) -> Path:
    """Where a package's snapshot lives."""
    return ROOT / "packages" / package / "api.json"


def write(package: str) -> Path:
    """Write the package's snapshot at its pyproject version."""
    path = snapshot_path(package)
    data = {"package": f"tidal-{package}", "version": pyproject_version(package), "api": current_api(package)}
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    return path


def _api_diff(old: dict[str, Any], new: dict[str, Any]) -> str:
    removed = sorted(set(old) - set(new))
    added = sorted(set(new) - set(old))
    changed = sorted(n for n in set(old) & set(new) if old[n] != new[n])
    parts = [f"{what}: {', '.join(names[:6])}{' ...' if len(names) > 6 else ''}"
             for what, names in (("removed", removed), ("added", added), ("changed", changed)) if names]  # fmt: skip
    return "; ".join(parts)


def problems(package: str) -> list[str]:
    """What is wrong with one package's version, snapshot and changelog (empty when all agree)."""
    version = pyproject_version(package)
    where = f"packages/{package}"
    found = []
    module = importlib.import_module(f"tidal.{package}")
    if getattr(module, "__version__", None) != version:
        found.append(
            f"tidal.{package}.__version__ is {getattr(module, '__version__', None)!r} but {where}/pyproject.toml says "
            f"{version!r}: the environment is stale, run `uv sync`"
        )
    changelog = ROOT / where / "CHANGELOG.md"
    if not changelog.is_file() or f"\n## {version}" not in "\n" + changelog.read_text():
        found.append(f"{where}/CHANGELOG.md has no '## {version}' entry: describe what changed in {version}")
    path = snapshot_path(package)
    if not path.is_file():
        return [*found, f"{where}/api.json is missing: run `python tools/api_snapshot.py --write {package}`"]
    saved = json.loads(path.read_text())
    diff = _api_diff(saved["api"], current_api(package))
    if saved["version"] == version and diff:
        found.append(
            f"tidal-{package}'s public API changed ({diff}) but its version is still {version}: bump version in "
            f"{where}/pyproject.toml, add a CHANGELOG.md entry, then run "
            f"`python tools/api_snapshot.py --write {package}`"
        )
    elif saved["version"] != version:
        found.append(
            f"tidal-{package} is {version} but {where}/api.json is {saved['version']}'s"
            f"{' (API ' + diff + ')' if diff else ''}: run `python tools/api_snapshot.py --write {package}`"
        )
    return found


def main(argv: list[str] | None = None) -> int:
    """Command line: ``--check`` or ``--write`` the packages named (default: all five)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check", action="store_true", help="fail when an API changed without a version change")
    mode.add_argument("--write", action="store_true", help="write the snapshots at the current versions")
    parser.add_argument("packages", nargs="*", default=list(PACKAGES), help="packages (default: all five)")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.packages) - set(PACKAGES))
    if unknown:
        print(f"api_snapshot: unknown package(s) {', '.join(unknown)}; known: {', '.join(PACKAGES)}", file=sys.stderr)
        return 2
    if args.write:
        for package in args.packages:
            print(f"api_snapshot: wrote {write(package).relative_to(ROOT)}")
        return 0
    found = [line for package in args.packages for line in problems(package)]
    for line in found:
        print(f"api_snapshot: {line}", file=sys.stderr)
    if not found:
        print(f"api_snapshot: {', '.join(args.packages)}: APIs match their versions' snapshots")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
