"""The feature-interaction matrix (tests/feature_matrix.py) against the runs, `train`'s parser and the README.

Fast: no run starts. Each covering run's features are read from the argument list its test passes; each refusal is
asked of `train`'s own parser and validation, in this process.
"""

import ast
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # --import-mode=importlib: siblings are not importable otherwise
import feature_matrix as fm
from run_arguments import ROOT, features_of, run_arguments


def test_every_pair_is_met_refused_or_listed_open_and_never_two_of_them():
    table = fm.cells()
    assert len(table) == 105 and all(a in fm.FEATURES and b in fm.FEATURES for a, b in table)
    for (a, b), cell in table.items():
        assert cell.runs or cell.refusal or cell.open, f"{a} + {b}: not met, refused nor listed open"
        assert not (cell.runs and cell.refusal and not cell.refusal.depends_on), f"{a} + {b}: met and refused"
    stale = [p for p, why in fm.OPEN.items() if table[fm.key(*p)].runs]
    assert not stale, f"met in a run now, drop them from OPEN: {stale}"
    for pair in [*fm.REFUSED, *fm.OPEN]:
        assert all(f in fm.FEATURES for f in pair), pair
    assert all(fm.key(*pair) == pair for pair in fm.REFUSED), "REFUSED's pairs go in FEATURES order"


@pytest.mark.xfail(reason="pairs still open: see feature_matrix.OPEN (and the README's table)")
def test_no_pair_is_open():
    assert not [p for p, c in fm.cells().items() if c.open]


@pytest.mark.parametrize("letter", list(fm.RUNS))
def test_each_run_turns_on_exactly_the_features_the_table_gives_it(letter):
    run = fm.RUNS[letter]
    declared = set(run.effects) | set(run.unasserted)
    assert not set(run.effects) & set(run.unasserted)
    assert features_of(run_arguments(run.test_id, run.argv)) == declared


@pytest.mark.parametrize("letter", list(fm.RUNS))
def test_each_effect_is_asserted_by_a_test_of_that_run(letter):
    """The named test exists in the run's file and uses the run (requests its fixture, or is the run itself)."""
    run = fm.RUNS[letter]
    path, starter = run.test_id.split("::")
    module = ast.parse((ROOT / path).read_text())
    functions = {n.name: [a.arg for a in n.args.args] for n in module.body if isinstance(n, ast.FunctionDef)}
    users = {starter}  # the starter, and every function of the module that takes it (fixtures in between too)
    while grown := {name for name, args in functions.items() if users & set(args)} - users:
        users |= grown
    for feature, name in run.effects.items():
        assert name.startswith("test_") and name in functions, f"{letter}: {feature}: no {name} in {path}"
        assert name in users, f"{letter}: {name} does not use {starter}"


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory) -> Path:
    """The files parse_job reads of a Qwen3-MoE folder whose every layer is MoE (none is loaded at parse time)."""
    folder = tmp_path_factory.mktemp("moe")
    config = {"model_type": "qwen3_moe", "num_hidden_layers": 4, "num_experts": 4, "mlp_only_layers": []}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "tokenizer.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"")
    return folder


def _parse(moe: Path, tmp_path: Path, *features: str):
    from tidal.train.cli import parse_job

    argv = [a.replace("{moe}", str(moe)) for f in features for a in fm.FEATURES[f].argv]
    return argv, parse_job([*argv, "--output-dir", str(tmp_path / "run")])


@pytest.mark.parametrize("feature", list(fm.FEATURES))
def test_each_feature_alone_is_accepted(feature, moe_model, tmp_path):
    _parse(moe_model, tmp_path, feature)


@pytest.mark.parametrize("pair", fm.pairs(), ids="+".join)
def test_each_pair_is_refused_at_parse_time_with_one_line_naming_both_or_accepted_as_the_table_says(
    pair, moe_model, tmp_path
):
    from tidal.train.cli import error_line

    refusal = fm.REFUSED.get(pair)
    try:
        argv, _ = _parse(moe_model, tmp_path, *pair)
    except ValueError as e:
        assert refusal is not None, f"refused, and not in feature_matrix.REFUSED: {e}"
        (line,) = str(e).splitlines()
        assert error_line(e) == line
        for feature in pair:
            assert any(name in line for name in fm.FEATURES[feature].names), (feature, line)
        return
    if refusal is not None and refusal.depends_on:
        pytest.xfail(f"refused on branch {refusal.depends_on}, not here yet")
    assert refusal is None, f"{' '.join(argv)} was accepted"


def test_the_train_readme_holds_the_table_of_pairs():
    section = fm.readme_section(fm.README.read_text())
    assert section is not None, f"{fm.README} has no feature-matrix section"
    assert section == fm.render(), "the table changed: `uv run python tests/feature_matrix.py` rewrites the README's"
