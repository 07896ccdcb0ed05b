"""tidal.placement."""
