"""Run-time errors raised by tidal.batching (bad user input raises ValueError instead)."""


class BatchingError(RuntimeError):
    """A batching invariant failed at run time (e.g. a sample missing when unpacking outputs)."""
