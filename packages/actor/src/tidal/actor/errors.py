"""Run-time errors of tidal.actor (bad config or input raises ValueError instead)."""


class ActorError(RuntimeError):
    """A failure while building, running or training the actor model."""
