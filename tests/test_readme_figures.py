"""The figures the READMEs cite are the records' (bench/RESULTS.md, bench/chaos.py), not copies that drift."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "RESULTS.md"
DEFAULT_TABLE = "## The embedded default at 110 rollouts, lr 4e-4"
"""The section of bench/RESULTS.md whose table records `uv run train` on the current default."""
NUMBERS = {"five": 5, "six": 6, "seven": 7, "eight": 8, "nine": 9, "ten": 10, "eleven": 11, "twelve": 12}


def _seconds(clock: str) -> float:
    minutes, seconds = clock.split(":")
    return int(minutes) * 60 + float(seconds)


def _default_runs() -> list[dict[str, float | str]]:
    """The rows of the current default's table (the row labelled ``before:`` is the old default)."""
    text = RESULTS.read_text()
    section = text[text.index(DEFAULT_TABLE) :]
    rows = []
    for line in section.splitlines()[1:]:
        if line.startswith("## "):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 6 or not re.search(r"\d:\d\d", cells[1]) or cells[0].startswith("before"):
            continue
        first = re.fullmatch(r"rollout (\d+), \**(\d+) s\**", cells[4])
        rows.append({
            "clock": cells[1].strip("*"),
            "after": float(cells[3].split("->")[1]),
            "rollout": int(first[1]),
            "rl_s": int(first[2]),
        })  # fmt: skip
    assert len(rows) >= 3, f"{RESULTS}: no table under {DEFAULT_TABLE!r}"
    return rows


def test_the_top_readme_cites_the_records_of_the_default():
    runs = _default_runs()
    readme = " ".join((ROOT / "README.md").read_text().split())
    claim = re.search(
        r"(\w+) runs: held-out accuracy \*\*31% -> (\d+)-(\d+)%\*\*, \+25 points at rollout (\d+)-(\d+) "
        r"\((\d+)-(\d+) s of RL\), \*\*(\d:[\d.]+)-(\d:[\d.]+) end to end\*\*",
        readme,
    )
    assert claim, "README.md no longer states the default's figures in the form this test reads"
    count, acc_lo, acc_hi, r_lo, r_hi, s_lo, s_hi, fastest, slowest = claim.groups()
    assert NUMBERS[count] == len(runs), (count, len(runs))
    after = [r["after"] for r in runs]
    assert (int(acc_lo), int(acc_hi)) == (round(min(after) * 100), round(max(after) * 100))
    assert (int(r_lo), int(r_hi)) == (min(r["rollout"] for r in runs), max(r["rollout"] for r in runs))
    assert (int(s_lo), int(s_hi)) == (min(r["rl_s"] for r in runs), max(r["rl_s"] for r in runs))
    clocks = sorted(r["clock"] for r in runs)
    assert (fastest, slowest) == (min(clocks, key=_seconds), max(clocks, key=_seconds))


def test_the_train_readme_gives_the_default_the_records_duration():
    slowest = max(_seconds(str(r["clock"])) for r in _default_runs())
    line = next(
        line for line in (ROOT / "apps/train/README.md").read_text().splitlines() if line.startswith("uv run train ")
    )
    minutes = re.search(r"~(\d+) min", line)
    assert minutes and abs(int(minutes[1]) * 60 - slowest) < 60, (line, slowest)


def test_every_readme_counts_the_chaos_points_of_bench_chaos():
    tree = ast.parse((ROOT / "bench" / "chaos.py").read_text())
    points = next(
        len(node.value.keys)
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "POINTS" for t in node.targets)
    )
    files = [ROOT / "README.md", RESULTS, *ROOT.glob("apps/*/README.md"), *ROOT.glob("packages/*/README.md")]
    said = []
    for file in files:
        text = " ".join(file.read_text().split())
        said += [(file.name, m[1]) for m in re.finditer(r"chaos\.py` kills a run at (\w+) points", text)]
        said += [(file.name, m[1]) for m in re.finditer(r"(\w+) points, all PASS", text)]
    assert said, "no README states the chaos bench's points"
    assert all(NUMBERS[word.lower()] == points for _, word in said), (points, said)
