r"""A code row's tests, as the common code-RL data sets store them, turned into cases the sandbox runs.

The tests come from the sample's label: a dict, a list, or a JSON string of one. Layouts read:

- stdin/stdout: ``{"inputs": [...], "outputs": [...]}`` (APPS, TACO, PRIME/Eurus, Skywork-OR1, verl's
  ``reward_model.ground_truth``; ``{"input_output": ...}`` around it too) or ``[{"input": ..., "output": ...}, ...]``
  (DeepCoder, CodeContests-style lists);
- call-based: the same with ``"fn_name"`` (APPS/TACO): each input is the list of arguments (one JSON string or
  several lines of JSON each), the output the return value;
- assert-style: ``{"test_list": [...]}`` (MBPP; ``"test_setup_code"`` runs first), ``{"asserts": [...]}``,
  ``{"test_cases": [...]}`` or a plain list of assert statements: each statement is a case;
- a test script: ``{"test": "...", "entry_point": "f"}`` (HumanEval's ``check(candidate)``; scripts that define
  ``test_*`` functions, as KodCode's, get each called). The program is importable as ``solution``.

The response's program is its last fenced code block (```` ```python ```` or plain ```` ``` ````).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

_FENCE = re.compile(r"```[ \t]*([\w+#.-]*)[^\n]*\n(.*?)```", re.DOTALL)

PROGRAM = "solution.py"
"""The program's file name in the sandbox."""

_CALL_HARNESS = """\
import json, sys
import solution
fn = getattr(solution, {name!r}, None)
if fn is None:
    fn = getattr(solution.Solution(), {name!r})
raw = sys.stdin.read()
try:
    args = json.loads(raw)
except ValueError:
    args = [json.loads(line) for line in raw.splitlines() if line.strip()]
print(json.dumps(fn(*args)))
"""

_TEST_FUNCTIONS = """
for _name, _fn in list(globals().items()):
    if _name.startswith("test_") and callable(_fn):
        _fn()
"""


class BadTests(ValueError):
    """A row's tests are in no layout this module reads."""


@dataclass(frozen=True, slots=True)
class Case:
    """One run of the program: the files beside it, the script to run, its stdin and what must come out."""

    script: str
    """The file ``python`` runs: the program itself, or a harness that imports it."""
    extra_files: tuple[tuple[str, str], ...] = ()
    """Files besides the program, (name, text)."""
    stdin: str = ""
    """The program's standard input."""
    expected: Any = None
    """Expected stdout (a string), the expected return value (call-based), or None: passing is exiting 0."""
    call: bool = False
    """Whether ``expected`` is a return value printed as JSON by the call harness."""


def last_code_block(text: str) -> str | None:
    """The body of the last fenced code block in ``text``, or None when there is none."""
    blocks = _FENCE.findall(text)
    return blocks[-1][1] if blocks else None


def _as_text(value: Any) -> str:
    return value if isinstance(value, str) else "\n".join(map(str, value)) if isinstance(value, list) else str(value)


def _stdio_cases(inputs: list, outputs: list, fn_name: str | None) -> list[Case]:
    if len(inputs) != len(outputs) or not inputs:
        raise BadTests(f"{len(inputs)} inputs for {len(outputs)} outputs (need as many, at least one)")
    if fn_name:
        harness = (("main.py", _CALL_HARNESS.format(name=fn_name)),)
        return [
            Case("main.py", harness, json.dumps(i) if not isinstance(i, str) else i, o, call=True)
            for i, o in zip(inputs, outputs, strict=True)
        ]
    return [Case(PROGRAM, (), _as_text(i), _as_text(o)) for i, o in zip(inputs, outputs, strict=True)]


def _assert_cases(statements: list, setup: str = "") -> list[Case]:
    if not statements or not all(isinstance(s, str) for s in statements):
        raise BadTests("assert-style tests must be a non-empty list of statements")
    return [Case("main.py", (("main.py", f"from solution import *\n{setup}\n{s}\n"),)) for s in statements]


def _dict_cases(tests: dict) -> list[Case]:
    if "input_output" in tests:
        return parse_tests(tests["input_output"])
    if "inputs" in tests and "outputs" in tests:
        return _stdio_cases(list(tests["inputs"]), list(tests["outputs"]), tests.get("fn_name"))
    for key in ("test_list", "asserts", "test_cases"):
        if key in tests:
            setup = "\n".join(_as_text(tests.get(k, "")) for k in ("test_imports", "test_setup_code"))
            return _assert_cases(list(tests[key]), setup)
    if isinstance(tests.get("test"), str):
        entry = tests.get("entry_point")
        script = f"from solution import *\n{tests['test']}\n" + (f"\ncheck({entry})\n" if entry else _TEST_FUNCTIONS)
        return [Case("main.py", (("main.py", script),))]
    raise BadTests(f"no tests under the keys {sorted(tests)[:8]}")


def parse_tests(tests: Any) -> list[Case]:
    """The cases a row's tests (see the module's docstring for the layouts) stand for.

    Raises:
        BadTests: The tests are in no layout read here, or hold no case.
    """
    if isinstance(tests, str):
        try:
            tests = json.loads(tests)
        except ValueError as e:
            raise BadTests(f"tests are a string that is not JSON ({e})") from e
    if isinstance(tests, dict):
        return _dict_cases(tests)
    if isinstance(tests, list) and tests and all(isinstance(t, dict) and "input" in t for t in tests):
        fn_name = next((t.get("fn_name") for t in tests if t.get("testtype") == "functional"), None)
        return _stdio_cases([t["input"] for t in tests], [t.get("output") for t in tests], fn_name)
    if isinstance(tests, list):
        return _assert_cases(tests)
    raise BadTests(f"tests of type {type(tests).__name__}; expected a dict, a list or a JSON string of one")


def _same_token(a: str, b: str) -> bool:
    if a == b:
        return True
    try:
        return math.isclose(float(a), float(b), rel_tol=1e-6, abs_tol=1e-6)
    except ValueError:
        return False


def output_matches(case: Case, stdout: bytes) -> bool:
    """Whether ``stdout`` is the case's expected output.

    Printed text: equal line by line after trailing whitespace, or token by token with numbers within 1e-6.
    Call-based: the JSON of the return value equals the expected value (or the one-element list APPS wraps it in).
    """
    text = stdout.decode(errors="replace")
    if case.call:
        try:
            got = json.loads(text)
        except ValueError:
            return False
        expected = case.expected
        if isinstance(expected, str):
            with_json = _json_or_none(expected)
            expected = with_json if with_json is not None else expected
        return got == expected or [got] == expected
    lines = [line.rstrip() for line in text.rstrip().splitlines()]
    want = [line.rstrip() for line in str(case.expected).rstrip().splitlines()]
    if lines == want:
        return True
    got_tokens, want_tokens = text.split(), str(case.expected).split()
    return len(got_tokens) == len(want_tokens) and all(map(_same_token, got_tokens, want_tokens))


def _json_or_none(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None
