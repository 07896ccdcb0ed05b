"""Run-time errors of tidal.actor (bad config or input raises ValueError instead)."""


class ActorError(RuntimeError):
    """A failure while building, running or training the actor model."""


class ActorOutOfMemoryError(ActorError):
    """A training or log-prob micro-batch ran out of GPU memory; the message names the budget that would fit."""
