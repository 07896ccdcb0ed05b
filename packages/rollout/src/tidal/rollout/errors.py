"""Run-time errors raised by tidal.rollout."""


class RolloutError(RuntimeError):
    """A rollout engine failed at run time (start-up, generation, weight update)."""
