"""tidal.batching."""
