"""Weight sync, in one home: the plan resolved from the flags, the driver's protocol, the rank's sender, the probe.

Adding a transport (adapters, deltas) touches :mod:`.sync` (the driver's steps) and :mod:`.sender` (what a rank
sends), and the plan's fields; nothing else in the app.
"""

from tidal.train.weight_sync.plan import SyncPlan, resolve_sync_plan
from tidal.train.weight_sync.probe import probe_gap
from tidal.train.weight_sync.sync import EngineWeights, ServingEngines, WeightExport, WeightSync

__all__ = [
    "EngineWeights",
    "ServingEngines",
    "SyncPlan",
    "WeightExport",
    "WeightSync",
    "probe_gap",
    "resolve_sync_plan",
]
