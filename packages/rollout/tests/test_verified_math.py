r"""``--rm-type math``: math-verify's verdicts on a table of answer pairs, its time limit, and the rules it replaced.

The table is the measurement behind the choice of grader: ``RULES_MISS`` lists the equivalent pairs the
hand-written rules (``tidal.rollout.rewards.math_answer``) score 0 and math-verify scores 1; no pair goes the
other way (``test_the_rules_are_nowhere_better``).
"""

from __future__ import annotations

import time

import pytest
from tidal.rollout import MathVerifier, Sample, resolve_reward_fn, score_samples
from tidal.rollout.generation import rollout_metrics
from tidal.rollout.rewards import math_answer
from tidal.rollout.verified_math import MathTimeout

EQUIVALENT = [
    ("The answer is \\boxed{\\frac{1}{2}}", "0.5"),
    ("so \\boxed{0.5}", "\\frac{1}{2}"),
    ("answer: 1/2", "\\frac12"),
    ("\\boxed{\\dfrac{3}{4}}", "3/4"),
    ("\\boxed{\\frac{2}{4}}", "\\frac{1}{2}"),
    ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}"),
    ("\\boxed{\\sqrt{2}/2}", "\\frac{1}{\\sqrt{2}}"),
    ("\\boxed{(1, 3]}", "(1,3]"),
    ("\\boxed{(-\\infty, 2) \\cup (3, \\infty)}", "(-\\infty,2)\\cup(3,\\infty)"),
    ("\\boxed{\\{1, 2, 3\\}}", "\\{3,2,1\\}"),
    ("\\boxed{5 \\text{ cm}}", "5"),
    ("\\boxed{12\\text{ meters}}", "12"),
    ("\\boxed{90^\\circ}", "90"),
    ("\\boxed{50\\%}", "50"),
    ("\\boxed{25\\%}", "0.25"),
    ("\\boxed{1,000}", "1000"),
    ("The total is 1,234,567", "1234567"),
    ("\\text{Final: \\boxed{7}}", "7"),
    ("\\text{The answer is } \\boxed{42}", "42"),
    ("\\boxed{\\text{(B)}}", "B"),
    ("\\boxed{x^2+2x+1}", "(x+1)^2"),
    ("\\boxed{\\pi/2}", "\\frac{\\pi}{2}"),
    ("\\boxed{x=4}", "4"),
    ("12+34=046", "046"),
    ("I think it's 12.", "12"),
    ("-2.5", "-5/2"),
]
NOT_EQUIVALENT = [
    ("\\boxed{\\sqrt{3}}", "\\sqrt{2}"),
    ("\\boxed{[1, 3]}", "(1,3]"),
    ("\\boxed{\\{1, 2\\}}", "\\{1,2,3\\}"),
    ("\\boxed{7 \\text{ cm}}", "5"),
    ("\\boxed{30\\%}", "50"),
    ("\\boxed{1,001}", "1000"),
    ("\\boxed{x^2+1}", "(x+1)^2"),
    ("\\boxed{-3}", "3"),
    ("\\boxed{0.333}", "\\frac{1}{3}"),
    ("First 3, then 5. Answer: 5", "3"),
    ("no answer here", "3"),
]
RULES_MISS = {  # equivalent pairs the hand-written rules score 0
    "\\boxed{2\\sqrt{2}}", "\\boxed{\\sqrt{2}/2}", "\\boxed{\\{1, 2, 3\\}}", "\\boxed{5 \\text{ cm}}",
    "\\boxed{12\\text{ meters}}", "\\boxed{25\\%}", "\\boxed{\\text{(B)}}", "\\boxed{x^2+2x+1}", "\\boxed{\\pi/2}",
    "\\boxed{x=4}",
}  # fmt: skip


def _sample(text: str, label: object) -> Sample:
    return Sample(prompt_ids=[1], response_ids=[2], response_log_probs=[-0.1], finish_reason="stop", label=label,
                  response_text=text)  # fmt: skip


@pytest.fixture(scope="module")
def grader():
    reward = resolve_reward_fn("math", math_timeout_s=10.0)
    assert isinstance(reward, MathVerifier)
    yield reward
    reward.close()


def test_equivalent_and_non_equivalent_answers(grader):
    verdicts = {(r, label): grader(_sample(r, label)) for r, label in EQUIVALENT + NOT_EQUIVALENT}
    assert [pair for pair in EQUIVALENT if verdicts[pair] != 1.0] == []
    assert [pair for pair in NOT_EQUIVALENT if verdicts[pair] != 0.0] == []


def test_the_rules_are_nowhere_better():
    rules = {r: math_answer(_sample(r, label)) for r, label in EQUIVALENT + NOT_EQUIVALENT}
    assert {r for r, _ in EQUIVALENT if rules[r] == 0.0} == RULES_MISS
    assert [r for r, _ in NOT_EQUIVALENT if rules[r] != 0.0] == []


def test_a_pathological_answer_costs_the_time_limit_scores_zero_and_is_counted():
    grader = MathVerifier(timeout_s=1.0)
    try:
        assert grader(_sample("\\boxed{1}", "1")) == 1.0  # the worker is up: its start-up is not the limit's
        samples = [_sample("\\boxed{10^{10^{10^{10}}}}", "1"), _sample("\\boxed{2}", "2")]
        start = time.monotonic()
        with pytest.raises(MathTimeout, match="math-verify took more than 1 s"):
            grader(samples[0])
        assert time.monotonic() - start < 1.5
        scored = score_samples(samples, grader)  # the next answer gets a fresh worker
        assert [s.reward for s in scored] == [0.0, 1.0]
        metrics = rollout_metrics(scored)
        assert metrics["rollout/reward_errors"] == 1.0 and metrics["rollout/reward_errors/MathTimeout"] == 1.0
    finally:
        grader.close()
    assert grader._proc is None


def test_the_time_limit_is_checked():
    with pytest.raises(ValueError, match="--rm-math-timeout-s must be > 0, got 0"):
        MathVerifier(timeout_s=0)
