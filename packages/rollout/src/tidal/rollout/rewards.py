"""Rule-based rewards and custom reward functions loaded by import path (``pkg.module:fn``)."""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import logging
import re
from collections.abc import Awaitable, Callable, Sequence
from fractions import Fraction
from typing import Any, Protocol

from tidal.rollout.config import RolloutConfig
from tidal.rollout.import_path import load_callable
from tidal.rollout.types import RewardResult, Sample

logger = logging.getLogger(__name__)

# A number as people write it: sign, thousands separators, decimals, a plain fraction ("3/4").
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")
_BRACE = re.compile(r"[{}]")
_EXPONENT = re.compile(r"[eE]\s*[+-]?([\d_]+)")

# Model output is hostile input: a reward reads only the end of a response (where the final answer is; slime's
# DAPO math reward reads the last 300 characters), compares numbers of bounded length exactly, and refuses
# exponents beyond any answer's range (``Fraction("1e999999999")`` would compute 10**999999999).
_MAX_TAIL_CHARS = 4096
_MAX_NUMBER_CHARS = 400
_MAX_EXPONENT = 400


class RewardFn(Protocol):
    """A reward function: one sample in, a scalar (or a :class:`RewardResult`) out, or an awaitable of one."""

    def __call__(self, sample: Sample) -> float | RewardResult | Awaitable[float | RewardResult]:
        """Score ``sample`` (use ``sample.response_text`` and ``sample.label``)."""
        ...


def _parse_number(text: str) -> Fraction | None:
    """``text`` as an exact number, or None (empty, too long, an exponent out of range, or not a number).

    ``Fraction`` reads every finite number ``float`` reads (signs, decimals, exponents, underscores) and plain
    fractions besides, so numbers compare exactly (``1/2`` equals ``0.5``; nan and infinities are no numbers).
    """
    text = text.strip().replace(",", "").rstrip(".")
    if not text or len(text) > _MAX_NUMBER_CHARS:
        return None
    exponent = _EXPONENT.search(text)
    if exponent is not None and int(exponent.group(1).replace("_", "") or 0) > _MAX_EXPONENT:
        return None
    try:
        return Fraction(text)
    except (ValueError, ZeroDivisionError):
        return None


def _tail(text: str) -> str:
    """The end of ``text`` that answers are looked for in (the whole text when it is short)."""
    return text[-_MAX_TAIL_CHARS:]


def last_number(text: str) -> str | None:
    """The last number written in ``text`` ("1,000", "-2.5", "3/4"), or None.

    Only the last 4096 characters of ``text`` are read: a number that does not start within them is none.
    """
    tail = _tail(text)
    matches = list(_NUMBER.finditer(tail))
    if not matches or (matches[-1].start() == 0 and len(tail) < len(text)):
        return None
    return matches[-1].group()


def extract_boxed(text: str) -> str | None:
    r"""The content of the last ``\boxed{...}`` (nested braces allowed) or ``\boxed x``, or None.

    Only the last 4096 characters of ``text`` are read: a ``\boxed`` before them, or one left open, is no answer.
    """
    tail = _tail(text)
    start = tail.rfind("\\boxed")
    if start < 0:
        return None
    rest = tail[start + len("\\boxed") :]
    if rest.startswith(" "):
        words = rest.split(maxsplit=1)
        return words[0].rstrip("$.") if words else None
    if not rest.startswith("{"):
        return None
    depth = 0
    for brace in _BRACE.finditer(rest):
        depth += 1 if brace.group() == "{" else -1
        if depth == 0:
            return rest[1 : brace.start()]
    return None  # unbalanced braces: no answer


def normalize_math_answer(answer: str) -> str:
    r"""Strip LaTeX decoration that does not change a final answer (``$``, ``\text{}``, ``\left``, ...)."""
    s = answer.strip()
    s = re.sub(r"\\text\{([^{}]*)\}", r"\1", s)
    s = re.sub(r"\\[dt]frac", r"\\frac", s)
    s = re.sub(r"\\frac\{([^{}]*)\}\{([^{}]*)\}", r"(\1)/(\2)", s)
    s = re.sub(r"\\frac(\d)(\d)", r"\1/\2", s)
    for token in ("\\left", "\\right", "\\!", "\\,", "\\;", "$", "^\\circ", "^{\\circ}", "\\%", "%"):
        s = s.replace(token, "")
    s = re.sub(r"\s+", "", s).rstrip(".")
    s = re.sub(r"^(-?)\((-?[\d.]+)\)/\((-?[\d.]+)\)$", r"\1\2/\3", s)  # "(3)/(4)" -> "3/4", "-(1)/(2)" -> "-1/2"
    return s


def exact_match(sample: Sample) -> float:
    """1.0 when the response equals the label up to surrounding and repeated whitespace, else 0.0."""
    return float(" ".join(sample.response_text.split()) == " ".join(str(sample.label).split()))


def numeric_match(sample: Sample) -> float:
    """1.0 when the last number in the response equals the label's (last) number, else 0.0."""
    predicted, expected = last_number(sample.response_text), last_number(str(sample.label))
    if predicted is None or expected is None:
        return 0.0
    a = _parse_number(predicted)
    return float(a is not None and a == _parse_number(expected))


def math_answer(sample: Sample) -> float:
    r"""1.0 when the final answer (last ``\boxed{}``, else the last number) matches the label, by rules alone.

    ``--rm-type math`` grades with math-verify, which matched or beat these rules on every pair of the reward tests;
    this one stays for ``--custom-rm-path tidal.rollout.rewards:math_answer`` (no sympy, no worker process).

    Answers are compared as numbers when both parse as one (``\frac{1}{2}`` equals ``0.5``), else as
    normalized LaTeX strings.
    """
    response = sample.response_text
    predicted = extract_boxed(response)
    if predicted is None:
        predicted = last_number(response)
    if predicted is None:
        return 0.0
    label = str(sample.label)
    expected = extract_boxed(label) or label
    a, b = normalize_math_answer(predicted), normalize_math_answer(expected)
    na, nb = _parse_number(a), _parse_number(b)
    if na is not None and nb is not None:
        return float(na == nb)
    return float(a == b)


BUILTIN_REWARDS: dict[str, RewardFn] = {
    "exact_match": exact_match,
    "numeric_match": numeric_match,
}
"""Built-in rewards that are plain functions; ``math`` (math-verify in a worker, :mod:`tidal.rollout.verified_math`)
is made per call of :func:`resolve_reward_fn`."""


def load_reward_fn(path: str) -> RewardFn:
    """Import a reward function given as ``pkg.module:fn``.

    Raises:
        ValueError: The path is malformed, the module cannot be imported, or the attribute is missing
            or not callable; the message names the path.
    """
    return load_callable(path, flag="--custom-rm-path")


def resolve_reward_fn(spec: str, cfg: RolloutConfig | None = None, *, math_timeout_s: float | None = None) -> RewardFn:
    """A built-in reward by name (``exact_match``, ``numeric_match``, ``math``, ``code``) or one by import path.

    ``math`` grades with math-verify, each answer within ``math_timeout_s`` seconds (default: ``cfg``'s
    ``--rm-math-timeout-s``); ``code`` runs programs in a sandbox under ``cfg``'s ``--code-sandbox-*`` limits (the
    defaults without ``cfg``).
    """
    if spec == "code":
        from tidal.rollout.code_reward import CodeReward

        return CodeReward.from_config(cfg or RolloutConfig(rm_type="code"))
    if spec == "math":
        from tidal.rollout.verified_math import MathVerifier

        return MathVerifier(math_timeout_s or (cfg.rm_math_timeout_s if cfg is not None else 5.0))
    if spec in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[spec]
    if ":" in spec:
        return load_reward_fn(spec)
    names = sorted([*BUILTIN_REWARDS, "math", "code"])
    raise ValueError(f"unknown reward {spec!r}: use one of {names} or an import path 'pkg.module:fn'")


async def _await_all(pending: dict[int, Awaitable[Any]]) -> dict[int, Any]:
    results = await asyncio.gather(*pending.values(), return_exceptions=True)
    return dict(zip(pending, results, strict=True))


def score_samples(samples: Sequence[Sample], reward_fn: RewardFn | Callable[[Sample], Any]) -> list[Sample]:
    """Score every sample; a failure marks its own sample (reward 0.0, ``reward_error``) and no other.

    ``reward_fn`` may be sync or async; async calls run concurrently. A :class:`RewardResult`'s figures go to the
    sample's ``reward_metrics``. Call from synchronous code.
    """
    outcomes: dict[int, Any] = {}
    pending: dict[int, Awaitable[Any]] = {}
    for i, sample in enumerate(samples):
        try:
            result = reward_fn(sample)
        except Exception as e:  # one bad sample must not lose the batch
            outcomes[i] = e
            continue
        if inspect.isawaitable(result):
            pending[i] = result
        else:
            outcomes[i] = result
    if pending:
        outcomes.update(asyncio.run(_await_all(pending)))
    scored = []
    for i, sample in enumerate(samples):
        outcome = outcomes[i]
        details = None
        if isinstance(outcome, RewardResult):
            outcome, details = outcome.value, dict(outcome.metrics)
        if isinstance(outcome, BaseException) or not isinstance(outcome, int | float):
            error = repr(outcome) if isinstance(outcome, BaseException) else f"returned {outcome!r}, not a number"
            logger.warning("reward failed for sample %d (group %d): %s", i, sample.group_index, error)
            scored.append(dataclasses.replace(sample, reward=0.0, reward_error=error))
        else:
            scored.append(dataclasses.replace(sample, reward=float(outcome), reward_error=None, reward_metrics=details))
    return scored
