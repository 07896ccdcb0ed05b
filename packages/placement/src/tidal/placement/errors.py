"""Run-time errors of tidal.placement (bad flags are ``ValueError`` from :mod:`tidal.placement.config`)."""


class PlacementError(RuntimeError):
    """Ray could not place the job: a placement group timed out, a port ran out, a layout is impossible."""


class ResourceShortageError(PlacementError):
    """The live Ray cluster has fewer GPUs/CPUs than the flags need; raised before anything is created."""
