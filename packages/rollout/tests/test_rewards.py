"""Rule-based rewards, custom reward functions by import path, and per-sample error isolation."""

from __future__ import annotations

import dataclasses
import sys
import textwrap
import time

import pytest
from tidal.rollout import Sample, resolve_reward_fn, score_samples
from tidal.rollout.rewards import exact_match, extract_boxed, last_number, load_reward_fn, math_answer, numeric_match


def _sample(text: str, label: object, group: int = 0) -> Sample:
    return Sample(
        prompt_ids=[1, 2],
        response_ids=[3],
        response_log_probs=[-0.5],
        finish_reason="stop",
        label=label,
        response_text=text,
        group_index=group,
    )


def test_sample_pairs_tokens_with_log_probs_and_builds_the_training_sequence() -> None:
    s = _sample("x", "y")
    assert s.tokens == [1, 2, 3]
    assert s.loss_mask == [0, 0, 1]
    assert not s.truncated
    with pytest.raises(ValueError, match="response_log_probs has 2 entries for 1 response tokens"):
        Sample(prompt_ids=[1], response_ids=[3], response_log_probs=[-1.0, -2.0], finish_reason="stop")


@pytest.mark.parametrize(
    ("text", "label", "expected"),
    [("four", "four", 1.0), ("  four\n", "four", 1.0), ("a  b", "a b", 1.0), ("Four", "four", 0.0), ("", "x", 0.0)],
)
def test_exact_match(text: str, label: str, expected: float) -> None:
    assert exact_match(_sample(text, label)) == expected


@pytest.mark.parametrize(
    ("text", "label", "expected"),
    [
        ("2 + 2 = 4", "4", 1.0),
        ("first 3, then 5", "5", 1.0),
        ("first 5, then 3", "5", 0.0),
        ("the total is 1,000.", "1000", 1.0),
        ("it is -2.50", "-2.5", 1.0),
        ("half: 1/2", "0.5", 1.0),
        ("#### 72", "The answer is 72", 1.0),
        ("no number here", "4", 0.0),
        ("4", "not a number", 0.0),
    ],
)
def test_numeric_match_compares_the_last_number(text: str, label: str, expected: float) -> None:
    assert numeric_match(_sample(text, label)) == expected


def test_last_number_and_boxed_extraction() -> None:
    assert last_number("a 1 b 22 c") == "22"
    assert last_number("none") is None
    assert extract_boxed(r"so \boxed{\frac{1}{2}} and finally \boxed{x^{2}}") == "x^{2}"
    assert extract_boxed(r"\boxed 7") == "7"
    assert extract_boxed(r"\boxed{unclosed") is None
    assert extract_boxed("plain") is None


@pytest.mark.parametrize(
    ("text", "label", "expected"),
    [
        (r"Thus \boxed{12}.", "12", 1.0),
        (r"\boxed{\frac{1}{2}}", "0.5", 1.0),
        (r"\boxed{\dfrac{3}{4}}", r"\frac34", 1.0),
        (r"\boxed{$10\%$}", "10", 1.0),
        (r"\boxed{\text{(B)}}", "(B)", 1.0),
        (r"\boxed{x^{2}+1}", "x^2+1", 0.0),  # no symbolic algebra: different strings differ
        (r"\boxed{x^{2}+1}", "x^{2} + 1", 1.0),
        ("the answer is 7", "7", 1.0),  # no box: falls back to the last number
        (r"\boxed{13}", "12", 0.0),
        ("no answer", "12", 0.0),
    ],
)
def test_math_answer(text: str, label: str, expected: float) -> None:
    assert math_answer(_sample(text, label)) == expected


_MB = 10**6
HOSTILE_ANSWERS = {
    "huge exponent": r"\boxed{1e999999999}",
    "huge negative exponent": r"\boxed{-1E-999_999_999}",
    "huge exponent, plain": "the answer is 1e999999999",
    "a million digits": "9" * _MB,
    "a million digits boxed": r"\boxed{" + "9" * _MB + "}",
    "a million thousands groups": "1," * (_MB // 2),
    "a million decimal points": "1." * (_MB // 2),
    "deeply nested braces": r"\boxed" + "{" * _MB + "}" * _MB,
    "unterminated boxed": r"\boxed{" + "x" * _MB,
    "unterminated nested boxed": r"\boxed{" + "{" * _MB,
    "boxed then spaces": r"\boxed " + "7" * _MB,
    "a million boxes": r"\boxed{" * _MB,
    "huge fraction": r"\boxed{\frac{" + "1" * _MB + "}{" + "3" * _MB + "}}",
    "many text macros": r"\boxed{" + r"\text{" * (_MB // 6) + "}",
    "4000-digit number vs a float": r"\boxed{" + "9" * 4000 + "}",
}


@pytest.mark.parametrize("answer", list(HOSTILE_ANSWERS.values()), ids=list(HOSTILE_ANSWERS))
@pytest.mark.parametrize("reward", [math_answer, numeric_match, exact_match], ids=lambda f: f.__name__)
def test_hostile_answers_score_zero_within_milliseconds(answer: str, reward) -> None:
    for label in ("7", "2.5", r"\frac{1}{3}"):
        sample = _sample(answer, label)
        start = time.perf_counter()
        assert reward(sample) == 0.0
        # ~0.2 ms here; before the bounds, the exponent never finished and 1e6 characters took ~0.3 s.
        assert time.perf_counter() - start < 0.05, f"{reward.__name__} took {time.perf_counter() - start:.3f} s"


@pytest.mark.parametrize(
    ("text", "label"),
    [
        (r"\boxed{1e3}", "1000"),
        (r"\boxed{2.5E-1}", "0.25"),
        ("x" * _MB + r" so \boxed{42}", "42"),  # a long response still has its answer at the end
        ("blah " * _MB + "the answer is 42", "42"),
        (r"\boxed{" + "1" * 300 + "}", "1" * 300),  # big exact numbers still compare exactly
    ],
)
def test_bounded_parsing_still_reads_real_answers(text: str, label: str) -> None:
    assert math_answer(_sample(text, label)) == 1.0


@pytest.fixture
def reward_module(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        textwrap.dedent(
            """
            import asyncio

            def length_reward(sample):
                return float(len(sample.response_text))

            async def async_reward(sample):
                await asyncio.sleep(0)
                return 2.0

            def flaky(sample):
                if sample.label == "boom":
                    raise RuntimeError("judge unavailable")
                return 1.0

            NOT_CALLABLE = 3
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_rewards"
    sys.modules.pop("my_rewards", None)


def test_custom_reward_by_import_path(reward_module: str) -> None:
    fn = load_reward_fn(f"{reward_module}:length_reward")
    assert fn(_sample("abc", None)) == 3.0
    assert resolve_reward_fn(f"{reward_module}:length_reward") is fn
    assert resolve_reward_fn("math") is not resolve_reward_fn("math")  # math-verify: a worker per reward function


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("no_colon", "must look like 'pkg.module:fn'"),
        ("no_such_module_xyz:fn", "'no_such_module_xyz:fn': cannot import module 'no_such_module_xyz'"),
        ("my_rewards:missing", "'my_rewards:missing': module 'my_rewards' has no attribute 'missing'"),
        ("my_rewards:NOT_CALLABLE", "'my_rewards:NOT_CALLABLE': 'NOT_CALLABLE' is a int, not a function"),
    ],
)
def test_bad_reward_path_errors_name_the_path(reward_module: str, path: str, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_reward_fn(path)


def test_unknown_reward_name_lists_the_choices() -> None:
    with pytest.raises(
        ValueError, match=r"unknown reward 'f1': use one of \['code', 'exact_match', 'math', 'numeric_match'\]"
    ):
        resolve_reward_fn("f1")


def test_score_samples_isolates_failures_and_runs_async_functions(reward_module: str) -> None:
    samples = [_sample("a", "ok", 0), _sample("b", "boom", 1), _sample("c", "ok", 2)]
    scored = score_samples(samples, load_reward_fn(f"{reward_module}:flaky"))
    assert [s.reward for s in scored] == [1.0, 0.0, 1.0]
    assert scored[1].reward_error is not None and "judge unavailable" in scored[1].reward_error
    assert scored[0].reward_error is None and scored[0].response_text == "a"
    assert samples[0].reward is None  # inputs are not mutated
    assert [s.reward for s in score_samples(samples, load_reward_fn(f"{reward_module}:async_reward"))] == [2.0] * 3
    bad = score_samples(samples[:1], lambda s: "high")
    assert bad[0].reward == 0.0 and "not a number" in bad[0].reward_error


@pytest.mark.parametrize(
    ("text", "label", "expected"),
    [
        ("-5", "5", 0.0),  # the sign is part of the answer, both ways
        ("5", "-5", 0.0),
        ("the answer is -3.", "-3", 1.0),
        ("it is .5", "0.5", 1.0),  # a leading decimal point is not stripped
        ("it is 0.5", ".5", 1.0),
        ("1" * 400, "1" * 400, 1.0),  # the longest number compared
        ("1" * 401, "1" * 401, 0.0),  # one digit more is no number
        ("it is 3/0", "3", 0.0),
    ],
)
def test_numeric_match_signs_and_bounds(text: str, label: str, expected: float) -> None:
    assert numeric_match(_sample(text, label)) == expected


@pytest.mark.parametrize(
    ("text", "label", "expected"),
    [
        (r"\boxed{-12}", "12", 0.0),
        (r"\boxed{12}", "-12", 0.0),
        (r"\boxed{-\frac{1}{2}}", "-0.5", 1.0),
        (r"\boxed{1e400}", "1e+400", 1.0),  # the largest exponent compared as a number
        (r"\boxed{1e401}", "1e+401", 0.0),  # beyond it: compared as text, and the texts differ
        (r"\boxed{1_000.5}", "1000.5", 1.0),
        (r"\boxed{nan}", "nan", 1.0),  # not a number: equal as text
        (r"\boxed{7.}", "7", 1.0),
        (r"\boxed{.5}", "0.5", 1.0),
        (r"\boxed 7.", "7", 1.0),  # "\boxed x" ends at the first space; a sentence's full stop is no digit
        (r"\boxed $7$ and more words", "7", 1.0),
        (r"\boxed{\left(3\right)}", "(3)", 1.0),
        (r"\boxed{-\frac{3}{4}}", "-0.75", 1.0),
        (r"\boxed{\frac{-3}{4}}", "-3/4", 1.0),
        (r"\boxed{90^\circ}", "90", 1.0),
        (r"\boxed{90^{\circ}}", "90", 1.0),
        (r"\boxed{1\,000}", "1000", 1.0),
        (r"\boxed{1\!000}", "1000", 1.0),
        (r"\boxed{1\;000}", "1000", 1.0),
        (r"\boxed{50\%}", "50", 1.0),
        (r"\boxed{50%}", "50", 1.0),
        (r"\boxed{x}.", "x", 1.0),
        (r"\boxed{x.}", "x", 1.0),  # a full stop inside the box is dropped too
        (r"\boxed{5X}", "5", 0.0),  # only full stops are dropped
        ("\\boxed   ", "7", 0.0),  # "\boxed" and spaces: no answer
        (r"\boxed{.x}", "x", 0.0),
        (r"\boxed{{1}}", "1", 0.0),  # nested braces are kept: "{1}" is not "1"
        (r"\boxed{a}{b}", "a", 1.0),
    ],
)
def test_math_answer_signs_bounds_and_decorations(text: str, label: str, expected: float) -> None:
    assert math_answer(_sample(text, label)) == expected


def test_last_number_at_the_start_of_the_read_tail():
    assert last_number("7 apples") == "7"  # a short text: a number at its very start counts
    tail = "x" * 4095
    assert last_number("12" + tail) is None  # "2" starts the last 4096 characters, cut from "12": no number
    assert last_number("1 2" + tail[1:]) == "2"  # " 2...": the number starts at position 1 of the tail, whole


def test_score_samples_records_each_failure_and_clears_the_error_of_a_success(caplog):
    async def async_reward(sample: Sample) -> float:
        if sample.label == "boom":
            raise RuntimeError("boom")
        return 0.5

    failed = dataclasses.replace(_sample("x", "ok"), reward_error="an earlier failure")
    scored = score_samples([failed, _sample("x", "boom", group=3)], async_reward)
    assert [s.reward for s in scored] == [0.5, 0.0]
    assert scored[0].reward_error is None
    assert scored[1].reward_error == "RuntimeError('boom')"
    assert caplog.messages == ["reward failed for sample 1 (group 3): RuntimeError('boom')"]
    scored = score_samples([_sample("x", "y")], lambda s: "high")
    assert scored[0].reward == 0.0 and scored[0].reward_error == "returned 'high', not a number"


def test_custom_reward_path_errors_name_the_flag():
    with pytest.raises(ValueError, match=r"--custom-rm-path 'no_such_module_xyz:f'"):
        load_reward_fn("no_such_module_xyz:f")


def test_a_reward_result_keeps_its_figures_on_the_sample_and_rollout_metrics_sums_them() -> None:
    from tidal.rollout import RewardResult, rollout_metrics

    def reward(sample: Sample) -> RewardResult:
        return RewardResult(float(sample.label == "ok"), {"judge/seconds": 0.5, f"judge/{sample.label}": 1.0})

    scored = score_samples([_sample("a", "ok", 0), _sample("b", "no", 1), _sample("c", "ok", 2)], reward)
    assert [s.reward for s in scored] == [1.0, 0.0, 1.0]
    assert scored[1].reward_metrics == {"judge/seconds": 0.5, "judge/no": 1.0} and scored[1].reward_error is None
    metrics = rollout_metrics(scored)
    assert (metrics["rollout/judge/seconds"], metrics["rollout/judge/ok"], metrics["rollout/judge/no"]) == (1.5, 2, 1)
