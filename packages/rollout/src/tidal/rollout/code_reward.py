"""``--rm-type code``: the response's program run against its row's tests, each case in a sandbox.

The reward is 1.0 when every case passes and 0.0 otherwise (cases run in order and stop at the first failure).
A zero says why in its sample's metrics, counted per rollout as ``rollout/code/zero/<reason>``; the sandbox's
seconds are summed as ``rollout/code/sandbox_s``. Samples run concurrently, at most
``--code-sandbox-max-concurrency`` sandboxes at once in the process.
"""

from __future__ import annotations

import asyncio
import logging
import weakref

from tidal.rollout.code_tests import BadTests, Case, last_code_block, output_matches, parse_tests
from tidal.rollout.config import RolloutConfig
from tidal.rollout.sandbox import RunResult, SandboxLimits, run_program
from tidal.rollout.types import RewardResult, Sample

logger = logging.getLogger(__name__)

REASONS = (
    "no_code",
    "bad_tests",
    "wrong_answer",
    "runtime_error",
    "timeout",
    "cpu_limit",
    "memory_limit",
    "process_limit",
    "disk_limit",
    "output_limit",
    "network",
    "sandbox_error",
)
"""Why a program scored 0 (a metric ``rollout/code/zero/<reason>`` each)."""

_SIGKILL, _SIGXCPU, _SIGXFSZ = 128 + 9, 128 + 24, 128 + 25


def failure_reason(case: Case, result: RunResult) -> str | None:
    """Why ``result`` fails ``case`` (one of :data:`REASONS`), or None when it passes."""
    if result.killed is not None:
        return result.killed
    if result.setup_failed:
        return "sandbox_error"
    if result.exit_code == 0:
        return None if case.expected is None or output_matches(case, result.stdout) else "wrong_answer"
    err = result.stderr
    if "MemoryError" in err:
        return "memory_limit"
    if "BlockingIOError" in err and "Resource temporarily unavailable" in err:
        return "process_limit"
    if "Network is unreachable" in err:
        return "network"
    by_signal = {_SIGKILL: "cpu_limit", _SIGXCPU: "cpu_limit", _SIGXFSZ: "disk_limit"}
    return by_signal.get(result.exit_code or 0, "runtime_error")


class CodeReward:
    """The ``code`` reward: an async callable on a :class:`Sample`, with limits and concurrency from the config."""

    def __init__(self, limits: SandboxLimits, max_concurrency: int) -> None:
        """Run each case under ``limits``, at most ``max_concurrency`` at once."""
        self.limits, self.max_concurrency = limits, max_concurrency
        self._warned_bad_tests = False
        self._slots: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = (
            weakref.WeakKeyDictionary()
        )

    @classmethod
    def from_config(cls, cfg: RolloutConfig) -> CodeReward:
        """The reward ``cfg`` describes (``--code-sandbox-*``)."""
        limits = SandboxLimits(wall_s=cfg.code_sandbox_timeout_s, memory_mb=cfg.code_sandbox_memory_mb)
        return cls(limits, cfg.code_sandbox_max_concurrency)

    def _slot(self) -> asyncio.Semaphore:
        """This event loop's semaphore (each ``score_samples`` call runs its own loop)."""
        loop = asyncio.get_running_loop()
        if loop not in self._slots:
            self._slots[loop] = asyncio.Semaphore(self.max_concurrency)
        return self._slots[loop]

    async def __call__(self, sample: Sample) -> RewardResult:
        """1.0 when the last code block of the response passes every case of the label's tests, else 0.0."""
        program = last_code_block(sample.response_text)
        if program is None:
            return _zero("no_code", 0.0, 0)
        try:
            cases = parse_tests(sample.label)
        except BadTests as e:
            if not self._warned_bad_tests:  # once: a data set in another layout would repeat it for every sample
                self._warned_bad_tests = True
                logger.warning("--rm-type code: a label's tests are unusable (%s), e.g. %.200r", e, sample.label)
            return _zero("bad_tests", 0.0, 0)
        seconds = 0.0
        for run, case in enumerate(cases, 1):
            async with self._slot():
                files = {"solution.py": program, **dict(case.extra_files)}
                result = await run_program(files, case.script, case.stdin.encode(), limits=self.limits)
            seconds += result.seconds
            reason = failure_reason(case, result)
            if reason is not None:
                return _zero(reason, seconds, run)
        return RewardResult(1.0, {"code/sandbox_s": seconds, "code/cases_run": float(len(cases))})


def _zero(reason: str, seconds: float, cases_run: int) -> RewardResult:
    metrics = {"code/sandbox_s": seconds, "code/cases_run": float(cases_run), f"code/zero/{reason}": 1.0}
    return RewardResult(0.0, metrics)
