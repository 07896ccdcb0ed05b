"""A single-turn ``verifiers`` environment written with verifiers itself, for the `train --environment` tests.

Fixed-width addition (``"07+45="`` -> ``"052"``) as a ``verifiers.v1`` taskset whose rubric has two weighted
rewards: 1.0 for the exact sum, 0.5 for an answer of digits only (so a reward tells which terms held). Its
harness is verifiers' own ``null`` chat program (one model call, then the answer), run as a subprocess.
"""

import random

import verifiers.v1 as vf
from verifiers.v1.harnesses.null import NullHarness

NUM_TASKS = 16
EXACT_WEIGHT = 1.0
DIGITS_WEIGHT = 0.5


class AdditionData(vf.TaskData):
    """One sum and its answer, three digits wide."""

    answer: str


class AdditionTask(vf.Task[AdditionData]):
    """The rubric: the exact sum, and digits only."""

    @vf.reward(weight=EXACT_WEIGHT)
    async def exact(self, trace: vf.Trace) -> float:
        return float(trace.last_reply.strip() == self.data.answer)

    @vf.reward(weight=DIGITS_WEIGHT)
    async def digits(self, trace: vf.Trace) -> float:
        return float(trace.last_reply.strip().isdigit())


class AdditionTaskset(vf.Taskset[AdditionTask, vf.TasksetConfig]):
    """NUM_TASKS sums of two two-digit numbers, the same ones every time."""

    def load(self) -> list[AdditionTask]:
        rng = random.Random(0)
        pairs = [(rng.randrange(100), rng.randrange(100)) for _ in range(NUM_TASKS)]
        return [
            AdditionTask(AdditionData(prompt=f"{a:02d}+{b:02d}=", answer=f"{a + b:03d}"), self.config.task)
            for a, b in pairs
        ]


def expected_reward(reply: str, answer: str) -> float:
    """The rubric's reward of ``reply``, computed here (the test compares the run's rewards with it)."""
    reply = reply.strip()
    return EXACT_WEIGHT * (reply == answer) + DIGITS_WEIGHT * reply.isdigit()


__all__ = ["AdditionTaskset", "NullHarness"]
