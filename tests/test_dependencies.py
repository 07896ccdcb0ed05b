"""The workspace's dependency rules, checked on the source: declared imports only, one direction only."""

import ast
import functools
import subprocess
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MEMBERS = {
    p.parent.name: p.parent for p in [*ROOT.glob("packages/*/pyproject.toml"), *ROOT.glob("apps/*/pyproject.toml")]
}

# Which tidal packages each member may import (the top README's package table): batching and ckpt use no tidal package;
# actor may use batching and ckpt; rollout may use batching; placement knows nothing of the others; the app composes
# them all.
ALLOWED = {
    "batching": set(),
    "ckpt": set(),
    "placement": set(),
    "rollout": {"batching"},
    "actor": {"batching", "ckpt"},
    "train": {"batching", "ckpt", "placement", "rollout", "actor"},
}


def _imports(src_dir: Path) -> dict[str, set[str]]:
    """Top-level imported names -> the files importing them (absolute imports only)."""
    found: dict[str, set[str]] = {}
    for path in src_dir.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                parts = name.split(".")
                key = ".".join(parts[:2]) if parts[0] == "tidal" else parts[0]
                found.setdefault(key, set()).add(str(path.relative_to(ROOT)))
    return found


@functools.cache
def _distributions() -> dict[str, list[str]]:
    return packages_distributions()


def _declared(member: str) -> set[str]:
    project = tomllib.loads((MEMBERS[member] / "pyproject.toml").read_text())["project"]
    extras = [dep for group in project.get("optional-dependencies", {}).values() for dep in group]
    return {
        dep.split(";")[0].split("[")[0].split("=")[0].split(">")[0].split("<")[0].strip().lower()
        for dep in [*project.get("dependencies", []), *extras]
    }


def test_every_member_is_known():
    assert set(MEMBERS) == set(ALLOWED)


@pytest.mark.parametrize("member", sorted(ALLOWED))
def test_tidal_imports_point_one_way_and_are_declared(member):
    imports = _imports(MEMBERS[member] / "src")
    declared = _declared(member)
    for name, files in imports.items():
        if not name.startswith("tidal."):
            continue
        other = name.split(".")[1]
        if other == member:
            continue
        assert other in ALLOWED[member], f"{sorted(files)} import tidal.{other}: tidal-{member} may not depend on it"
        assert f"tidal-{other}" in declared, (
            f"{sorted(files)} import tidal.{other} but tidal-{member} does not declare it"
        )


@pytest.mark.parametrize("member", sorted(ALLOWED))
def test_third_party_imports_are_declared(member):
    dist_of = _distributions()
    declared = _declared(member)
    stdlib = sys.stdlib_module_names
    for name, files in _imports(MEMBERS[member] / "src").items():
        if name.startswith("tidal") or name in stdlib or name == "__future__":
            continue
        dists = {d.lower() for d in dist_of.get(name, [name])}
        assert dists & declared, (
            f"{sorted(files)} import {name} (from {sorted(dists)}) but tidal-{member} does not declare it"
        )


def test_no_import_cycles_inside_a_package_or_the_app():
    """pyproject.toml's import-linter contract: no two sibling modules (at any depth) import each other, directly or
    round about; a new cycle fails here with the imports that would break it."""
    lint = Path(sys.executable).with_name("lint-imports")
    done = subprocess.run([str(lint), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "Contracts: 1 kept, 0 broken." in done.stdout
