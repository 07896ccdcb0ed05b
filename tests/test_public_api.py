"""The packages' public API, checked on the source: imported from the top level only, and every name has a user.

A package's public API is its ``__init__.py``'s ``__all__``. Other members (the app above all) import from that
top level, never from a package's submodule, so a package may reorganise its modules freely. Every exported name
must be imported by something outside its package: the app, bench/, the cross-package tests, or another package.
The few that only a user's own code calls are listed in ``USER_ENTRY_POINTS``, each with the reason, and must be
named in the package's README. A name that nothing outside its package uses stays module-private.
"""

import ast
import functools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = sorted(p.parent.name for p in ROOT.glob("packages/*/pyproject.toml"))
APPS = sorted(p.parent.name for p in ROOT.glob("apps/*/pyproject.toml"))

_NEXT_DAPO = "next: DAPO dynamic sampling in the loop (README 'Sampling strategies'); tested by the package's own tests"

# (package, name) -> why it is public although nothing in this repository outside the package imports it.
USER_ENTRY_POINTS = {
    ("actor", "HFTensorBucket"): "what Actor.hf_tensor_buckets yields (the app's weight sync iterates it unnamed)",
    ("batching", "alignment_multiple"): "README API: tidal-batching is used standalone by other trainers",
    ("placement", "shutdown_ray"): "README API: a user's own driver stops the Ray it started",
    ("placement", "start_ray"): "README API: a user's own driver starts Ray (tests/conftest.py LOCAL_DRIVER)",
    ("rollout", "GenerateFn"): "the Protocol a --custom-generate-function-path function implements",
    ("rollout", "GroupFilter"): "the Protocol a --dynamic-sampling-filter-path function implements",
    ("rollout", "MultiTurn"): "builds multi-turn samples inside a user's --custom-generate-function-path function",
    ("rollout", "RewardFn"): "the Protocol a --custom-rm-path function implements",
    ("rollout", "RewardResult"): "what a --custom-rm-path function returns to report figures beside its reward",
    ("rollout", "filter_uniform_groups"): _NEXT_DAPO,
    ("rollout", "reward_variance"): _NEXT_DAPO,
    ("rollout", "sample_with_dynamic_filter"): _NEXT_DAPO,
}


def _parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def _py_files(*globs: str) -> list[Path]:
    return sorted({p for g in globs for p in ROOT.glob(g) if ".venv" not in p.parts})


def _member_files(member: str) -> list[Path]:
    """Source and tests of one workspace member."""
    base = "packages" if member in PACKAGES else "apps"
    return _py_files(f"{base}/{member}/src/**/*.py", f"{base}/{member}/tests/**/*.py")


@functools.cache
def exports(package: str) -> tuple[str, ...]:
    """The package's ``__all__``, read from its source (importing it would pull in torch, Ray, SGLang)."""
    for node in _parse(ROOT / f"packages/{package}/src/tidal/{package}/__init__.py").body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return tuple(ast.literal_eval(node.value))
    raise AssertionError(f"packages/{package}: __init__.py has no __all__")


@functools.cache
def error_names(package: str) -> frozenset[str]:
    """Classes defined in the package's errors.py: public because callers catch them by type."""
    path = ROOT / f"packages/{package}/src/tidal/{package}/errors.py"
    return frozenset(n.name for n in _parse(path).body if isinstance(n, ast.ClassDef)) if path.exists() else frozenset()


def _tidal_references(path: Path) -> list[tuple[str, str | None, int]]:
    """``(module, name or None, line)`` for every ``tidal.*`` import and ``tidal.pkg.name`` attribute in ``path``."""
    found = []
    for node in ast.walk(_parse(path)):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("tidal."):
            found += [(node.module, alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.Import):
            found += [(a.name, None, node.lineno) for a in node.names if a.name.startswith("tidal.")]
        elif (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Attribute)
            and isinstance(node.value.value, ast.Name)
            and node.value.value.id == "tidal"
        ):
            found.append((f"tidal.{node.value.attr}", node.attr, node.lineno))
    return found


@functools.cache
def outside_users(package: str) -> dict[str, list[str]]:
    """Exported name -> files outside ``package`` that import it from ``tidal.<package>``."""
    others = [m for m in [*PACKAGES, *APPS] if m != package]
    files = [*_py_files("bench/**/*.py", "tests/**/*.py"), *(f for m in others for f in _member_files(m))]
    users: dict[str, list[str]] = {}
    for path in files:
        for module, name, _ in _tidal_references(path):
            if module == f"tidal.{package}" and name is not None:
                users.setdefault(name, []).append(str(path.relative_to(ROOT)))
    return users


@pytest.mark.parametrize("member", [*APPS, *PACKAGES])
def test_members_import_other_packages_from_their_top_level(member):
    wrong = []
    for path in _member_files(member):
        for module, _, line in _tidal_references(path):
            parts = module.split(".")
            if len(parts) > 2 and parts[1] in PACKAGES and parts[1] != member:
                wrong.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    assert not wrong, (
        f"import from the package's top level (from tidal.pkg import name), exporting the name there if needed: {wrong}"
    )


@pytest.mark.parametrize("package", PACKAGES)
def test_every_exported_name_is_used_outside_its_package(package):
    users = outside_users(package)
    unused = [
        name
        for name in exports(package)
        if name not in users and name not in error_names(package) and (package, name) not in USER_ENTRY_POINTS
    ]
    assert not unused, (
        f"tidal.{package} exports {unused} but nothing outside the package imports them: stop exporting them "
        f"(keep them module-private), or add them to USER_ENTRY_POINTS with the reason"
    )


@pytest.mark.parametrize("entry", sorted(USER_ENTRY_POINTS), ids="{0[0]}.{0[1]}".format)
def test_user_entry_points_are_exported_documented_and_not_otherwise_used(entry):
    package, name = entry
    assert name in exports(package), f"USER_ENTRY_POINTS lists {name}, which tidal.{package} does not export"
    assert name in (ROOT / f"packages/{package}/README.md").read_text(encoding="utf-8"), (
        f"{name} is public for users only, so packages/{package}/README.md must document it"
    )
    users = outside_users(package).get(name)
    assert not users, f"{name} is used by {users}: remove it from USER_ENTRY_POINTS"


def _defined(path: Path) -> set[str]:
    """Names a module binds at its top level (definitions, assignments, imports)."""
    names: set[str] = set()
    for node in _parse(path).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


@pytest.mark.parametrize("package", PACKAGES)
def test_all_lists_exactly_what_the_init_provides(package):
    """``__all__`` = the eager imports + the lazy table, and each lazy name exists in the module it points to."""
    src = ROOT / f"packages/{package}/src/tidal/{package}"
    eager, lazy = set(), {}
    for node in _parse(src / "__init__.py").body:
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(f"tidal.{package}."):
            eager |= {a.asname or a.name for a in node.names}
        elif isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "_LAZY" for t in node.targets):
            lazy = ast.literal_eval(node.value)
    assert sorted(exports(package)) == sorted(eager | set(lazy)), "__all__ differs from what __init__.py provides"
    defined = {module: _defined(src / f"{module.replace('.', '/')}.py") for module in set(lazy.values())}
    missing = [f"{name} ({module})" for name, module in lazy.items() if name not in defined[module]]
    assert not missing, f"_LAZY points at modules that do not define {missing}"
