r"""``--rm-type math``: math-verify's symbolic and numeric equivalence, in a worker process with a hard time limit.

math-verify (Hugging Face's grader) extracts the final answer of a response (``\boxed{}`` first, then the last LaTeX
or plain expression) and compares it with the label through sympy: ``\frac{1}{2}``, ``0.5`` and ``1/2`` are one
answer, as are ``2\sqrt{2}`` and ``\sqrt{8}``, two ways to write an interval or a set, ``25\%`` and ``0.25``,
``5 \text{ cm}`` and ``5``, ``1,000`` and ``1000``.

A sympy simplification can run for minutes (``10^{10^{10^{10}}}``) and math-verify's own timeout is a SIGALRM that
works only in a process's main thread, so every comparison runs in one worker process per reward function: an answer
that takes longer than the limit kills the worker (a fresh one starts for the next sample) and scores 0 with a
:class:`MathTimeout`, which the rollout's metrics count by kind (``rollout/reward_errors/MathTimeout``).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import select
import subprocess
import sys
import threading
import time

from tidal.rollout.errors import RolloutError
from tidal.rollout.types import Sample

logger = logging.getLogger(__name__)

MAX_RESPONSE_CHARS = 4096
"""Only the end of a response is graded (where the final answer is); a longer one is cut from the front."""
WORKER_START_TIMEOUT_S = 120.0
"""Most seconds a worker may take to import math-verify and say it is ready."""


class MathTimeout(RolloutError):
    """Grading one answer took longer than ``--rm-math-timeout-s``; the sample scores 0."""


class MathVerifier:
    """A reward function: 1.0 when math-verify finds the response's final answer equal to the label, else 0.0.

    Thread-safe (one comparison at a time per instance); the worker process starts on the first call.
    """

    def __init__(self, timeout_s: float = 5.0) -> None:
        """``timeout_s``: most wall seconds one comparison may take, worker start-up not included."""
        if not timeout_s > 0:
            raise ValueError(f"--rm-math-timeout-s must be > 0, got {timeout_s}")
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None

    def __call__(self, sample: Sample) -> float:
        """Grade ``sample.response_text`` against ``sample.label``."""
        request = {"pred": sample.response_text[-MAX_RESPONSE_CHARS:], "gold": str(sample.label)}
        with self._lock:
            proc = self._worker()
            assert proc.stdin is not None and proc.stdout is not None
            proc.stdin.write(json.dumps(request) + "\n")
            proc.stdin.flush()
            line = _read_line(proc, self.timeout_s)
            if line is None:
                self._stop()
                raise MathTimeout(f"math-verify took more than {self.timeout_s:g} s on {request['pred'][-80:]!r}")
        reply = json.loads(line)
        if "error" in reply:
            raise RolloutError(f"math-verify failed: {reply['error']}")
        return float(reply["score"])

    def _worker(self) -> subprocess.Popen:
        if self._proc is not None and self._proc.poll() is None:
            return self._proc
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "tidal.rollout.verified_math"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        if _read_line(self._proc, WORKER_START_TIMEOUT_S) != "ready":
            self._stop()
            raise RolloutError(f"the math-verify worker did not start within {WORKER_START_TIMEOUT_S:g} s")
        return self._proc

    def _stop(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None

    def close(self) -> None:
        """Stop the worker process (a later call starts a new one)."""
        with self._lock:
            self._stop()

    def __del__(self) -> None:
        proc = getattr(self, "_proc", None)
        if proc is not None and proc.poll() is None:
            proc.kill()


def _read_line(proc: subprocess.Popen, timeout_s: float) -> str | None:
    """The worker's next line, or None when none came within ``timeout_s`` (or it exited)."""
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0:
        ready, _, _ = select.select([proc.stdout], [], [], left)
        if ready:
            line = proc.stdout.readline()
            return line.strip() if line else None
    return None


@functools.lru_cache(maxsize=4096)
def _parse_label(gold: str) -> list:
    from math_verify import parse

    wrapped = gold if "\\boxed" in gold or "$" in gold else f"${gold}$"  # a plain label is read as LaTeX math too
    return parse(wrapped, parsing_timeout=None) or parse(gold, parsing_timeout=None)


def grade(pred: str, gold: str) -> float:
    """math-verify's verdict on ``pred`` (a response) against ``gold`` (a label, LaTeX or plain), in this process.

    No time limit here (math-verify's SIGALRM is off): :class:`MathVerifier` bounds the worker that calls it.
    """
    from math_verify import parse, verify

    expected, answer = _parse_label(gold), parse(pred, parsing_timeout=None)
    return float(bool(expected and answer and verify(expected, answer, timeout_seconds=None)))


def _serve() -> None:
    import math_verify  # noqa: F401  (imported before "ready": the first sample's time limit excludes it)

    logging.getLogger("math_verify").setLevel(logging.ERROR)  # its warning that its own timeout is off
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    for line in sys.stdin:
        request = json.loads(line)
        try:
            reply = {"score": grade(request["pred"], request["gold"])}
        except Exception as e:  # a parse or sympy failure is this sample's, not the worker's
            reply = {"error": f"{type(e).__name__}: {e}"[:300]}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    _serve()
