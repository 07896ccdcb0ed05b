"""Run-time errors raised by tidal.rollout."""


class RolloutError(RuntimeError):
    """A rollout engine failed at run time (start-up, generation, weight update)."""


class EngineUnavailableError(RolloutError):
    """A request could not reach its server, or the connection broke mid-answer (the server may have died)."""
