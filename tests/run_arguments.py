"""The `train` arguments an end-to-end test passes, read from its source, and the matrix features they turn on.

A run is named by the function that builds its argument list (a fixture or a test) and the variable that holds it.
Its arguments are every list assigned or added to that variable, and every list literal that extends it
(``[*args, "--load", ...]``), with starred names and helper calls followed to their definitions (in the function,
its module, or the sibling module it imports them from). What the source computes at run time (an engine's address,
a folder) stands as ``<name>``: the features depend on which flags are given and on their literal values only.
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).parent
ROOT = TESTS.parent

Argv = list[str]


def _module(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def _function(module: ast.Module, name: str) -> ast.FunctionDef:
    found = [n for n in ast.walk(module) if isinstance(n, ast.FunctionDef) and n.name == name]
    if len(found) != 1:
        raise LookupError(f"{len(found)} functions named {name!r}")
    return found[0]


class _Source:
    """One test module: resolves the names its argument lists use."""

    def __init__(self, path: Path) -> None:
        self.path, self.module = path, _module(path)

    def module_value(self, name: str) -> ast.expr | None:
        for node in self.module.body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
                return node.value
        return None

    def imported_from(self, name: str) -> _Source | None:
        for node in self.module.body:
            if isinstance(node, ast.ImportFrom) and any((a.asname or a.name) == name for a in node.names):
                sibling = TESTS / f"{node.module}.py"
                if sibling.is_file():
                    return _Source(sibling)
        return None


def _assigned(function: ast.FunctionDef, name: str) -> list[ast.expr]:
    """Every value assigned (``=``) or added (``+=``) to ``name`` in ``function``, in source order."""
    values = []
    for node in ast.walk(function):
        assigns = isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets)
        if assigns or (isinstance(node, ast.AugAssign) and getattr(node.target, "id", None) == name):
            values.append(node.value)
    return sorted(values, key=lambda v: (v.lineno, v.col_offset))


def _expand(node: ast.expr, function: ast.FunctionDef | None, source: _Source) -> Argv:
    """The tokens ``node`` stands for, as far as the source says."""
    if isinstance(node, ast.Constant):
        return [str(node.value)]
    if isinstance(node, (ast.List, ast.Tuple)):
        return [token for element in node.elts for token in _expand(element, function, source)]
    if isinstance(node, ast.Starred):
        return _expand_name(node.value, function, source, starred=True)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _expand(node.left, function, source) + _expand(node.right, function, source)
    if isinstance(node, ast.Name) and isinstance(source.module_value(node.id), ast.Constant):  # RANK = 8
        return _expand(source.module_value(node.id), None, source)
    if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "str" and len(node.args) == 1:
        return _expand(node.args[0], function, source)
    return [f"<{ast.unparse(node)}>"]


def _expand_name(node: ast.expr, function: ast.FunctionDef | None, source: _Source, *, starred: bool) -> Argv:
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):  # a helper returning an argument list
        helper = _function(source.module, node.func.id)
        returned = [n.value for n in ast.walk(helper) if isinstance(n, ast.Return) and n.value is not None]
        return [token for value in returned for token in _expand(value, helper, source)]
    if isinstance(node, ast.Name):
        local = _assigned(function, node.id) if function is not None else []
        if local:
            return [token for value in local for token in _expand(value, function, source)]
        value = source.module_value(node.id)
        if value is not None:
            return _expand(value, None, source)
        sibling = source.imported_from(node.id)
        if sibling is not None and sibling.module_value(node.id) is not None:
            return _expand(sibling.module_value(node.id), None, sibling)
        return [f"<{node.id}>"] if not starred else [f"<*{node.id}>"]
    return [f"<{ast.unparse(node)}>"]


def run_arguments(test_id: str, variable: str) -> Argv:
    """The arguments of the run built in ``test_id`` (``tests/FILE.py::FUNCTION``) in ``variable``.

    A module-level ``variable`` (a constant list) is read when the function assigns none.
    """
    path, function_name = test_id.split("::")
    source = _Source(ROOT / path)
    function = _function(source.module, function_name)
    assigned = _assigned(function, variable)
    tokens = [t for value in assigned for t in _expand(value, function, source)]
    if not assigned and source.module_value(variable) is not None:
        tokens = _expand(source.module_value(variable), None, source)
    for node in ast.walk(function):  # lists extending it: [*args, *external, "--load", ...]
        if isinstance(node, ast.List) and any(
            isinstance(e, ast.Starred) and getattr(e.value, "id", None) == variable for e in node.elts
        ):
            tokens += [t for e in node.elts if not isinstance(e, ast.Starred) or e.value.id != variable
                       for t in _expand(e, function, source)]  # fmt: skip
    if not any(t.startswith("--") for t in tokens):
        raise LookupError(f"{test_id}: no `train` flags found in {variable!r}")
    return tokens


def values(argv: Argv, flag: str) -> list[list[str]]:
    """The values given after each occurrence of ``flag`` (the tokens up to the next flag)."""
    out = []
    for i, token in enumerate(argv):
        if token == flag:
            rest = argv[i + 1 :]
            end = next((j for j, t in enumerate(rest) if t.startswith("--")), len(rest))
            out.append(rest[:end])
    return out


def value(argv: Argv, flag: str) -> str | None:
    """The last value given to ``flag``, None when it is not given."""
    given = values(argv, flag)
    return given[-1][0] if given and given[-1] else None


def num_engines(argv: Argv) -> int:
    """Engines the run talks to: the external addresses given, else --rollout-num-gpus / per engine (default 1)."""
    external = values(argv, "--rollout-external-engine-addrs")
    if external:
        return max(len(v) for v in external)
    gpus = value(argv, "--rollout-num-gpus")
    per_engine = value(argv, "--rollout-num-gpus-per-engine") or "1"
    return int(gpus) // int(per_engine) if gpus and gpus.isdigit() else 1


DETECT = {
    "lora": lambda a: value(a, "--lora-rank") not in (None, "0"),
    "delta": lambda a: "--update-weight-delta" in a,
    "moe_r3": lambda a: "--use-rollout-routing-replay" in a,
    "agents": lambda a: "--agent-function-path" in a or value(a, "--recipe") == "embedded-agent",
    "custom_generate": lambda a: "--custom-generate-function-path" in a,
    "dynamic_sampling": lambda a: "--dynamic-sampling-filter-path" in a,
    "partial_rollout": lambda a: "--partial-rollout" in a,
    "max_staleness": lambda a: int(value(a, "--max-staleness") or 0) >= 1,
    # agents start no router: their gateway pins each episode to one engine
    "router": lambda a: num_engines(a) >= 2 and "--no-use-router" not in a and not DETECT["agents"](a),
    "fault_tolerance": lambda a: "--use-fault-tolerance" in a,
    "decoupled": lambda a: "--no-colocate" in a or "--rollout-external-engine-addrs" in a,
    "tp_pp": lambda a: "2" in (value(a, "--tensor-model-parallel-size"), value(a, "--pipeline-model-parallel-size")),
    "ppo": lambda a: value(a, "--advantage-estimator") == "ppo",
    "eval": lambda a: "--debug-train-only" not in a,  # every run with engines evaluates after its last rollout
    "sft": lambda a: value(a, "--stage") == "sft",
}
"""For each feature of the matrix: whether an argument list turns it on."""


def features_of(argv: Argv) -> set[str]:
    """The matrix features ``argv`` turns on."""
    return {name for name, on in DETECT.items() if on(argv)}
